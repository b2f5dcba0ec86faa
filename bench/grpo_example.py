"""The GRPO example (examples/grpo_arithmetic.yaml) per phase, with and without the work that nothing reads (#62):
one launch of launch/train_ppo.py per variant, the variants in turn, `--rounds` times; medians of each launch's
iterations after the first (its warm-up).

    python bench/grpo_example.py [--steps 3] [--rounds 2] [--out bench/results/cpu/grpo_example.json]
    .venv-vllm/bin/python bench/grpo_example.py --variants with_lean with_vllm --out .../grpo_backends.json
    .venv-vllm/bin/python bench/grpo_example.py --variants with_lean with_vllm --config examples/ppo_sentiment.yaml \
        --out .../demo_backends.json

Variants: `before` builds the reference for objective/kl and computes every block in every forward (the path before
these changes); `no_reference` builds no reference (kl_coef 0, kl_loss_coef 0: nothing reads it); `frozen_prefix`
also starts every later forward from the frozen blocks' kept output; `lean` (the defaults) also leaves the first
mini-batch's old log-probs to its own training forward (--old_logprobs_from_update). `with_lean` and `with_vllm`:
the defaults with the generation backend named (what `--generation_backend auto` chooses between; vllm needs the
vLLM environment). Ratios are to the first variant given. Needs the demo assets (scripts/install.sh --demo).
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

VARIANTS = {
    "before": ["--monitor_reference_kl", "true", "--reuse_frozen_prefix", "false"],
    "no_reference": ["--reuse_frozen_prefix", "false", "--old_logprobs_from_update", "false"],
    "frozen_prefix": ["--old_logprobs_from_update", "false"],
    "lean": [],
    "with_lean": ["--generation_backend", "lean"],
    "with_vllm": ["--generation_backend", "vllm"],
}
KEYS = ("time/iteration", "time/generate", "time/experience", "time/train")


def cpu_flags() -> list:
    """The CPU's AVX-512 and AMX flags (bf16 speed differs by an order of magnitude without them)."""
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx512", "amx")))


def launch(extra: list, steps: int, out: str, config: str = "examples/grpo_arithmetic.yaml") -> list:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline",
           "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "launch/train_ppo.py", "--config", config, "--output_dir", out,
           "--max_steps", str(steps), "--export_final", "false", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "objective/score" in r]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--config", default="examples/grpo_arithmetic.yaml",
                    help="the example (with_lean / with_vllm also measure the demo's, examples/ppo_sentiment.yaml)")
    ap.add_argument("--variants", nargs="+", choices=sorted(VARIANTS),
                    default=["before", "no_reference", "frozen_prefix", "lean"])
    ap.add_argument("--out", default=os.path.join(BENCH, "results", "cpu", "grpo_example.json"))
    args = ap.parse_args()
    chosen = {name: VARIANTS[name] for name in args.variants}
    result = {"machine": bl.machine_info(), "cpu_flags": cpu_flags(), "steps": args.steps, "rounds": args.rounds,
              "config": args.config,
              "command": f"python bench/grpo_example.py --steps {args.steps} --rounds {args.rounds} --variants "
                         + " ".join(args.variants) + (f" --config {args.config}"
                                                      if args.config != "examples/grpo_arithmetic.yaml" else ""),
              "variants": {name: {"flags": flags, "launches": []} for name, flags in chosen.items()}}
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name, flags in chosen.items():
                records = launch(flags, args.steps, os.path.join(tmp, f"{name}{rnd}"), args.config)[1:]  # after
                # the warm-up
                med = {k: statistics.median(r[k] for r in records if r.get(k) is not None) for k in KEYS}
                med["reused"] = records[-1].get("batch/frozen_prefix_reused")
                med["scores"] = [r["objective/score"] for r in records]
                result["variants"][name]["launches"].append(med)
                print(name, rnd, {k: round(v, 2) for k, v in med.items() if isinstance(v, float)}, flush=True)
    for v in result["variants"].values():
        v["median"] = {k: statistics.median(m[k] for m in v["launches"]) for k in KEYS}
    base = result["variants"][args.variants[0]]["median"]
    result["ratios"] = {name: {k: v["median"][k] / base[k] for k in KEYS} for name, v in result["variants"].items()}
    result["wall_s"] = round(time.time() - t0, 1)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["ratios"], indent=1))


if __name__ == "__main__":
    main()
