"""RLHFEngine: actor, critic, reference and reward as four DeepSpeed engines, behind the interface the trainer uses.

Every forward passes the rollout's position ids and runs in micro-batches; experience forwards run in eval mode under
no_grad; log-probs are fp32. Losses handed to `backward` must be sums over this rank's tokens divided by the GLOBAL
token count of the mini-batch (see ppo_math): DeepSpeed averages gradients over ranks and divides by the accumulation
steps, so `backward` multiplies by the world size and turns DeepSpeed's accumulation scaling off.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Optional

import torch

from ..config import TrainConfig
from .. import comm
from ..hooks import TestHooks
from ..packing import micro_batch_rows, pack_rows
from ..ppo_math import entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits, mask_stop_tokens_
from ..rollout import Rollout, gather_at
from .distributed import DistInfo
from .freezing import mirror_requires_grad
from .models import ScalarHeadModel, accepts_logits_to_keep, adapter_disabled, unwrap_peft
from .generation import BACKENDS, GenerationContext, Generated, SamplingParams
from .generation.servers import ServersBackend
from .models import load_tokenizer  # noqa: F401  (re-exported)
from .preflight import EnginePlan, RolePlan, plan_role, resolve_dtype
from .packed_forward import model_dtype, packed_inputs, packed_logits_at
from .ds_config import _merge
from .role_engine import (backward_global, build_role_engine, export_engine, full_state_dict, rollout_inputs,
                          sequence_scores)
from .zero3 import ema_update_

log = logging.getLogger(__name__)


class RLHFEngine:
    """Builds the engines of an `EnginePlan` (engine/preflight.py: planned and checked once, before any weight is
    read). `ds_configs` holds each engine's resolved DeepSpeed config (the run directory writes them)."""

    def __init__(self, cfg: TrainConfig, dist: DistInfo, plan: EnginePlan, hooks: Optional[TestHooks] = None):
        self.cfg, self.dist, self.plan = cfg, dist, plan
        self.hooks = hooks or TestHooks()  # TEST HOOKS: use_position_ids=False reproduces trlx's left-padding bug
        self.plans: dict[str, RolePlan] = dict(plan.roles)  # + "ema" when built
        self.tokenizer = plan.tokenizer
        self.pad_token_id = int(self.tokenizer.pad_token_id)
        self.stop_token_ids = list(plan.stop_token_ids)
        num_training_steps = plan.num_training_steps
        self.experience_micro_batch = (cfg.batch.experience_micro_batch_size
                                       or cfg.batch.generation_rollouts)
        # trim_padding: every forward drops the columns that are padding in all of its rows; the experience forwards
        # then run on the training micro-batches' rows exactly, so that old and new log-probs come from identical
        # tensors (the lr = 0 ratio stays exactly 1)
        self.trim_padding = bool(cfg.engine.trim_padding)
        g = cfg.generation
        self.sampling = SamplingParams.from_config(g, self.stop_token_ids, self.pad_token_id)
        self._stop_ids = torch.tensor(self.stop_token_ids, dtype=torch.long, device=dist.device)
        self.ds_configs: dict[str, dict] = {}
        self.engines = {}
        ext = cfg.engine
        # the reference is the actor with its LoRA adapter disabled: no engine of its own
        self.reference_from_adapter = bool(ext.reference_from_actor_adapter) and "reference" in self.plans
        backend = BACKENDS[plan.generation_backend]
        for role, role_plan in self.plans.items():
            if role == "reference" and self.reference_from_adapter:
                continue
            kind = "causal_lm" if role in ("actor", "reference") else "scalar"
            engine, ds_cfg = build_role_engine(
                getattr(cfg, role), role_plan.path, kind=kind, stage=role_plan.stage, dtype=role_plan.dtype,
                train=role_plan.train,
                batch=cfg.batch, world_size=dist.world_size, eval_micro_batch_size=self.experience_micro_batch,
                num_training_steps=num_training_steps, pad_token_id=self.pad_token_id,
                ds_overrides=_ds_overrides(role_plan, backend.actor_ds_overrides(cfg) if role == "actor" else None),
                matmul=role_plan.matmul)
            self.ds_configs[role] = ds_cfg
            self.engines[role] = engine
        if self.reference is not None:  # same flags, same kernels: KL exactly 0 while the weights are equal
            mirror_requires_grad(self.reference.module, self.actor.module)
        self._ema_steps = 0  # actor optimizer steps the EMA has seen
        if ext.enable_ema:
            self._build_ema(num_training_steps)
        actor = self.plans["actor"]
        ctx = GenerationContext(self.actor, dist, actor.stage, cfg, model_path=actor.path, dtype=actor.dtype,
                                max_len=plan.longest_sequence)
        # rollout servers are asked over HTTP
        self.generator = self.hooks.wrap_generator(
            ServersBackend(ctx, plan.rollout_link) if cfg.rollout.servers_on else backend(ctx))
        # packing: forwards on packed rows where every model computes them right (engine/packed_forward.py)
        self.packing = self._resolve_packing(plan.packing)  # preflight turned auto off for a too-short sliding window
        # with trimmed or packed rows the experience forwards run on the training micro-batches' rows exactly, so
        # old and new log-probs come from identical tensors (the lr = 0 ratio stays exactly 1)
        self.experience_chunk = (cfg.batch.per_device_training_batch_size if self.trim_padding or self.packing
                                 else self.experience_micro_batch)
        # slots of every forward since the last `take_slot_counts`: real tokens, padded slots, packed slots
        self.slot_counts = {"real": 0, "padded": 0, "packed": 0}
        self.frozen_prefix, self._reference_blocks = self._plan_frozen_prefix()
        self._capturing = False  # inside the experience's actor forward: the frozen prefix's outputs are kept

    def _plan_frozen_prefix(self):
        """(FrozenPrefix, the reference's prefix blocks or None) with actor_trainable_layers at ZeRO 0-2 and
        --reuse_frozen_prefix (engine/frozen_prefix.py); (None, None) otherwise: every forward computes every block.
        The reference replays the actor's prefix where its frozen weights and its kernels (cpu_bf16_matmul) equal the
        actor's (checked here, once)."""
        from .frozen_prefix import FrozenPrefix, same_prefix

        actor = self.plans["actor"]
        if not self.cfg.engine.reuse_frozen_prefix or actor.stage == 3 or self.hybrid_engine:
            return None, None
        prefix = FrozenPrefix.of(unwrap_peft(self.actor.module), int(self.cfg.actor.trainable_layers or 0))
        ref = self.engines.get("reference")
        ref_plan = self.plans.get("reference")
        if prefix is None or ref is None or ref_plan.stage == 3 or ref_plan.matmul != actor.matmul or \
                not same_prefix(unwrap_peft(self.actor.module), unwrap_peft(ref.module)):
            return prefix, None
        return prefix, prefix.blocks_of(unwrap_peft(ref.module))

    @contextlib.contextmanager
    def _prefix_reuse(self, engine, inputs: dict):
        """Around one language-model forward on `inputs`: keep the actor's frozen-prefix output in the experience
        forward; start the actor's later forwards, and the reference's, from it where it was kept for equal
        inputs; anything else computes every block."""
        fp = self.frozen_prefix
        if fp is not None and engine is self.actor and self._capturing:
            with fp.capturing(inputs):
                yield
            return
        reference = engine is self.engines.get("reference") and self._reference_blocks is not None
        entry = fp.lookup(inputs) if fp is not None and (engine is self.actor or reference) else None
        if entry is None:
            if fp is not None and (engine is self.actor or reference):
                fp.misses += 1
            yield
            return
        fp.hits += 1
        with fp.replaying(entry, self._reference_blocks if reference else None):
            yield

    def take_prefix_stats(self) -> dict:
        """The frozen prefix's reuse since the last call (then reset): forwards that replayed it, forwards that
        computed it anew, and the bytes it holds; {} where it is off."""
        fp = self.frozen_prefix
        if fp is None:
            return {}
        out = {"hits": fp.hits, "misses": fp.misses, "bytes": fp.nbytes}
        fp.hits = fp.misses = 0
        return out

    def _resolve_packing(self, setting: str) -> bool:
        """'off' -> False; 'auto' -> whether every model passes the packing probe; 'on' -> True, or a ConfigError
        naming the model that does not."""
        from ..errors import ConfigError, Problem
        from .packed_forward import packing_works

        if setting == "off":
            return False
        failing = []
        if self.hybrid_engine:
            failing.append("the hybrid generation backend (its inference kernels take no block-diagonal mask)")
        for role, engine in self.engines.items():
            if role == "ema" or self.hybrid_engine:
                continue
            try:  # every rank probes every model (collective under ZeRO-3), and the ranks decide together
                works = packing_works(engine.module, self.plan.longest_sequence)  # probed at the run's length
            except Exception:  # noqa: BLE001  (a model that refuses a 4D mask, for one)
                works = False
            if comm.agree(not works):
                model_type = getattr(getattr(unwrap_peft(engine.module), "config", None), "model_type", "?")
                failing.append(f"the {role} model ({model_type}) does not compute packed rows as padded ones")
        if failing and setting == "on":
            raise ConfigError([Problem("packing", "on", f"{failing[0]}; set packing off (or auto)")],
                              "cannot pack")
        if failing and self.dist.is_main:
            log.info("packing auto: off, %s", failing[0])
        return not failing

    def _build_ema(self, num_training_steps: int) -> None:
        """The EMA of the actor: an eval-only engine built from the actor's weights, at ZeRO 3 when the actor is at 3
        (then both partition every parameter identically and `update_ema` is local), else 0; `ema_dtype` (fp32 by
        default) whatever the actor's dtype."""
        from ..config import RoleConfig

        actor = self.plans["actor"]
        dtype = resolve_dtype(self.cfg.engine.ema_dtype or actor.dtype)
        plan = plan_role(self.cfg.actor, actor.path, 3 if actor.stage == 3 else 0, dtype, False)
        engine, ds_cfg = build_role_engine(
            RoleConfig(), plan.path, kind="causal_lm", stage=plan.stage, dtype=plan.dtype, train=False,
            batch=self.cfg.batch, world_size=self.dist.world_size, eval_micro_batch_size=self.experience_micro_batch,
            num_training_steps=num_training_steps, pad_token_id=self.pad_token_id, matmul=plan.matmul)
        self.plans["ema"] = plan
        self.ds_configs["ema"] = ds_cfg
        self.engines["ema"] = engine
        self._ema_steps = self.optimizer_steps("actor")

    # ---- roles ---------------------------------------------------------------------------------------------
    @property
    def actor(self):
        return self.engines["actor"]

    @property
    def critic(self):
        return self.engines["critic"]

    @property
    def has_reference(self) -> bool:
        """Whether the run has a reference (an engine, or the actor's disabled adapter): none where nothing reads its
        log-probs (`PPOConfig.reads_reference`)."""
        return "reference" in self.plans

    @property
    def has_critic(self) -> bool:
        """Whether the run has a critic (an advantage estimator that needs none builds none)."""
        return "critic" in self.engines

    @property
    def trained_roles(self) -> tuple:
        """The roles with an optimizer, in step order (the plan's; "ema" is eval-only)."""
        return tuple(r for r, p in self.plan.roles.items() if p.train)

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

    @property
    def temperature(self) -> float:
        """What divides the logits in every log-prob: the sampling temperature (1 for greedy decoding)."""
        return self.sampling.temperature if self.sampling.do_sample else 1.0

    # ---- generation ----------------------------------------------------------------------------------------
    @property
    def hybrid_engine(self) -> bool:
        return self.generator.name == "hybrid"

    def sample(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor,
               params: Optional[SamplingParams] = None) -> Generated:
        """prompt_ids, prompt_attention_mask [B, P] left-padded -> `Generated` (the Rollout and, when the backend
        can, generation-time log-probs), sampled with `params` (default: the run's rollout sampling)."""
        return self.generator.generate(prompt_ids, prompt_attention_mask, params or self.sampling)

    def generate(self, prompt_ids: torch.Tensor, prompt_attention_mask: torch.Tensor,
                 params: Optional[SamplingParams] = None) -> Rollout:
        """prompt_ids, prompt_attention_mask [B, P] left-padded -> Rollout (canonical layout)."""
        return self.sample(prompt_ids, prompt_attention_mask, params).rollout

    # ---- forwards ------------------------------------------------------------------------------------------
    def _inputs(self, r: Rollout) -> dict:
        return rollout_inputs(r, self.hooks.use_position_ids)

    def _trim(self, r: Rollout) -> Rollout:
        return r.trimmed() if self.trim_padding else r

    def _count(self, r: Rollout, packed_slots: int = 0) -> None:
        """A forward's real tokens and slots into `slot_counts` (the real count stays on the device: no sync)."""
        self.slot_counts["real"] = self.slot_counts["real"] + r.attention_mask.sum()
        self.slot_counts["padded"] += r.attention_mask.numel()
        self.slot_counts["packed"] += packed_slots

    def _pack(self, r: Rollout):
        """The packing of a forward's rows, counted."""
        packed = pack_rows(r.attention_mask)
        self._count(r, packed.segment.numel())
        return packed

    def take_slot_counts(self) -> dict:
        """The forwards' counts since the last call (then reset): real tokens, padded slots, packed slots (0 without
        packing)."""
        counts, self.slot_counts = self.slot_counts, {"real": 0, "padded": 0, "packed": 0}
        return counts

    def _packed_lm_forward(self, engine, r: Rollout, with_entropy: bool, check: bool, entropy_grad: bool = True):
        """`_lm_forward` on packed rows: the head runs only where a response token is predicted (positions P-1+t of
        the real response tokens t), and the results go back to [B, R]."""
        P, R = r.prompt_length, r.response_width
        packed = self._pack(r)
        inputs = packed_inputs(packed, r.sequences, r.position_ids, model_dtype(engine.module))
        where = packed.slot[:, P - 1:P - 1 + R]  # [B, R] slot predicting response token t (-1: padding)
        keep = (where >= 0) & r.response_attention.bool()
        with self._prefix_reuse(engine, inputs):
            logits = packed_logits_at(engine, packed, inputs, where[keep])[None]  # [1, K, V], in DeepSpeed's forward
        # the sampled distribution: no stop token before min_new_tokens (each logit row's response position)
        if self.sampling.min_new_tokens:
            index = torch.arange(R, device=keep.device).expand_as(keep)[keep][None]
            mask_stop_tokens_(logits, self._stop_ids, self.sampling.min_new_tokens, response_index=index)
        labels = r.responses[keep][None]

        def back(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(keep.shape, dtype=x.dtype, device=x.device).index_put((keep,), x[0]) * r.action_mask

        if with_entropy and not (entropy_grad and torch.is_grad_enabled()):
            lp, ent = logprobs_and_entropy_from_logits(logits, labels, temperature=self.temperature, check=check)
            return back(lp), back(ent)
        lp = logprobs_from_logits(logits, labels, temperature=self.temperature, check=check)
        ent = back(entropy_from_logits(logits, temperature=self.temperature)) if with_entropy else None
        return back(lp), ent

    def _scalar_per_position(self, engine, r: Rollout) -> torch.Tensor:
        """[B, L] outputs of a ScalarHeadModel engine, padded or packed."""
        if not self.packing:
            self._count(r)
            return engine(**self._inputs(r))
        packed = self._pack(r)
        return packed.unpack(engine(**packed_inputs(packed, r.sequences, r.position_ids, model_dtype(engine.module))))

    def _lm_forward(self, engine, full: Rollout, with_entropy: bool, check: bool = True, entropy_grad: bool = True):
        """([B, R] log-probs, [B, R] entropy or None). `entropy_grad=False`: the entropy is a metric (no gradient
        through it, even in a training forward), computed in the log-probs' pass over the logits."""
        if self.packing:
            return self._packed_lm_forward(engine, full, with_entropy, check, entropy_grad)
        r = self._trim(full)
        self._count(r)  # outputs are padded back to full's width (0 there, like every padding position)
        R = r.response_width
        inputs = self._inputs(r)
        with self._prefix_reuse(engine, inputs):
            if accepts_logits_to_keep(engine.module):
                # only the last R+1 positions go through the LM head (prompt logits are never used); their first R
                # are positions P-1 .. P+R-2, i.e. exactly `action_slice` (measured: experience and training forwards
                # x1.2)
                logits = engine(**inputs, use_cache=False, logits_to_keep=R + 1).logits[:, :R]
            else:
                logits = r.action_slice(engine(**inputs, use_cache=False).logits)
        # logits [B, R, V]: the logits that predict each response token; under min_answer_seq_len the stop tokens are
        # masked before it, as they were when sampling (the sampled distribution is the scored distribution)
        mask_stop_tokens_(logits, self._stop_ids, self.sampling.min_new_tokens)
        if with_entropy and not (entropy_grad and torch.is_grad_enabled()):  # both in one pass over the logits
            logprobs, entropy = logprobs_and_entropy_from_logits(logits, r.responses, temperature=self.temperature,
                                                                 check=check)
            return _widen(logprobs * r.action_mask, full), _widen(entropy * r.action_mask, full)
        logprobs = logprobs_from_logits(logits, r.responses, temperature=self.temperature, check=check) * r.action_mask
        entropy = None
        if with_entropy:
            entropy = _widen(entropy_from_logits(logits, temperature=self.temperature) * r.action_mask, full)
        return _widen(logprobs, full), entropy

    @contextlib.contextmanager
    def _eval_mode(self, role: str):
        if role == "actor":  # the generation backend knows how (the Hybrid Engine swaps kernels in eval())
            with self.generator.forward_mode():
                yield
            return
        engine = self.engines[role]
        was_training = engine.module.training
        _set_training(engine, False)
        try:
            yield
        finally:
            _set_training(engine, was_training)

    def micro_batches(self, rollout: Rollout) -> list[list[Optional[list[int]]]]:
        """Per mini-batch, the row indices of its micro-batches under --max_tokens_per_micro_batch, with None for the
        empty micro-batches a rank runs so that every rank runs as many (one all-reduce)."""
        b = self.cfg.batch
        lengths = rollout.attention_mask.sum(-1).tolist()
        plan = micro_batch_rows(lengths, b.mini_batch_size, b.per_device_training_batch_size,
                                b.max_tokens_per_micro_batch)
        counts = comm.max_over_ranks([len(m) for m in plan])
        return [m + [None] * (k - len(m)) for m, k in zip(plan, counts)]

    def _eval_chunks(self, role: str, rollout: Rollout, fn) -> list:
        engine = self.engines[role]
        with self._eval_mode(role), torch.no_grad():
            if not self.cfg.batch.max_tokens_per_micro_batch:
                return [fn(engine, mb) for mb in rollout.split(self.experience_chunk)]
            out = []
            for mini in self.micro_batches(rollout):  # the training's micro-batches: the same packed rows
                for rows in mini:
                    if rows is None:  # an empty micro-batch: a forward for the collectives, its output dropped
                        fn(engine, rollout.select([0]))
                    else:
                        out.append(fn(engine, rollout.select(rows)))
            return out

    def actor_logprobs(self, rollout: Rollout, with_entropy: bool = False):
        """[B, R] fp32 actor log-probs (0 on padding), eval mode; with_entropy also returns [B, R] entropy."""
        if self.frozen_prefix is not None:  # a new rollout: the last one's prefix outputs are done with
            self.frozen_prefix.clear()
        if rollout.batch_size == 0:  # every row's old log-probs come from training (the same on every rank)
            empty = torch.zeros((0, rollout.response_width), device=self.device)
            return (empty, empty.clone()) if with_entropy else empty
        self._capturing = True
        try:
            outs = self._eval_chunks("actor", rollout, lambda e, mb: self._lm_forward(e, mb, with_entropy))
        finally:
            self._capturing = False
        lp = torch.cat([o[0] for o in outs])
        return (lp, torch.cat([o[1] for o in outs])) if with_entropy else lp

    def ref_logprobs(self, rollout: Rollout) -> torch.Tensor:
        """[B, R] fp32 reference log-probs (0 on padding). With reference_from_actor_adapter: the actor's forward
        with its LoRA adapter disabled (the base weights), in eval mode; works under every ZeRO stage."""
        if not self.has_reference:
            raise RuntimeError("this run has no reference (no KL term reads it): nothing may ask for its log-probs")
        if self.reference_from_adapter:
            with adapter_disabled(self.actor.module):
                return torch.cat(self._eval_chunks("actor", rollout, lambda e, mb: self._lm_forward(e, mb, False)[0]))
        return torch.cat(self._eval_chunks("reference", rollout, lambda e, mb: self._lm_forward(e, mb, False)[0]))

    def _values(self, engine, full: Rollout) -> torch.Tensor:
        """[B, R] values of a ScalarHeadModel engine (per position [B, L], read at the action positions)."""
        r = full if self.packing else self._trim(full)
        return _widen(r.action_slice(self._scalar_per_position(engine, r)) * r.action_mask, full)

    def critic_values(self, rollout: Rollout) -> torch.Tensor:
        """[B, R] fp32 values V(state before action t), read at positions P-1+t; 0 on padding."""
        return torch.cat(self._eval_chunks("critic", rollout, self._values))

    def reward_scores(self, rollout: Rollout) -> torch.Tensor:
        """[B] fp32 reward-model score at the last real token of each sequence (EOS included): `sequence_scores`, the
        function the reward-model trainer scores with."""
        if self.packing:
            return torch.cat(self._eval_chunks(
                "reward", rollout, lambda e, mb: gather_at(self._scalar_per_position(e, mb), mb.score_index())))
        return torch.cat(self._eval_chunks(
            "reward", rollout, lambda e, mb: sequence_scores(e, self._counted(self._trim(mb)), self.hooks.use_position_ids)))

    def _counted(self, r: Rollout) -> Rollout:
        self._count(r)
        return r

    # ---- training ------------------------------------------------------------------------------------------
    def actor_forward(self, rollout: Rollout, with_entropy: bool = False, check: bool = True,
                      entropy_grad: bool = True):
        """Training forward (with grad): ([B, R] log-probs, [B, R] entropy or None). check=False skips the label-range
        check of the response ids (a host sync), for micro-batches of an experience whose ids were checked;
        entropy_grad=False returns the entropy as a metric, without gradient (one pass over the logits)."""
        _set_training(self.actor, True)
        return self._lm_forward(self.actor, rollout, with_entropy, check, entropy_grad)

    def critic_forward(self, rollout: Rollout) -> torch.Tensor:
        """Training forward (with grad): [B, R] values."""
        _set_training(self.critic, True)
        return self._values(self.critic, rollout)

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

    def set_boundary(self, roles: tuple, boundary: Optional[bool]) -> None:
        """Whether the next micro-batch ends the mini-batch (None: DeepSpeed counts gradient_accumulation_steps):
        token-budget micro-batches come in varying numbers."""
        for role in roles:
            self.engines[role].set_gradient_accumulation_boundary(boundary)

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

    def load(self, ckpt_dir: str, universal: bool = False) -> list:
        """Load what `save` wrote into the live engines (`universal`: written by another number of ranks).
        Collective."""
        from .checkpointing import load_engines

        roles = load_engines(self, ckpt_dir, universal=universal)
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


def _widen(x: torch.Tensor, full: Rollout) -> torch.Tensor:
    """[B, R'] outputs of a trimmed batch -> [B, R] of the full one (zeros after R', as on every padding position)."""
    return torch.nn.functional.pad(x, (0, full.response_width - x.shape[1])) if x.shape[1] < full.response_width else x


def _set_training(engine, mode: bool) -> None:
    """engine.train(mode) unless its module already is in that mode (a mode switch walks every sub-module: measured
    ~1.5 ms per PPO iteration of a 2-layer model when done per micro-batch and per experience forward)."""
    if engine.module.training != mode:
        engine.train(mode)


def _ds_overrides(plan: RolePlan, backend: Optional[dict]) -> Optional[dict]:
    """DeepSpeed config entries the engine sets for one role (a role's own ds_config file still wins).

    A trained bf16 role skips DeepSpeed's own overflow check: the PPO trainer's StepGuard has already looked at every
    gradient and skips the update on every rank when any is non-finite, so DeepSpeed's second look (a pass over the
    gradients and an all-reduce per step, 1.4% of a small ZeRO-2 iteration on CPU) only repeats it. fp16 keeps it:
    the loss scaler needs it."""
    own = {"bf16": {"check_grad_overflow": False}} if plan.train and plan.dtype == "bf16" else None
    if own and backend:
        return _merge(backend, own)
    return own or backend
