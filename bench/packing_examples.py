"""Packed vs padded forwards on the examples' real workloads: experience + training time per iteration.

    python bench/packing_examples.py --example grpo --example demo --launches 2 --iterations 4 \
        --out bench/results/cpu/packing_examples.json

Each launch is `launch/train_ppo.py --config <example> --max_steps N --packing on|off` (SmolLM2-135M-Instruct, the
example's own shapes); launches alternate on / off, so slow drift of a shared machine falls on both. From each run's
metrics.jsonl, the first iteration dropped (warm-up): the medians of time/experience + time/train (the phases packing
changes; generation does not pack) and of the padding fractions. Reported per example: the median of each variant over
its launches, the ratio padded / packed (> 1: packing is faster) and every launch's numbers.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

EXAMPLES = {"grpo": "examples/grpo_arithmetic.yaml", "demo": "examples/ppo_sentiment.yaml",
            "calculator": "examples/grpo_calculator.yaml"}


def launch(config: str, packing: str, iterations: int, out: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    subprocess.run([sys.executable, "launch/train_ppo.py", "--config", config, "--max_steps", str(iterations),
                    "--packing", packing, "--output_dir", out, "--export_final", "false"],
                   cwd=bl.ROOT, env=env, check=True, capture_output=True, text=True)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f][1:]

    def med(fn):
        return statistics.median(fn(r) for r in recs)

    return {"phases_s": med(lambda r: r["time/experience"] + r["time/train"]),
            "experience_s": med(lambda r: r["time/experience"]), "train_s": med(lambda r: r["time/train"]),
            "padding_fraction": med(lambda r: r["batch/padding_fraction"]),
            "packed_padding_fraction": med(lambda r: r.get("batch/packed_padding_fraction", float("nan")))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--example", action="append", choices=sorted(EXAMPLES), required=True)
    p.add_argument("--launches", type=int, default=2, help="launches per variant and example")
    p.add_argument("--iterations", type=int, default=4, help="iterations per launch (the first is dropped)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    result = {"measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": bl.git_commit(),
              "load_average": os.getloadavg()[0], "examples": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.example:
            runs = {"on": [], "off": []}
            for i in range(args.launches):
                for packing in (("on", "off") if i % 2 == 0 else ("off", "on")):
                    runs[packing].append(launch(EXAMPLES[name], packing, args.iterations,
                                                os.path.join(tmp, f"{name}_{packing}_{i}")))
                    print(name, packing, runs[packing][-1], flush=True)
            med = {k: statistics.median(r["phases_s"] for r in v) for k, v in runs.items()}
            result["examples"][name] = {"config": EXAMPLES[name], "launches": runs, "median_phases_s": med,
                                        "padded_over_packed": med["off"] / med["on"]}
            print(name, "padded / packed", round(med["off"] / med["on"], 3), flush=True)
    bl.write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
