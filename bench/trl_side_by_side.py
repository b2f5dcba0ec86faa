"""Ours against TRL's GRPOTrainer on the GRPO example, side by side: launches alternating, ours first, `--rounds`
times; per-iteration time (median of each launch's iterations after the first) and time to accuracy >= 0.75 (the
summed iteration times up to the end of the first 4-iteration window whose mean accuracy reaches 0.75; None when
none does).

    bash bench/trl_grpo/install.sh            # TRL's own environment, .venv-trl
    python bench/trl_side_by_side.py [--rounds 2] [--iterations 12] [--out bench/results/cpu/trl_side_by_side.json]

Ours: `launch/train_ppo.py --config examples/grpo_arithmetic.yaml` (its defaults); TRL: bench/trl_grpo/run.py on the
same settings (its docstring lists them). Needs the demo assets (scripts/install.sh --demo).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402
from grpo_example import cpu_flags  # noqa: E402

TARGET, WINDOW = 0.75, 4
ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "DS_ACCELERATOR": "cpu",
       "TOKENIZERS_PARALLELISM": "false"}


def time_to_target(seconds: list, accuracy: list):
    """Seconds of iterations until the end of the first WINDOW-iteration window whose mean accuracy >= TARGET."""
    for end in range(WINDOW, len(accuracy) + 1, WINDOW):
        if statistics.fmean(accuracy[end - WINDOW:end]) >= TARGET:
            return sum(seconds[:end])
    return None


def summary(side: dict) -> dict:
    later = side["time/iteration"][1:]  # the first iteration warms up
    return {"median_iteration_s": statistics.median(later),
            "phases_median_s": {k: statistics.median(side[k][1:]) for k in
                                ("time/generate", "time/experience", "time/train")},
            "time_to_target_s": time_to_target(side["time/iteration"], side["accuracy"]),
            "accuracy_windows": [round(statistics.fmean(side["accuracy"][i:i + WINDOW]), 3)
                                 for i in range(0, len(side["accuracy"]), WINDOW)]}


def ours(iterations: int, out: str) -> dict:
    cmd = [sys.executable, "launch/train_ppo.py", "--config", "examples/grpo_arithmetic.yaml", "--output_dir", out,
           "--max_steps", str(iterations), "--export_final", "false"]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, check=True, capture_output=True, timeout=3600)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [r for r in map(json.loads, f) if "objective/score" in r]
    side = {k: [r[k] for r in records] for k in ("time/generate", "time/experience", "time/train")}
    # time/iteration closes with the next iteration's start (trainer/clock.py): the last record's is the phases' sum
    side["time/iteration"] = [r.get("time/iteration") or r["time/generate"] + r["time/experience"] + r["time/train"]
                              for r in records]
    return {**side, "accuracy": [r["objective/score"] for r in records]}


def trl(iterations: int, model_dir: str, venv: str, out: str) -> dict:
    cmd = [os.path.join(venv, "bin", "python"), "bench/trl_grpo/run.py", "--model_dir", model_dir, "--out", out,
           "--iterations", str(iterations), "--work_dir", os.path.dirname(out)]
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **ENV}, check=True, capture_output=True, timeout=3600)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--trl_venv", default=os.path.join(ROOT, ".venv-trl"))
    ap.add_argument("--out", default=os.path.join(BENCH, "results", "cpu", "trl_side_by_side.json"))
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.trl_venv, "bin", "python")):
        sys.exit(f"no TRL environment at {args.trl_venv}: run `bash bench/trl_grpo/install.sh`")
    sys.path.insert(0, ROOT)
    from rlhf_engine.pretrained import BUILTIN_MODEL, resolve_builtin

    model_dir = resolve_builtin(BUILTIN_MODEL)
    result = {"machine": bl.machine_info(), "cpu_flags": cpu_flags(), "rounds": args.rounds,
              "iterations": args.iterations, "target_accuracy": TARGET, "window": WINDOW,
              "command": f"python bench/trl_side_by_side.py --rounds {args.rounds} --iterations {args.iterations}",
              "launches": {"ours": [], "trl": []}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name in ("ours", "trl"):
                where = os.path.join(tmp, f"{name}{rnd}")
                os.makedirs(where, exist_ok=True)
                side = (ours(args.iterations, where) if name == "ours" else
                        trl(args.iterations, model_dir, args.trl_venv, os.path.join(where, "run.json")))
                result["launches"][name].append({**summary(side), "raw": side})
                s = result["launches"][name][-1]
                print(name, rnd, round(s["median_iteration_s"], 2), s["time_to_target_s"], s["accuracy_windows"],
                      flush=True)
    med = {name: statistics.median(s["median_iteration_s"] for s in launches)
           for name, launches in result["launches"].items()}
    result["median_iteration_s"] = med
    result["ours_over_trl"] = med["ours"] / med["trl"]
    result["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("ours / trl per iteration:", round(result["ours_over_trl"], 3))


if __name__ == "__main__":
    main()
