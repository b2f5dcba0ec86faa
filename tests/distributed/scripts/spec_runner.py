"""The shared `main()` of the harness scripts: read a spec of runs, run each, write rank 0's results, shut down.

    python <harness>.py --spec spec.json --out result.json     (spec.json: {"runs": [{"name": ..., ...}, ...]})
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Optional

import torch


def settle() -> None:
    """The end of a harness run (its objects deleted): collect its cycles, then freeze what survives, as the launch
    scripts do at start-up (`cli.freeze_startup`). What outlives a run (modules, caches) lives to the end of the
    process; frozen, it is out of every later collection's scan, and the runs and DeepSpeed's ZeRO-3 set-up collect
    often (the shared 2-rank PPO launch: 90 -> 75 s)."""
    from rlhf_engine.cli import freeze_startup

    freeze_startup()


def run_specs(run_one: Callable[[dict], Optional[dict]], tag: str) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    results = []
    for run in spec["runs"]:
        t0 = time.perf_counter()
        res = run_one(run)
        if res is not None:
            results.append(res)
            # the time of each run: where a shared launch's minutes go
            print(f"[{tag}] run {run['name']} done in {time.perf_counter() - t0:.1f} s", flush=True)
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"runs": results}, f)
    from rlhf_engine.comm import shutdown

    shutdown(ok=True)  # as launch/train_ppo.py ends: a barrier (no gloo abort at exit), a vLLM engine closed first
    return 0
