"""Candidate fixes of avoidable costs, applied to ONE trainer instance (never to the library), so a benchmark can run
the current code and the fixed variant side by side in one process (`ppo_iteration.py --variant name:patch=...`).

Each patch is `apply(trainer) -> Optional[context manager factory]`; a returned factory is entered around every
`trainer.step()` of that variant only (for module-level swaps such as `no_value_checks`). The benchmarks'
`--check-equivalence` runs every variant on one rollout and records the differences, so a speed-up never hides a
wrong result.

  logits_to_keep    actor/reference forwards compute the LM head only on the R+1 positions whose logits are used
                    (`logits_to_keep`), not on all P+R positions: the prompt's logits are thrown away today.
  no_entropy        the experience's entropy (a metric only) is not computed: the most that fusing its pass over
                    the logits into the log-prob pass could save (it changes objective/entropy, so it is a bound,
                    not a fix).
  no_value_checks   ppo_math's data-dependent input checks (one host sync per call) are skipped in the hot loop.
  top_k_off         generation really samples with top-k off when the config says top_k 0 (today: transformers'
                    default top_k=50, a different distribution from the one the log-probs assume).
  gather_once       ZeRO-3: the actor's parameters are gathered once around generate(), not per layer per token.
  gather_copy       ZeRO-3: gathered once into a plain replica that generates without ZeRO-3's module hooks.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

PATCHES: dict[str, Callable] = {}


def patch(name: str):
    def deco(fn):
        PATCHES[name] = fn
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


# ---- logits_to_keep ------------------------------------------------------------------------------------------------
@patch("logits_to_keep")
def _logits_to_keep(trainer) -> None:
    from rlhf_engine.ppo_math import entropy_from_logits, logprobs_from_logits

    eng = trainer.engine

    def _lm_forward(engine, r, with_entropy):
        R = r.response_width
        # the last R+1 positions are P-1 .. P+R-1; the first R of them predict response tokens 0 .. R-1
        logits = engine(**eng._inputs(r), use_cache=False, logits_to_keep=R + 1).logits[:, :R]
        logprobs = logprobs_from_logits(logits, r.responses, temperature=eng.temperature) * r.action_mask
        entropy = None
        if with_entropy:
            entropy = entropy_from_logits(logits, temperature=eng.temperature) * r.action_mask
        return logprobs, entropy

    eng._lm_forward = _lm_forward


# ---- entropy -------------------------------------------------------------------------------------------------------
@patch("no_entropy")
def _no_entropy(trainer) -> None:
    eng = trainer.engine
    orig = eng.actor_logprobs

    def actor_logprobs(rollout, with_entropy=False):
        lp = orig(rollout, with_entropy=False)
        return (lp, torch.zeros_like(lp)) if with_entropy else lp

    eng.actor_logprobs = actor_logprobs


# ---- value checks ----------------------------------------------------------------------------------------------------
@patch("no_value_checks")
def _no_value_checks(trainer) -> Callable:
    from rlhf_engine import ppo_math

    @contextlib.contextmanager
    def ctx():
        orig = ppo_math._raise_first
        ppo_math._raise_first = lambda checks: None
        try:
            yield
        finally:
            ppo_math._raise_first = orig

    return ctx


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



# ---- generation ------------------------------------------------------------------------------------------------------
@patch("top_k_off")
def _top_k_off(trainer) -> None:
    """generation_kwargs passes top_k=None for 'top_k 0 = off'; transformers 5 then applies its default top_k=50.
    Passing 0 really turns top-k off (the sampled distribution is then the one the PPO log-probs assume)."""
    eng = trainer.engine
    orig = eng.generation_kwargs

    def generation_kwargs():
        kw = orig()
        if kw.get("do_sample") and kw.get("top_k") is None:
            kw["top_k"] = 0
        return kw

    eng.generation_kwargs = generation_kwargs


@patch("gather_once")
def _gather_once(trainer) -> None:
    """ZeRO-3 prototype of 'gather once': all of the actor's parameters are gathered once around generate() instead of
    layer by layer at every decoding step (no-op for other stages)."""
    import deepspeed

    eng = trainer.engine
    if eng.plans["actor"].stage != 3:
        return
    orig = eng.generate

    def generate(ids, mask):
        with deepspeed.zero.GatheredParameters(list(eng.actor.module.parameters())):
            return orig(ids, mask)

    eng.generate = generate


@patch("gather_copy")
def _gather_copy(trainer) -> None:
    """ZeRO-3 prototype of 'gather once' without ZeRO-3's per-module hooks: once per generate() call the actor's
    parameters are gathered and copied into a plain (unpartitioned) replica of the model, which then generates.
    Costs one full copy of the actor's weights per rank (no-op for other stages)."""
    import copy

    import deepspeed

    from rlhf_engine.engine.ds_config import torch_dtype
    from rlhf_engine.engine.models import load_causal_lm
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
    def generate(ids, mask):
        with deepspeed.zero.GatheredParameters([source[n] for n, _ in targets]):
            for n, q in targets:
                q.copy_(source[n])
        kw = eng.generation_kwargs()
        kw.pop("synced_gpus")  # the replica runs no collective: every rank may stop at its own length
        gen_config = copy.deepcopy(replica.generation_config)
        gen_config.update(**kw)
        ids, mask = ids.to(eng.device), mask.to(eng.device)
        out = replica.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
        return Rollout.from_generation(ids, mask, out, eng.stop_token_ids, eng.pad_token_id)

    eng.generate = generate
