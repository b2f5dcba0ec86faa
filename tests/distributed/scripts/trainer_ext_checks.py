"""Harness for tests/distributed/test_trainer_extensions.py: the cross-rank guards in ONE launch.

    deepspeed --num_gpus 2 tests/distributed/scripts/trainer_ext_checks.py --spec spec.json --out result.json

spec.json: {"runs": [{"name", "args": [train_ppo.py flags], "inject": {...guards.Injection spec...}}, ...],
            "final": {"args": [...], "inject": {...}}}

Each run builds its trainer with `build_trainer(parse_args(args))`, gives it `TestHooks(nonfinite=...)` (the test hook of
trainer/guards.py) and trains; a `TrainingStopped` (or any exception) is caught and recorded, so the next run starts
on a clean process group (every rank raised at the same point). Recorded per rank (gathered to rank 0):
  error        {"type", "message", "iteration", "seconds"} or None (seconds: from the start of the failing
               iteration to the exception)
  snapshots    per completed iteration: for actor and critic, a digest of the weights and of the torch optimizer's
               state (Adam exp_avg / exp_avg_sq / step), the learning rate and applied optimizer steps
  skipped      the critic engine's skipped-step counter at the end
  warnings     the guard's warnings (rank 0)
and on rank 0 the metric records. The result file is written after the runs; then "final" runs
launch/train_ppo.py's `main` in this process with RLHF_ENGINE_TEST_INJECT_NONFINITE set, and the process exits with
its return code (the test checks the code the deepspeed launcher reports).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from spec_runner import settled  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                 if t.is_floating_point() else str(t.tolist()).encode())
    return h.hexdigest()[:16]


def snapshot(trainer) -> dict:
    from rlhf_engine.trainer.guards import base_optimizer

    out = {}
    for role in ("actor", "critic"):
        ds = trainer.engine.engines[role]
        opt = base_optimizer(ds.optimizer)
        moments = [v for st in opt.state.values() for _, v in sorted(st.items()) if torch.is_tensor(v)]
        out[role] = {"params": digest(p for _, p in sorted(ds.module.state_dict().items())),
                     "moments": digest(moments), "num_moments": len(moments),
                     "lr": [g["lr"] for g in opt.param_groups], "steps": trainer.engine.optimizer_steps(role)}
    return out


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def gather(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


@settled  # spec_runner.py: settle() once the run has returned (nothing of it held any more)
def run_one(spec: dict):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.hooks import TestHooks
    from rlhf_engine.trainer import build_trainer

    trainer = build_trainer(parse_args(spec["args"]), hooks=TestHooks(nonfinite=spec.get("inject")))
    handler = Collect()
    logging.getLogger("rlhf_engine.trainer.guards").addHandler(handler)
    records, snaps, error = [], [snapshot(trainer)], None
    try:
        while trainer.iteration < trainer.total_iterations:
            t0 = time.perf_counter()
            it = trainer.iteration
            try:
                records.append(trainer.step())
            except Exception as e:  # noqa: BLE001  (recorded: the test checks type and message)
                error = {"type": type(e).__name__, "message": str(e), "iteration": it,
                         "seconds": time.perf_counter() - t0}
                break
            snaps.append(snapshot(trainer))
    finally:
        logging.getLogger("rlhf_engine.trainer.guards").removeHandler(handler)
        trainer.metrics.close()
    mine = {"error": error, "snapshots": snaps, "skipped": trainer.guard.skipped_steps(),
            "warnings": handler.messages}
    per_rank = gather(mine)
    trainer.guard.remove_hooks()
    return {"name": spec["name"], "records": records, "ranks": per_rank}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    results = [run_one(run) for run in spec["runs"]]
    if torch.distributed.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"runs": results}, f)
    torch.distributed.barrier()
    # the real entry point, with the injection from the environment (read when the trainer is built)
    from rlhf_engine.hooks import INJECT_ENV
    from rlhf_engine.comm import shutdown

    os.environ[INJECT_ENV] = json.dumps(spec["final"]["inject"])
    entry = importlib.util.spec_from_file_location("train_ppo_entry", os.path.join(ROOT, "launch", "train_ppo.py"))
    mod = importlib.util.module_from_spec(entry)
    entry.loader.exec_module(mod)
    rc = mod.main(spec["final"]["args"])
    shutdown(ok=rc == 0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
