"""RLHFEngine: actor, critic, reference and reward as four DeepSpeed engines, behind the interface the trainer uses.

Every forward passes the rollout's position ids and runs in micro-batches; experience forwards run in eval mode under
no_grad; log-probs are fp32. Losses handed to `backward` must be sums over this rank's tokens divided by the GLOBAL
token count of the mini-batch (see ppo_math): DeepSpeed averages gradients over ranks and divides by the accumulation
steps, so `backward` multiplies by the world size and turns DeepSpeed's accumulation scaling off.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from ..config import TrainConfig
from ..ppo_math import entropy_from_logits, logprobs_from_logits
from ..rollout import Rollout
from .distributed import DistInfo
from .models import ScalarHeadModel, adapter_disabled
from .models import load_tokenizer  # noqa: F401  (re-exported)
from .preflight import EnginePlan, RolePlan, resolve_dtype
from .role_engine import (backward_global, build_role_engine, export_engine, full_state_dict, rollout_inputs,
                          sequence_scores)
from .zero3 import ema_update_, full_param_bytes, gathered_for_generation

log = logging.getLogger(__name__)
TRAINED = ("actor", "critic")


class RLHFEngine:
    """Builds the engines of an `EnginePlan` (engine/preflight.py: planned and checked once, before any weight is
    read). `ds_configs` holds each engine's resolved DeepSpeed config (the run directory writes them)."""

    def __init__(self, cfg: TrainConfig, dist: DistInfo, plan: EnginePlan):
        self.cfg, self.dist, self.plan = cfg, dist, plan
        self.plans: dict[str, RolePlan] = dict(plan.roles)  # + "ema" when built
        self.tokenizer = plan.tokenizer
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.stop_token_ids = list(plan.stop_token_ids)
        num_training_steps = plan.num_training_steps
        self.experience_micro_batch = (cfg.batch.experience_micro_batch_size
                                       or cfg.batch.per_device_generation_batch_size)
        g = cfg.generation
        self.temperature = g.temperature if g.do_sample else 1.0
        self.use_position_ids = True  # test hook: False reproduces the trlx left-padding bug
        self.ds_configs: dict[str, dict] = {}
        self.engines = {}
        ext = cfg.engine
        # the reference is the actor with its LoRA adapter disabled: no engine of its own
        self.reference_from_adapter = bool(ext.reference_from_actor_adapter)
        self.hybrid_engine = plan.hybrid_engine  # False (warned) with the fallback
        for role, plan in self.plans.items():
            if role == "reference" and self.reference_from_adapter:
                continue
            kind = "causal_lm" if role in ("actor", "reference") else "scalar"
            engine, ds_cfg = build_role_engine(
                getattr(cfg, role), plan.path, kind=kind, stage=plan.stage, dtype=plan.dtype, train=plan.train,
                batch=cfg.batch, world_size=dist.world_size, eval_micro_batch_size=self.experience_micro_batch,
                num_training_steps=num_training_steps, pad_token_id=self.pad_token_id,
                ds_overrides=self._hybrid_engine_section() if role == "actor" and self.hybrid_engine else None)
            self.ds_configs[role] = ds_cfg
            self.engines[role] = engine
        self._ema_steps = 0  # actor optimizer steps the EMA has seen
        if ext.enable_ema:
            self._build_ema(num_training_steps)
        self._gather_once_logged = False
        self._hybrid_engine_checked = False

    def _build_ema(self, num_training_steps: int) -> None:
        """The EMA of the actor: an eval-only engine built from the actor's weights, at ZeRO 3 when the actor is at 3
        (then both partition every parameter identically and `update_ema` is local), else 0; `ema_dtype` (fp32 by
        default) whatever the actor's dtype."""
        from ..config import RoleConfig

        actor = self.plans["actor"]
        plan = RolePlan(actor.path, 3 if actor.stage == 3 else 0, resolve_dtype(self.cfg.engine.ema_dtype or actor.dtype),
                        False)
        engine, ds_cfg = build_role_engine(
            RoleConfig(), plan.path, kind="causal_lm", stage=plan.stage, dtype=plan.dtype, train=False,
            batch=self.cfg.batch, world_size=self.dist.world_size, eval_micro_batch_size=self.experience_micro_batch,
            num_training_steps=num_training_steps, pad_token_id=self.pad_token_id)
        self.plans["ema"] = plan
        self.ds_configs["ema"] = ds_cfg
        self.engines["ema"] = engine
        self._ema_steps = self.optimizer_steps("actor")

    def _hybrid_engine_section(self) -> dict:
        """The actor's `hybrid_engine` DeepSpeed section (DeepSpeed-Chat's flags)."""
        e, g = self.cfg.engine, self.cfg.generation
        return {"hybrid_engine": {"enabled": True, "max_out_tokens": g.max_prompt_seq_len + g.max_answer_seq_len,
                                  "inference_tp_size": e.inference_tp_size,
                                  "release_inference_cache": e.release_inference_cache,
                                  "pin_parameters": not e.unpin_actor_parameters,
                                  "tp_gather_partition_size": e.tp_gather_partition_size}}

    # ---- roles ---------------------------------------------------------------------------------------------
    @property
    def actor(self):
        return self.engines["actor"]

    @property
    def critic(self):
        return self.engines["critic"]

    @property
    def reference(self):
        """The reference engine (None with reference_from_actor_adapter: the actor without its adapter)."""
        return self.engines.get("reference")

    @property
    def ema(self):
        """The EMA engine of the actor (None unless enable_ema)."""
        return self.engines.get("ema")

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
                  # ZeRO-3 ranks must run the same number of forwards (each one gathers layers collectively), unless
                  # the whole actor is gathered once for the call (gather_once_active)
                  synced_gpus=self.plans["actor"].stage == 3 and self.dist.world_size > 1
                  and not self.gather_once_active())
        if g.min_answer_seq_len:
            kw["min_new_tokens"] = g.min_answer_seq_len
        if g.do_sample:
            # top_k=0 (not None) turns top-k off: None would fall back to transformers' default k=50, sampling from
            # a truncated distribution while the PPO log-probs assume the full softmax
            kw.update(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)
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
        ids, mask = prompt_ids.to(self.device), prompt_attention_mask.to(self.device)
        try:
            if self.hybrid_engine:
                out = self._hybrid_engine_generate(ids, mask, gen_config, synced)
            elif self.gather_once_active():
                # every rank holds the full actor for the whole call and no collective runs inside, so ranks may
                # finish at different times: synced_gpus (one all-reduce per token, dummy forwards) is off
                with gathered_for_generation(model):
                    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                         synced_gpus=False)
            else:
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config,
                                     synced_gpus=synced)
        finally:
            if self.hybrid_engine:
                self.actor.train()  # the Hybrid Engine's eval() swapped its inference kernels in; swap them out
            model.train(was_training)
        return Rollout.from_generation(prompt_ids.to(self.device), prompt_attention_mask.to(self.device), out,
                                       self.stop_token_ids, self.pad_token_id)

    def gather_once_active(self) -> bool:
        """Whether the next `generate` gathers the ZeRO-3 actor once (`generation_gather_once`: 'on', or 'auto' with
        CUDA) instead of fetching each layer for every token; never above `gather_once_max_bytes` (logged once)."""
        mode = self.cfg.engine.generation_gather_once
        if self.plans["actor"].stage != 3 or self.hybrid_engine or mode == "off":
            return False
        if mode == "auto" and not torch.cuda.is_available():
            return False  # on CPU gathering once was measured not faster (docs/notes: 1.36 s vs 1.43 s)
        if not hasattr(self, "_actor_bytes"):
            self._actor_bytes = full_param_bytes(self.actor.module)
        if self._actor_bytes > self.cfg.engine.gather_once_max_bytes:
            if not self._gather_once_logged and self.dist.is_main:
                log.warning("generation_gather_once: the actor's full weights (%.2f GiB) exceed gather_once_max_bytes "
                            "(%.2f GiB); generating with per-layer ZeRO-3 fetches", self._actor_bytes / 2**30,
                            self.cfg.engine.gather_once_max_bytes / 2**30)
            self._gather_once_logged = True
            return False
        return True

    def _hybrid_engine_generate(self, ids: torch.Tensor, mask: torch.Tensor, gen_config, synced: bool):
        """Generation through DeepSpeed's Hybrid Engine (GPU only; UNVERIFIED: this project's machines have no GPU).

        The first call is a self-check: the first batch is decoded greedily by the Hybrid Engine and by plain Hugging
        Face generate (the engine's training-mode forwards); any differing token on any rank stops the run."""
        import copy

        engine = self.actor
        if not self._hybrid_engine_checked:
            self._hybrid_engine_checked = True
            greedy = copy.deepcopy(gen_config)
            greedy.update(do_sample=False, temperature=None, top_p=None, top_k=None)
            engine.eval()  # the Hybrid Engine swaps its inference containers in
            he_out = engine.generate(input_ids=ids, attention_mask=mask, generation_config=greedy, synced_gpus=synced)
            engine.train()  # Hugging Face forwards back
            engine.module.eval()
            # the Hybrid Engine replaces module.generate with its own and keeps the original as `_generate`
            hf_generate = getattr(engine, "_generate", None) or engine.module.generate
            hf_out = hf_generate(input_ids=ids, attention_mask=mask, generation_config=greedy, synced_gpus=synced)
            same = he_out.shape == hf_out.shape and bool(torch.equal(he_out.cpu(), hf_out.cpu()))
            flag = torch.tensor([0.0 if same else 1.0], device=self.device)
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            if flag.item() > 0:
                detail = (f"shapes {tuple(he_out.shape)} vs {tuple(hf_out.shape)}" if he_out.shape != hf_out.shape
                          else f"{int((he_out != hf_out).sum())} of {he_out.numel()} tokens differ")
                raise RuntimeError("enable_hybrid_engine: self-check failed: the Hybrid Engine's greedy generation of "
                                   f"the first batch differs from Hugging Face generate on some rank (this rank: "
                                   f"{'equal' if same else detail}). Its inference kernels do not reproduce this "
                                   "model; set enable_hybrid_engine false")
            if self.dist.is_main:
                log.info("enable_hybrid_engine: self-check passed (greedy first batch equals Hugging Face generate)")
        engine.eval()
        return engine.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config, synced_gpus=synced)

    # ---- forwards ------------------------------------------------------------------------------------------
    def _inputs(self, r: Rollout) -> dict:
        return rollout_inputs(r, self.use_position_ids)

    def _lm_forward(self, engine, r: Rollout, with_entropy: bool, check: bool = True):
        R = r.response_width
        if _accepts_logits_to_keep(engine.module):
            # only the last R+1 positions go through the LM head (prompt logits are never used); their first R are
            # positions P-1 .. P+R-2, i.e. exactly `action_slice` (measured: experience and training forwards x1.2)
            logits = engine(**self._inputs(r), use_cache=False, logits_to_keep=R + 1).logits[:, :R]
        else:
            logits = r.action_slice(engine(**self._inputs(r), use_cache=False).logits)
        # logits [B, R, V]: the logits that predict each response token
        logprobs = logprobs_from_logits(logits, r.responses, temperature=self.temperature, check=check) * r.action_mask
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits, temperature=self.temperature) * r.action_mask
        return logprobs, entropy

    def _eval_chunks(self, role: str, rollout: Rollout, fn) -> list:
        engine = self.engines[role]
        was_training = engine.training
        if role == "actor" and self.hybrid_engine:
            engine.train()  # the Hybrid Engine's eval() would run these forwards on its inference kernels
            engine.module.eval()
        else:
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
        """[B, R] fp32 reference log-probs (0 on padding). With reference_from_actor_adapter: the actor's forward
        with its LoRA adapter disabled (the base weights), in eval mode; works under every ZeRO stage."""
        if self.reference_from_adapter:
            with adapter_disabled(self.actor.module):
                return torch.cat(self._eval_chunks("actor", rollout, lambda e, mb: self._lm_forward(e, mb, False)[0]))
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
    def actor_forward(self, rollout: Rollout, with_entropy: bool = False, check: bool = True):
        """Training forward (with grad): ([B, R] log-probs, [B, R] entropy or None). check=False skips the label-range
        check of the response ids (a host sync), for micro-batches of an experience whose ids were checked."""
        self.actor.train()
        return self._lm_forward(self.actor, rollout, with_entropy, check)

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
        """Optimizer steps APPLIED so far: DeepSpeed's boundary count minus its skipped steps (fp16 overflow, or a
        step the trainer's guard skipped, trainer/guards.py)."""
        e = self.engines[role]
        return int(e.global_steps) - int(getattr(e, "skipped_steps", 0))

    def is_boundary(self, role: str) -> bool:
        return bool(self.engines[role].is_gradient_accumulation_boundary())

    def update_ema(self) -> bool:
        """EMA step: ema = ema_decay * ema + (1 - ema_decay) * actor, if the actor's optimizer has stepped since the
        last update (so calling it after every `step("actor")` updates exactly once per optimizer step). The trainer
        calls it after each actor step. Under ZeRO-3 each rank updates its own partition from the actor's (no
        communication). Returns whether it updated; False without enable_ema. Call on every rank."""
        if "ema" not in self.engines:
            return False
        steps = self.optimizer_steps("actor")
        if steps == self._ema_steps:
            return False
        ema_update_(self.engines["ema"].module, self.actor.module, float(self.cfg.engine.ema_decay))
        self._ema_steps = steps
        return True

    # ---- persistence ---------------------------------------------------------------------------------------
    def save(self, ckpt_dir: str) -> list:
        """The engines' part of a checkpoint into `ckpt_dir` (one checkpoint folder): `ckpt_dir/<role>/` for the
        trained roles (module, optimizer, LR scheduler) and the EMA (engine/checkpointing.py). Collective."""
        from .checkpointing import save_engines

        return save_engines(self, ckpt_dir)

    def load(self, ckpt_dir: str) -> list:
        """Load what `save` wrote into the live engines. Collective."""
        from .checkpointing import load_engines

        roles = load_engines(self, ckpt_dir)
        self._ema_steps = self.optimizer_steps("actor")  # the loaded EMA has seen every loaded actor step
        return roles

    def full_state_dict(self, role: str) -> Optional[dict]:
        """The role's full (ZeRO-3 consolidated) state dict on rank 0, None elsewhere. Collective: call on all ranks."""
        return full_state_dict(self.engines[role], self.plans[role].stage, self.dist.is_main)

    def export(self, role: str, out_dir: str) -> None:
        """Write `role` (actor, critic, reference, reward, or "ema") as a plain HF folder (weights + config +
        tokenizer) that reloads with from_pretrained; a LoRA role is exported with its adapter merged. Collective."""
        export_engine(self.engines[role], self.plans[role].stage, out_dir, self.tokenizer, self.dist.is_main)


__all__ = ["RLHFEngine", "load_tokenizer", "ScalarHeadModel"]


def _accepts_logits_to_keep(module) -> bool:
    """Whether the causal LM's forward takes `logits_to_keep` (transformers' decoder models do; peft passes it on)."""
    import inspect

    base = getattr(module, "get_base_model", lambda: module)()
    return "logits_to_keep" in inspect.signature(base.forward).parameters
