"""rlhf_engine against DeepSpeed-Chat step 3 on DeepSpeed-Chat's own configurations, through the shared harness.

    python bench/side_by_side.py --harness ../shared/peer/side_by_side.sh --rounds 3 \
        --out bench/results/cpu/dschat_side_by_side.json

The harness (not part of this project: see its README) runs one launch of our `launch/train_ppo.py`, then one of
DeepSpeed-Chat's step 3, on the same weights, prompts, shapes, ZeRO stages and dtype, 2 ranks, and prints the median
iteration time of each (end-of-iteration stamps, the first 2 dropped). This script calls it once per configuration and
round, the configurations in turn within a round (slow drift of a shared machine spreads over all of them), and keeps
every launch: both medians, our phase medians (time/generate, time/experience, time/train of the run's metrics.jsonl,
the first 2 iterations dropped) and DeepSpeed-Chat's own printed generation latency.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

# name: (the harness's H L B P R ZA ZC DTYPE, iterations, description): its README's three configurations, then two
# shapes of our own that nothing was tuned on (wide: few layers, wide matmuls; deep: many thin layers)
CONFIGS = {
    "small_z2": ("64 2 4 32 32 2 2 bf16", 20, "OPT H64 L2, 4 prompts/rank, 32+32 tokens, ZeRO 2/2, bf16"),
    "small_z3": ("64 2 4 32 32 3 2 bf16", 12, "same, actor ZeRO 3"),
    "mid_z2": ("256 4 8 32 64 2 2 bf16", 12, "OPT H256 L4, 8 prompts/rank, 32+64 tokens, ZeRO 2/2, bf16"),
    "wide_z2": ("512 2 4 64 64 2 2 bf16", 12, "ours: OPT H512 L2, 4 prompts/rank, 64+64 tokens, ZeRO 2/2, bf16"),
    "deep_z2": ("128 8 8 48 48 2 2 bf16", 12, "ours: OPT H128 L8, 8 prompts/rank, 48+48 tokens, ZeRO 2/2, bf16"),
}
OUR_TIMES = ("generate", "experience", "train", "metrics", "log", "checkpoint", "eval", "other", "iteration")
# the performance issue's starting point (median of 3 launches each), which the targets are relative to
BASELINE = {"commit": "7ba5f3b", "date": "2026-12-01",
            "configs": {"small_z2": {"ours": 0.116, "theirs": 0.096}, "small_z3": {"ours": 0.395, "theirs": 0.341},
                        "mid_z2": {"ours": 0.515, "theirs": 0.468}},
            "mid_z2_phases": {"generate": 0.216, "experience": 0.066, "train": 0.233}}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def launch(harness: str, name: str) -> dict:
    args, iters, _ = CONFIGS[name]
    t = time.time()
    proc = subprocess.run(["bash", harness, name, *args.split(), "1", str(iters)], cwd=bl.ROOT, capture_output=True,
                          text=True)
    work = os.path.join("/tmp/peer", name)  # where the harness leaves its logs
    s = {m[0]: {"rc": int(m[1]), "median_s": None if m[2] == "nan" else float(m[2])}
         for m in re.findall(r"(ours|theirs) rc=(\d+) (\S+) \d+", _read(os.path.join(work, "summary.txt")))}
    recs = [json.loads(line) for line in _read(os.path.join(work, "ourout", "metrics.jsonl")).splitlines() if line][2:]
    printed = theirs_latencies(_read(os.path.join(work, "theirs_1.log")))
    gens, trains = printed["generation"], printed["training"]
    return {"ours_s": s.get("ours", {}).get("median_s"), "theirs_s": s.get("theirs", {}).get("median_s"),
            "ours_rc": s.get("ours", {}).get("rc"), "theirs_rc": s.get("theirs", {}).get("rc"),
            "ours_phases_s": {k: statistics.median(r[f"time/{k}"] for r in recs)
                              for k in OUR_TIMES if recs and f"time/{k}" in recs[0]},
            "ours_named_share": named_share(recs),
            # DeepSpeed-Chat's own per-iteration prints (rounded to 10 ms): generation; training (train_rlhf); the
            # stamp-to-stamp rest is its experience forwards and logging
            "theirs_generation_s": statistics.median(gens[2:] or gens) if gens else None,
            "theirs_training_s": statistics.median(trains[2:] or trains) if trains else None,
            "wall_s": round(time.time() - t, 1), "harness_rc": proc.returncode,
            "tail": proc.stdout[-400:] if proc.returncode else ""}


def theirs_latencies(log: str) -> dict:
    """DeepSpeed-Chat's own per-iteration prints in its log (seconds, rounded to 10 ms): generation, and training
    (train_rlhf); its experience forwards are in neither."""
    return {k: [float(x) for x in re.findall(rf"{word} => Latency: ([0-9.]+)s", log)]
            for k, word in (("generation", "Generation"), ("training", "Training  "))}


def named_share(recs: list):
    """Median over iterations of (generation + experience + training + eval + metrics + log + checkpoint) /
    time/iteration: how much of the stamp-to-stamp time the named parts account for."""
    named = [k for k in OUR_TIMES if k not in ("other", "iteration")]
    ok = [r for r in recs if r.get("time/iteration")]
    return statistics.median(sum(r.get(f"time/{k}", 0.0) for k in named) / r["time/iteration"] for r in ok) if ok \
        else None


def summarize(launches: list) -> dict:
    ok = [x for x in launches if x["ours_s"] and x["theirs_s"]]
    if not ok:
        return {}
    ours, theirs = statistics.median(x["ours_s"] for x in ok), statistics.median(x["theirs_s"] for x in ok)
    shares = [x["ours_named_share"] for x in ok if x.get("ours_named_share")]
    return {"ours_median_s": ours, "theirs_median_s": theirs, "ratio": ours / theirs,
            "ours_named_share_median": statistics.median(shares) if shares else None,
            "ratio_per_launch": [x["ours_s"] / x["theirs_s"] for x in ok],
            "ours_phases_median_s": {k: statistics.median(x["ours_phases_s"][k] for x in ok if k in x["ours_phases_s"])
                                     for k in OUR_TIMES if any(k in x["ours_phases_s"] for x in ok)},
            "theirs_phases_median_s": {k: statistics.median(x[f"theirs_{k}_s"] for x in ok if x.get(f"theirs_{k}_s"))
                                       for k in ("generation", "training") if any(x.get(f"theirs_{k}_s") for x in ok)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--harness", default=os.path.join(bl.ROOT, "..", "shared", "peer", "side_by_side.sh"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not os.path.isfile(args.harness):
        p.error(f"unknown configurations {unknown}" if unknown else f"no harness at {args.harness}")
    res = {"commit": bl.git_commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "machine": bl.machine_info(),
           "load_average_at_start": os.getloadavg()[0], "rounds": args.rounds, "baseline": BASELINE,
           "command": f"python bench/side_by_side.py --rounds {args.rounds} --out {args.out}",
           "configs": {n: {"args": CONFIGS[n][0], "iterations": CONFIGS[n][1], "describe": CONFIGS[n][2],
                           "launches": []} for n in names}}
    for r in range(args.rounds):
        for n in names:
            x = launch(args.harness, n)
            res["configs"][n]["launches"].append(x)
            print(f"round {r + 1} {n}: ours {x['ours_s']} theirs {x['theirs_s']} phases {x['ours_phases_s']}",
                  flush=True)
    for n in names:
        res["configs"][n].update(summarize(res["configs"][n]["launches"]))
    bl.write_json(args.out, res)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
