"""Harness for tests/distributed/test_faults.py: runs PPO trainers one after another in one launch (as
resume_checks.py does) and writes each finished run's result to the result file as soon as it ends, so that a later
run may kill the whole launch (a fault injected with RLHF_ENGINE_TEST_KILL / RLHF_ENGINE_TEST_STALL, which the spec
sets per run).

    deepspeed --num_gpus 2 tests/distributed/scripts/fault_checks.py --spec spec.json --out result.json

spec.json: {"runs": [{"name": str, "args": [train_ppo.py flags...], "env": {"RLHF_ENGINE_TEST_KILL": "1:3:train_step"}},
...]}. Each run is built exactly as launch/train_ppo.py builds it (`resume_checks.run_one`: records, final weights in
<output_dir>/final_<role>.pt).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402

from resume_checks import run_one  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    results = []
    for run in spec["runs"]:
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        try:
            res = run_one(run)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if res is not None:
            results.append(res)
            with open(args.out + ".tmp", "w") as f:  # after every run: a later one may end the launch
                json.dump({"runs": results}, f)
            os.replace(args.out + ".tmp", args.out)
            print(f"[fault_checks] run {run['name']} done", flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
