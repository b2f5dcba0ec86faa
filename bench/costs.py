"""Avoidable costs, phase by phase, interleaved in ONE process: applied fixes as before -> current, candidate fixes as
current -> candidate (patches.py).

    python bench/costs.py --preset cpu-small --variant current --variant full_lm_head:patch=full_lm_head \
        --variant no_entropy:patch=no_entropy --reps 8 --out c.json

The first variant is the current code (no patch). A variant whose patches are 'before' patches (patches.KIND)
restores the code before a fix the library has applied (the commit that applied it is recorded, patches.applied_in);
any other variant (candidate patches, config switches) tries a fix the library does not have. Every variant is a full
trainer built the same way (same random weights); `--check-equivalence` first shows each variant computes the same
numbers. Then `--reps` rounds, each round in a rotated variant order, time:

  generation  engine.generate on the round's prompts, the same sampling seed for every variant
  experience  trainer.experience_phase on ONE rollout shared by all variants (same tokens, same padding)
  training    trainer.train_phase on that variant's experience (one PPO epoch: forward, backward, optimizer step)

and report the median time per phase, the median over rounds of the per-round ratio time without the fix / time with
it (before / current for applied fixes, current / candidate for candidates; > 1: the fix is faster; both ran back to
back in that round) with its range, and host syncs per iteration of every variant.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402
import ppo_iteration as pi  # noqa: E402

PHASES = ("generation", "experience", "training")


def timed(fn):
    bl.sync()
    t0 = time.perf_counter()
    out = fn()
    bl.sync()
    return out, time.perf_counter() - t0


def one_round(built, rnd: int, count_syncs: bool = False) -> dict:
    import torch

    from patches import SyncCounter, summarize_syncs
    from rlhf_engine.data.prompts import collate_prompts
    from rlhf_engine.engine.distributed import barrier
    from rlhf_engine.trainer.metric_sums import MetricSums

    t0 = built[0].trainer
    k = rnd % t0.sampler.batches_per_epoch
    ids, mask = collate_prompts(t0.dataset, t0.sampler.indices(0, k), t0.engine.pad_token_id)
    torch.manual_seed(10_000 + rnd)
    shared = t0.engine.generate(ids, mask)  # the experience input of every variant this round
    out = {}
    n = len(built)
    for j in range(n):
        b = built[(rnd + j) % n]
        t = b.trainer
        counter = SyncCounter() if count_syncs else None
        with contextlib.ExitStack() as stack:
            for ctx in b.contexts:
                stack.enter_context(ctx())
            if counter is not None:
                stack.enter_context(counter)
            barrier()
            torch.manual_seed(20_000 + rnd)
            _, tg = timed(lambda: t.engine.generate(ids, mask))
            barrier()
            stats = MetricSums(t.engine.device)
            exp, te = timed(lambda: t.experience_phase([shared], stats))
            barrier()
            _, tt = timed(lambda: t.train_phase(exp, stats))
        rec = {"generation": tg, "experience": te, "training": tt}
        if counter is not None:
            rec["host_syncs"] = summarize_syncs(counter.counts)
        out[b.v["name"]] = rec
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(pi.PRESETS), default="cpu-small")
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--zero", type=int, default=0, help="ZeRO stage of every variant (unless the variant sets one)")
    p.add_argument("--variable-length", action="store_true")
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--check-equivalence", action="store_true")
    p.add_argument("--work-dir", default=os.environ.get("BENCH_WORK_DIR", os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "rlhf_bench")))
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    pre = pi.PRESETS[args.preset]
    # the ppo_iteration namespace that build_variant expects
    ns = argparse.Namespace(
        preset=args.preset, actor_shape=pre["actor"], critic_shape=pre["critic"], prompt_len=pre["prompt_len"],
        answer_len=pre["answer_len"], fixed_length=not args.variable_length, global_batch=pre["global_batch"],
        micro_batch=pre["micro_batch"], mini_batches=1, experience_micro_batch=0, ppo_epochs=1, dtype=pre["dtype"],
        iterations=args.reps, warmup=0, seed=1234, adam_impl=pi.adam_choice("torch"), work_dir=args.work_dir)

    from rlhf_engine.engine import init_distributed
    from rlhf_engine.engine.distributed import barrier

    dist = init_distributed()
    models_dir = os.path.join(args.work_dir, "models")
    if dist.local_rank == 0:
        bl.make_model_folder(models_dir, ns.actor_shape, "causal_lm", ns.dtype, seed=0)
        bl.make_model_folder(models_dir, ns.critic_shape, "score", ns.dtype, seed=1)
    barrier()
    models = {"actor": bl.make_model_folder(models_dir, ns.actor_shape, "causal_lm", ns.dtype, seed=0),
              "critic": bl.make_model_folder(models_dir, ns.critic_shape, "score", ns.dtype, seed=1)}
    prompts = bl.synthetic_prompts(ns.global_batch * max(args.reps, 2), ns.prompt_len,
                                   bl.SHAPES[ns.actor_shape]["vocab_size"], seed=ns.seed, fixed=ns.fixed_length)
    from patches import applied_in, variant_kind

    variants = [pi.parse_variant(s) for s in args.variant] or [{"name": "current"}]
    if variants[0].get("patch"):
        raise SystemExit(f"costs: the first variant ({variants[0]['name']}) is the current code: no patch")
    for i, v in enumerate(variants):
        v.setdefault("zero", args.zero)
        # before: the code before an applied fix (ratio before / current); candidate: a fix to try (current / it)
        v["kind"] = "current" if i == 0 else variant_kind(v.get("patch", ""))
        if v["kind"] == "before":
            v["applied_in"] = {p: applied_in(p) for p in v["patch"].split("+")}
    run_dir = os.path.join(args.work_dir, "runs", f"costs-{args.label or args.preset}-{os.environ['MASTER_PORT']}")
    built, skipped = [], {}
    for v in variants:
        try:
            built.append(pi.build_variant(ns, v, dist.world_size, models, prompts, run_dir))
        except pi.Skip as e:
            if not built:
                raise SystemExit(f"costs: the first variant ({v['name']}) is the reference and cannot be skipped: {e}")
            skipped[v["name"]] = str(e)
    variants = [b.v for b in built]
    result = {"kind": "costs", "label": args.label, "preset": args.preset, "world_size": dist.world_size,
              "command": bl.command_line([os.path.relpath(sys.argv[0], bl.ROOT)] + sys.argv[1:]),
              "machine": bl.machine_info(),
              "setup": {k: getattr(ns, k) for k in ("actor_shape", "critic_shape", "prompt_len", "answer_len",
                                                    "fixed_length", "global_batch", "micro_batch", "dtype")},
              "variants": [v for v in variants], "skipped": skipped, "reps": args.reps,
              "gather_once": pi.GATHER_ONCE_FLAG,
              "matmul_params": {"actor": bl.matmul_params(ns.actor_shape, "causal_lm"),
                                "critic": bl.matmul_params(ns.critic_shape, "score")}}
    if args.check_equivalence:
        result["equivalence"] = pi.equivalence_check(built)
    one_round(built, 0)  # warm-up (not recorded)
    result["host_syncs"] = {name: r["host_syncs"] for name, r in one_round(built, 0, count_syncs=True).items()}
    rounds = []
    for rnd in range(args.reps):
        rounds.append(one_round(built, rnd))
        if dist.is_main:
            print(f"[costs] round {rnd}: " + ", ".join(
                f"{name} {sum(r.values()):.2f}s" for name, r in rounds[-1].items()), flush=True)
    base = variants[0]["name"]
    summary = {}
    for v in variants:
        name = v["name"]
        med = {ph: bl.median([r[name][ph] for r in rounds]) for ph in PHASES}
        med["total"] = sum(med[ph] for ph in PHASES)
        summary[name] = {"median_s": med}
    kind = {v["name"]: v["kind"] for v in variants}

    def phase_s(r: dict, name: str, ph: str) -> float:
        return r[name][ph] if ph != "total" else sum(r[name][p] for p in PHASES)

    for name, s in summary.items():
        # per round without-fix / with-fix (the two ran back to back, so slow drifts of the machine cancel), then the
        # median: before / current for an applied fix, current / candidate for a candidate
        slow, fast = (name, base) if kind[name] == "before" else (base, name)
        per_round = {ph: [phase_s(r, slow, ph) / phase_s(r, fast, ph) for r in rounds] for ph in (*PHASES, "total")}
        s["ratio_without_over_with"] = {ph: bl.median(v) for ph, v in per_round.items()}
        s["ratio_range"] = {ph: [min(v), max(v)] for ph, v in per_round.items()}
    result["rounds"] = rounds
    result["summary"] = summary
    for b in built:
        b.trainer.metrics.close()
    if dist.is_main:
        bl.write_json(args.out, result)
        for name, s in summary.items():
            rt = s["ratio_without_over_with"]
            print(f"[costs] {name} ({kind[name]}): " + ", ".join(
                f"{ph} {s['median_s'][ph]:.3f}s (x{rt[ph]:.3f})" for ph in (*PHASES, "total")))
            hs = result["host_syncs"].get(name)
            if hs:
                print(f"[costs] {name}: host syncs per iteration {hs['by_owner']}; ours {hs['rlhf_engine_sites']}")
    return 0


if __name__ == "__main__":
    from rlhf_engine.cli import exit_process

    exit_process(main())
