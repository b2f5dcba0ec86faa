"""RLHFEngine: actor, critic, reference and reward as four DeepSpeed engines, behind the interface the trainer uses.

Every forward passes the rollout's position ids and runs in micro-batches; experience forwards run in eval mode under
no_grad; log-probs are fp32. Losses handed to `backward` must be sums over this rank's tokens divided by the GLOBAL
token count of the mini-batch (see ppo_math): DeepSpeed averages gradients over ranks and divides by the accumulation
steps, so `backward` multiplies by the world size and turns DeepSpeed's accumulation scaling off.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from ..config import TrainConfig
from ..ppo_math import entropy_from_logits, logprobs_from_logits
from ..rollout import Rollout
from .distributed import DistInfo
from .models import ScalarHeadModel
from .preflight import RolePlan, plan_roles
from .role_engine import (backward_global, build_role_engine, export_engine, full_state_dict, rollout_inputs,
                          sequence_scores, write_ds_config)

log = logging.getLogger(__name__)
TRAINED = ("actor", "critic")


def load_tokenizer(path: str):
    """The actor's tokenizer, left-padded; a missing pad token becomes EOS (logged)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(f"tokenizer at {path} has neither a pad nor an EOS token; add one")
        tok.pad_token = tok.eos_token
        log.warning("tokenizer has no pad token: using EOS %r as pad", tok.eos_token)
    return tok


class RLHFEngine:
    def __init__(self, cfg: TrainConfig, dist: DistInfo, num_training_steps: int,
                 output_dir: Optional[str] = None):
        self.cfg, self.dist = cfg, dist
        self.plans: dict[str, RolePlan] = plan_roles(cfg)  # raises before any weight is read
        self.tokenizer = load_tokenizer(cfg.actor.tokenizer_name_or_path or self.plans["actor"].path)
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.stop_token_ids = sorted({int(self.tokenizer.eos_token_id), *map(int, cfg.generation.stop_token_ids)})
        self.experience_micro_batch = (cfg.batch.experience_micro_batch_size
                                       or cfg.batch.per_device_generation_batch_size)
        g = cfg.generation
        self.temperature = g.temperature if g.do_sample else 1.0
        self.use_position_ids = True  # test hook: False reproduces the trlx left-padding bug
        self.ds_configs: dict[str, dict] = {}
        self.engines = {}
        for role, plan in self.plans.items():
            kind = "causal_lm" if role in ("actor", "reference") else "scalar"
            engine, ds_cfg = build_role_engine(
                getattr(cfg, role), plan.path, kind=kind, stage=plan.stage, dtype=plan.dtype, train=plan.train,
                batch=cfg.batch, world_size=dist.world_size, eval_micro_batch_size=self.experience_micro_batch,
                num_training_steps=num_training_steps, pad_token_id=self.pad_token_id)
            self.ds_configs[role] = ds_cfg
            self.engines[role] = engine
        if output_dir and dist.is_main:
            for role, ds_cfg in self.ds_configs.items():
                write_ds_config(output_dir, role, ds_cfg)

    # ---- roles ---------------------------------------------------------------------------------------------
    @property
    def actor(self):
        return self.engines["actor"]

    @property
    def critic(self):
        return self.engines["critic"]

    @property
    def reference(self):
        return self.engines["reference"]

    @property
    def reward(self):
        return self.engines["reward"]

    @property
    def device(self) -> torch.device:
        return self.dist.device

    # ---- generation ----------------------------------------------------------------------------------------
    def generation_kwargs(self) -> dict:
        """The resolved `generate` arguments: our flags override the model's generation_config."""
        g = self.cfg.generation
        kw = dict(max_new_tokens=g.max_answer_seq_len, do_sample=g.do_sample, eos_token_id=self.stop_token_ids,
                  pad_token_id=self.pad_token_id, use_cache=True,
                  synced_gpus=self.plans["actor"].stage == 3 and self.dist.world_size > 1)
        if g.min_answer_seq_len:
            kw["min_new_tokens"] = g.min_answer_seq_len
        if g.do_sample:
            kw.update(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k or None)
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        return kw

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor) -> Rollout:
        """prompt_ids, prompt_attention_mask [B, P] left-padded -> Rollout (canonical layout)."""
        import copy

        model = self.actor.module
        was_training = model.training
        model.eval()
        kw = self.generation_kwargs()
        if not getattr(self, "_logged_generation", False):
            self._logged_generation = True
            if self.dist.is_main:
                log.info("generation arguments: %s", kw)
        synced = kw.pop("synced_gpus")
        gen_config = copy.deepcopy(model.generation_config)
        gen_config.update(**kw)
        try:
            out = model.generate(input_ids=prompt_ids.to(self.device),
                                 attention_mask=prompt_attention_mask.to(self.device),
                                 generation_config=gen_config, synced_gpus=synced)
        finally:
            model.train(was_training)
        return Rollout.from_generation(prompt_ids.to(self.device), prompt_attention_mask.to(self.device), out,
                                       self.stop_token_ids, self.pad_token_id)

    # ---- forwards ------------------------------------------------------------------------------------------
    def _inputs(self, r: Rollout) -> dict:
        return rollout_inputs(r, self.use_position_ids)

    def _lm_forward(self, engine, r: Rollout, with_entropy: bool):
        logits = engine(**self._inputs(r), use_cache=False).logits
        logits = r.action_slice(logits)  # [B, R, V]: the logits that predict each response token
        logprobs = logprobs_from_logits(logits, r.responses, temperature=self.temperature) * r.action_mask
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits, temperature=self.temperature) * r.action_mask
        return logprobs, entropy

    def _eval_chunks(self, role: str, rollout: Rollout, fn) -> list:
        engine = self.engines[role]
        was_training = engine.training
        engine.eval()
        try:
            with torch.no_grad():
                return [fn(engine, mb) for mb in rollout.split(self.experience_micro_batch)]
        finally:
            engine.train(was_training)

    def actor_logprobs(self, rollout: Rollout, with_entropy: bool = False):
        """[B, R] fp32 actor log-probs (0 on padding), eval mode; with_entropy also returns [B, R] entropy."""
        outs = self._eval_chunks("actor", rollout, lambda e, mb: self._lm_forward(e, mb, with_entropy))
        lp = torch.cat([o[0] for o in outs])
        return (lp, torch.cat([o[1] for o in outs])) if with_entropy else lp

    def ref_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """[B, R] fp32 reference log-probs (0 on padding)."""
        return torch.cat(self._eval_chunks("reference", rollout, lambda e, mb: self._lm_forward(e, mb, False)[0]))

    def _per_position(self, engine, r: Rollout) -> torch.Tensor:
        return engine(**self._inputs(r))  # ScalarHeadModel: [B, L]

    def critic_values(self, rollout: Rollout) -> torch.Tensor:
        """[B, R] fp32 values V(state before action t), read at positions P-1+t; 0 on padding."""
        return torch.cat(self._eval_chunks(
            "critic", rollout, lambda e, mb: mb.action_slice(self._per_position(e, mb)) * mb.action_mask))

    def reward_scores(self, rollout: Rollout) -> torch.Tensor:
        """[B] fp32 reward-model score at the last real token of each sequence (EOS included): `sequence_scores`, the
        function the reward-model trainer scores with."""
        return torch.cat(self._eval_chunks(
            "reward", rollout, lambda e, mb: sequence_scores(e, mb, self.use_position_ids)))

    # ---- training ------------------------------------------------------------------------------------------
    def actor_forward(self, rollout: Rollout, with_entropy: bool = False):
        """Training forward (with grad): ([B, R] log-probs, [B, R] entropy or None)."""
        self.actor.train()
        return self._lm_forward(self.actor, rollout, with_entropy)

    def critic_forward(self, rollout: Rollout) -> torch.Tensor:
        """Training forward (with grad): [B, R] values."""
        self.critic.train()
        return rollout.action_slice(self._per_position(self.critic, rollout)) * rollout.action_mask

    def backward(self, role: str, loss: torch.Tensor) -> None:
        """Backward of a globally token-normalised loss share (see module docstring)."""
        backward_global(self.engines[role], loss, self.dist.world_size)

    def step(self, role: str) -> None:
        """Call after every micro-batch's backward; the optimizer steps at the accumulation boundary."""
        self.engines[role].step()

    def optimizer_steps(self, role: str) -> int:
        return int(self.engines[role].global_steps)

    def is_boundary(self, role: str) -> bool:
        return bool(self.engines[role].is_gradient_accumulation_boundary())

    # ---- persistence ---------------------------------------------------------------------------------------
    def save(self, ckpt_dir: str, tag: str) -> None:
        """DeepSpeed state (module, optimizer, scheduler) of the trained roles under ckpt_dir/<role>/<tag>."""
        for role in TRAINED:
            self.engines[role].save_checkpoint(os.path.join(ckpt_dir, role), tag=tag, save_latest=False)

    def load(self, ckpt_dir: str, tag: str) -> None:
        for role in TRAINED:
            path, _ = self.engines[role].load_checkpoint(os.path.join(ckpt_dir, role), tag=tag)
            if path is None:
                raise FileNotFoundError(f"no {role} checkpoint with tag {tag!r} under {ckpt_dir}")

    def full_state_dict(self, role: str) -> Optional[dict]:
        """The role's full (ZeRO-3 consolidated) state dict on rank 0, None elsewhere. Collective: call on all ranks."""
        return full_state_dict(self.engines[role], self.plans[role].stage, self.dist.is_main)

    def export(self, role: str, out_dir: str) -> None:
        """Write `role` as a plain HF folder (weights + config + tokenizer) that reloads with from_pretrained."""
        export_engine(self.engines[role], self.plans[role].stage, out_dir, self.tokenizer, self.dist.is_main)


__all__ = ["RLHFEngine", "load_tokenizer", "ScalarHeadModel"]
