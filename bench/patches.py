"""Fixes of avoidable costs as patches of ONE trainer instance (never of the library), so a benchmark can run the
current code and a patched variant side by side in one process (`ppo_iteration.py --variant name:patch=...`).

Two kinds (`KIND[name]`):

* **before**: the fix is applied in rlhf_engine; the patch restores the code BEFORE the fix on one instance, so one
  run measures before -> current. `APPLIED[name]` is the commit that applied it, recorded when it landed.
* **candidate**: the fix is not in rlhf_engine; the patch applies it (or bounds what it could save) on one instance.

Each patch is `apply(trainer) -> Optional[context manager factory]`; a returned factory is entered around every step
of that variant only (for module-level swaps, shared by every trainer of the process). The benchmarks'
`--check-equivalence` runs every variant on one rollout and records the differences, so a speed-up never hides a
wrong result.

  before     full_lm_head        actor/reference forwards run the LM head on all P+R positions and keep the R used
                                 ones (now: `logits_to_keep=R+1`).
  before     top_k_default       generation passes top_k=None for top_k 0, so transformers samples with its default
                                 top_k=50 (now: top_k=0, really off; the sampled tokens change, as they should).
  before     checks_in_hot_loop  the training micro-batches run ppo_math's data-dependent checks (one host sync per
                                 call: actor log-probs, policy loss, value loss) and the guards read their all-reduced
                                 table one element at a time (a sync per rank and flag) plus one flag per checked
                                 tensor before the collective (now: check=False; one `tolist` per collective).
  candidate  no_entropy          the experience's entropy (a metric only) is not computed: the most that fusing its
                                 pass over the logits into the log-prob pass could save (it changes objective/entropy,
                                 so it is a bound, not a fix).
  candidate  gather_once         ZeRO-3: the actor's parameters are gathered once around generate(), not per layer
                                 per token (the library has this as `generation_gather_once`, off on CPU by default).
  candidate  gather_copy         ZeRO-3: gathered once into a plain replica that generates without ZeRO-3's hooks.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

PATCHES: dict[str, Callable] = {}
KIND: dict[str, str] = {}  # name -> "before" | "candidate"
APPLIED: dict[str, str] = {}  # before patches: name -> the commit that applied the fix in rlhf_engine


def patch(name: str, applied: str | None = None):
    """Register a patch; `applied` (the commit of the fix) makes it a 'before' patch of a fix applied in
    rlhf_engine."""
    def deco(fn):
        PATCHES[name] = fn
        KIND[name] = "before" if applied else "candidate"
        if applied:
            APPLIED[name] = applied
        return fn

    return deco


def apply_patches(trainer, names: list[str]) -> list[Callable]:
    """Apply the named patches to `trainer`; return the context factories to enter around each step."""
    contexts = []
    for name in names:
        if name not in PATCHES:
            raise SystemExit(f"unknown patch {name!r}; known: {', '.join(sorted(PATCHES))}")
        ctx = PATCHES[name](trainer)
        if ctx is not None:
            contexts.append(ctx)
    return contexts


def variant_kind(patch_spec: str) -> str:
    """'before' or 'candidate' for a variant's '+'-separated patches (a variant without patches, e.g. a config
    switch, is a candidate); mixing the two kinds has no before/after reading and is refused."""
    kinds = {KIND[p] for p in filter(None, patch_spec.split("+")) if p in KIND}
    if len(kinds) > 1:
        raise SystemExit(f"patch={patch_spec}: mixes 'before' patches ({', '.join(sorted(APPLIED))}) with candidates")
    return kinds.pop() if kinds else "candidate"


def applied_in(name: str) -> str:
    """The short hash of the commit that applied a before-patch's fix."""
    return APPLIED[name]


def hf_generator(trainer):
    """The trainer's generation backend, made the Hugging Face one if it is not (the patches of HF generate's
    arguments measure that backend; the lean backend is the default)."""
    from rlhf_engine.engine.generation import BACKENDS

    eng = trainer.engine
    if eng.generator.name != "hf":
        eng.generator = BACKENDS["hf"](eng.generator.ctx)
    return eng.generator


# ---- applied fixes: restore the code before them --------------------------------------------------------------------
@patch("full_lm_head", applied="ddd038b")
def _full_lm_head(trainer) -> Callable:
    """`RLHFEngine._lm_forward`'s fallback branch is the code before the fix (LM head on all positions, then
    `action_slice`): take it for every model. Module-level switch, so a context entered around this variant only."""
    from rlhf_engine.engine import rlhf_engine as module

    @contextlib.contextmanager
    def ctx():
        orig = module.accepts_logits_to_keep
        module.accepts_logits_to_keep = lambda m: False
        try:
            yield
        finally:
            module.accepts_logits_to_keep = orig

    return ctx


@patch("top_k_default", applied="ddd038b")
def _top_k_default(trainer) -> None:
    """Before: `top_k=g.top_k or None`; transformers 5 then applies its default top_k=50 for 'top_k 0 = off'."""
    gen = hf_generator(trainer)
    orig = gen.generation_kwargs

    def generation_kwargs(params):
        kw = orig(params)
        if kw.get("do_sample") and kw.get("top_k") == 0:
            kw["top_k"] = None
        return kw

    gen.generation_kwargs = generation_kwargs


@patch("checks_in_hot_loop", applied="f27805e")
def _checks_in_hot_loop(trainer) -> Callable:
    """Before: the trainer called the ppo_math functions of a micro-batch with their checks on, and the guards read
    each flag of their tables with its own host sync (plus one per checked tensor before the collective). The current
    guards' one `tolist` per collective still runs after those reads, so this variant counts one sync per collective
    more than the old code had (then cheap: the queue is already drained)."""
    from rlhf_engine import ppo_math
    from rlhf_engine.trainer import guards, ppo_trainer

    eng, guard = trainer.engine, trainer.guard
    forward = eng.actor_forward
    eng.actor_forward = lambda r, with_entropy=False, check=False: forward(r, with_entropy=with_entropy, check=True)
    agree = guard.agree

    def agree_before(iteration, errors=None, tensors=None):
        for x, mask in (tensors or {}).values():
            bad = ~torch.isfinite(x.detach())
            float((bad & mask.bool() if mask is not None else bad).any())  # the old per-tensor flag
        return agree(iteration, errors=errors, tensors=tensors)

    guard.agree = agree_before

    def all_reduce_before(table, op="sum"):
        out = reduce(table, op)
        for r in range(out.shape[0]):  # the old `table[r, j] > 0` of every rank and flag
            for j in range(out.shape[1]):
                bool(out[r, j] > 0)
        return out

    reduce = guards.all_reduce

    @contextlib.contextmanager
    def ctx():
        saved = ppo_trainer.policy_loss, ppo_trainer.value_loss, guards.all_reduce
        ppo_trainer.policy_loss = lambda *a, check=False, **k: ppo_math.policy_loss(*a, **k)
        ppo_trainer.value_loss = lambda *a, check=False, **k: ppo_math.value_loss(*a, **k)
        guards.all_reduce = all_reduce_before
        try:
            yield
        finally:
            ppo_trainer.policy_loss, ppo_trainer.value_loss, guards.all_reduce = saved

    return ctx


# ---- candidate fixes ------------------------------------------------------------------------------------------------
@patch("no_entropy")
def _no_entropy(trainer) -> None:
    eng = trainer.engine
    orig = eng.actor_logprobs

    def actor_logprobs(rollout, with_entropy=False):
        lp = orig(rollout, with_entropy=False)
        return (lp, torch.zeros_like(lp)) if with_entropy else lp

    eng.actor_logprobs = actor_logprobs


# ---- candidate fixes: ZeRO-3 generation ----------------------------------------------------------------------------
@patch("gather_once")
def _gather_once(trainer) -> None:
    """ZeRO-3 prototype of 'gather once': all of the actor's parameters are gathered once around generate() instead of
    layer by layer at every decoding step (no-op for other stages)."""
    import deepspeed

    eng = trainer.engine
    if eng.plans["actor"].stage != 3:
        return
    orig = eng.sample  # what the trainer's rollouts call

    def sample(ids, mask, params=None):
        with deepspeed.zero.GatheredParameters(list(eng.actor.module.parameters())):
            return orig(ids, mask, params)

    eng.sample = sample


@patch("gather_copy")
def _gather_copy(trainer) -> None:
    """ZeRO-3 prototype of 'gather once' without ZeRO-3's per-module hooks: once per generate() call the actor's
    parameters are gathered and copied into a plain (unpartitioned) replica of the model, which then generates.
    Costs one full copy of the actor's weights per rank (no-op for other stages)."""
    import deepspeed
    from transformers import GenerationConfig

    from rlhf_engine.engine.ds_config import torch_dtype
    from rlhf_engine.engine.models import load_causal_lm
    from rlhf_engine.engine.generation import Generated
    from rlhf_engine.rollout import Rollout

    eng = trainer.engine
    plan = eng.plans["actor"]
    if plan.stage != 3:
        return
    replica = load_causal_lm(plan.path, torch_dtype(plan.dtype)).to(eng.device).eval().requires_grad_(False)
    source = dict(eng.actor.module.named_parameters())
    targets = list(replica.named_parameters())
    missing = [n for n, _ in targets if n not in source]
    if missing:
        raise RuntimeError(f"gather_copy: replica parameters {missing[:3]} not in the actor")

    @torch.no_grad()
    def sample(ids, mask, params=None):
        with deepspeed.zero.GatheredParameters([source[n] for n, _ in targets]):
            for n, q in targets:
                q.copy_(source[n])
        kw = hf_generator(trainer).generation_kwargs(params or eng.sampling)
        kw.pop("synced_gpus")  # the replica runs no collective: every rank may stop at its own length
        gen_config = GenerationConfig(**kw)  # the sampling parameters alone, as the HF backend builds it
        ids, mask = ids.to(eng.device), mask.to(eng.device)
        out = replica.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        return Generated(Rollout.from_generation(ids, mask, out, eng.stop_token_ids, eng.pad_token_id))

    eng.sample = sample  # what the trainer's rollouts call


# ---- host-sync audit -------------------------------------------------------------------------------------------------
class SyncCounter:
    """Counts host<->device synchronisation points reached from Python while active: Tensor.item / tolist /
    __bool__ / __int__ / __float__ / cpu / numpy and torch.equal / nonzero. Each is attributed to the innermost
    frame in rlhf_engine (else transformers / deepspeed / bench / other). On GPU each one waits for the device; on
    CPU they are free, so this is a count, not a time."""

    METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero")
    FUNCS = ("equal",)

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._saved: list = []
        self._inside = False

    def _site(self) -> str:
        """The innermost caller outside torch and this benchmark: 'rlhf_engine/<file>:<function>' for our code,
        else the library's name."""
        import sys

        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename.replace("\\", "/")
            if "/torch/" in fn or "/bench/" in fn or fn.startswith("<"):
                f = f.f_back
                continue
            if "/rlhf_engine/" in fn:
                return f"rlhf_engine/{fn.split('/rlhf_engine/', 1)[1]}:{f.f_code.co_name}"
            for lib in ("transformers", "deepspeed", "accelerate"):
                if f"/{lib}/" in fn:
                    return lib
            return "other"
        return "other"

    def _wrap(self, name, fn):
        counter = self

        def w(*a, **k):
            if counter._inside:
                return fn(*a, **k)
            counter._inside = True
            try:
                key = f"{counter._site()} [{name}]"
                counter.counts[key] = counter.counts.get(key, 0) + 1
                return fn(*a, **k)
            finally:
                counter._inside = False

        return w

    def __enter__(self):
        for m in self.METHODS:
            orig = getattr(torch.Tensor, m)
            self._saved.append((torch.Tensor, m, orig))
            setattr(torch.Tensor, m, self._wrap(m, orig))
        for fname in self.FUNCS:
            orig = getattr(torch, fname)
            self._saved.append((torch, fname, orig))
            setattr(torch, fname, self._wrap(fname, orig))
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._saved):
            setattr(owner, name, orig)
        self._saved.clear()
        return False


def summarize_syncs(counts: dict[str, int]) -> dict:
    by_owner: dict[str, int] = {}
    for key, n in counts.items():
        owner = key.split("/", 1)[0] if key.startswith("rlhf_engine/") else key.split(" ", 1)[0]
        by_owner[owner] = by_owner.get(owner, 0) + n
    ours = {k: v for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if k.startswith("rlhf_engine/")}
    return {"total": sum(counts.values()), "by_owner": by_owner, "rlhf_engine_sites": ours}
