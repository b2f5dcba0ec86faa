"""Rollout workers, synchronous against one version ahead, and a model of what a placement gains (docs/async-rollouts.md).

    python bench/async_rollouts.py measure --out bench/results/cpu/async_rollouts.json [--iterations 5]
    python bench/async_rollouts.py model --generate 40 --train 30 --sync 2 [--rollout_devices 1 --trainer_devices 1]
    python bench/async_rollouts.py gpu --dir bench/results/gpu-async --out bench/results/gpu-async/model.json

gpu: after `bash bench/gpu.sh --suite async` (the prepared GPU check: colocated, a worker at max_staleness 0 and at
1, each its own launch of bench/ppo_iteration.py): the model's prediction from the colocated run's phase times and
the K = 0 run's weight broadcast, beside the measured iteration-time ratios, and whether the worker had a device of
its own (one GPU: it shares the trainer's, so the measured K = 1 gain is bounded by the one device's contention).

measure: the GRPO example (examples/grpo_arithmetic.yaml: SmolLM2-135M-Instruct, 8 prompts x 4 samples x 32 tokens)
run three ways in turn, each its own launch: colocated (1 trainer rank generates and trains), a rollout worker with
max_staleness 0, and with max_staleness 1. On this 2-core machine the trainer and the worker get one core each
(OMP_NUM_THREADS=1): the colocated run uses one core, so its time is what the trainer's core alone does. Medians of
each run's `time/*` over the iterations after the first.

model: the steady-state time of an iteration for a placement, from the generation time G (on the rollout devices),
the training time T (experience + update, on the trainer devices) and the weight broadcast S, each measured alone:
  colocated on all D = trainer + rollout devices:  G * R / D + T * P / D   (R, P: the devices each measurement used)
  separate, max_staleness 0:                       G' + S + T'             (G' = G * R / rollout, T' = T * P / trainer)
  separate, max_staleness >= 1:                    max(G', T' + S)         (generation hides behind training)
assuming generation and training scale linearly with their devices (an upper bound on the gain).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402

# published points to set the model beside (the numbers; each from its project's report)
PUBLISHED = [
    {"who": "verl one-step-off-policy, FSDP2", "setup": "16 H20 GPUs", "speedup": 1.23},
    {"who": "verl one-step-off-policy, Megatron", "setup": "16 H20 GPUs", "speedup": 1.40},
    {"who": "verl fully async", "setup": "32-128 GPUs", "speedup": "1.9-2.7"},
    {"who": "AReaL (staleness bound, decoupled PPO)", "setup": "its reported runs", "speedup": 2.77},
    {"who": "PipelineRL (DeepSpeed ZeRO-3 trainer)", "setup": "128 H100", "speedup": 2.0},
]


def predict(g: float, t: float, s: float, r: int = 1, p: int = 1, rollout: int = 1, trainer: int = 1) -> dict:
    """Iteration seconds per placement (module docstring) and the speedups over colocated on every device."""
    d = rollout + trainer
    colocated = g * r / d + t * p / d
    gs, ts = g * r / rollout, t * p / trainer
    sync, ahead = gs + s + ts, max(gs, ts + s)
    return {"colocated_s": colocated, "separate_sync_s": sync, "separate_ahead_s": ahead,
            "speedup_sync": colocated / sync, "speedup_ahead": colocated / ahead}


def _median(records: list, key: str):
    xs = [r[key] for r in records[1:] if r.get(key) is not None]
    return statistics.median(xs) if xs else None


def measure(args) -> int:
    from rlhf_engine.engine.distributed import free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT}
    base = [sys.executable, os.path.join(ROOT, "launch", "train_ppo.py"), "--config",
            os.path.join(ROOT, "examples", "grpo_arithmetic.yaml"), "--max_steps", str(args.iterations),
            "--export_final", "false", "--overwrite_output_dir", "true"]
    runs = {}
    for name, extra in (("colocated", []), ("workers_k0", ["--max_staleness", "0"]),
                        ("workers_k1", ["--max_staleness", "1"])):
        out = os.path.join(args.work, name)
        cmd = base + ["--output_dir", out]
        worker = None
        if name != "colocated":
            address = f"127.0.0.1:{free_port()}"
            cmd += ["--rollout_workers", "1", "--rollout_address", address, *extra]
            worker = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "rollout_worker.py"),
                                       "--rollout_address", address], cwd=ROOT, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if worker is not None:
            worker.wait(timeout=120)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f if line.strip()]
        keys = ("time/iteration", "time/generate", "time/experience", "time/train", "time/weight_broadcast",
                "time/trainer_wait", "time/worker_idle", "async/staleness_max")
        runs[name] = {"wall_s": wall, "iterations": len(records), "median": {k: _median(records, k) for k in keys},
                      "per_iteration": [{k: r.get(k) for k in keys} for r in records]}
        print(name, json.dumps(runs[name]["median"]), flush=True)
    c, k0, k1 = runs["colocated"]["median"], runs["workers_k0"]["median"], runs["workers_k1"]["median"]
    g, t = c["time/generate"], c["time/experience"] + c["time/train"]
    result = {"command": bl.script_command(), "machine": bl.machine_info(), "runs": runs,
              "ratios": {"k1_over_k0_iteration": k1["time/iteration"] / k0["time/iteration"],
                         "k1_over_colocated_iteration": k1["time/iteration"] / c["time/iteration"]},
              "model_from_colocated": predict(g, t, k0["time/weight_broadcast"] or 0.0), "published": PUBLISHED}
    bl.write_json(args.out, result)
    return 0


def from_gpu(args) -> int:
    """The model against `bash bench/gpu.sh --suite async`'s three launches (module docstring)."""
    runs = {}
    for name in ("colocated", "async_k0", "async_k1"):
        res = bl.read_json(os.path.join(args.dir, f"{name}.json")) or {}
        variant = next(iter(res.get("variants", [])), {})
        summ, its = variant.get("summary") or {}, [e for e in variant.get("iterations", []) if not e["warmup"]]
        if not summ:
            print(f"async_rollouts gpu: {name} has no measured iterations ({variant.get('error') or 'missing'})",
                  file=sys.stderr)
            return 1

        def metric(key, its=its):
            xs = [e["metrics"][key] for e in its if e["metrics"].get(key) is not None]
            return statistics.median(xs) if xs else None

        runs[name] = {"iteration_s_median": summ["iteration_s_median"], "phase_s_mean": summ["phase_s_mean"],
                      "worker_devices": variant.get("worker_devices"),
                      **{k: metric(k) for k in ("time/weight_broadcast", "time/trainer_wait", "time/worker_idle",
                                                "async/staleness_max")}}
    c = runs["colocated"]
    g = c["phase_s_mean"]["generation"]
    t = c["iteration_s_median"] - g  # everything else of the iteration: experience, training, the rest
    s = runs["async_k0"]["time/weight_broadcast"] or 0.0
    # a worker on the trainer's GPU 0, or on the CPU beside the trainer (--tiny), shares the trainer's machine
    shared = all(d in ("cuda:0", "cpu") for d in runs["async_k1"]["worker_devices"] or ["cuda:0"])
    it = {k: v["iteration_s_median"] for k, v in runs.items()}
    result = {"command": bl.script_command(), "runs": runs, "worker_shares_the_trainer_s_device": shared,
              "measured": {"k0_over_colocated": it["async_k0"] / it["colocated"],
                           "k1_over_colocated": it["async_k1"] / it["colocated"],
                           "k1_over_k0": it["async_k1"] / it["async_k0"]},
              "model_inputs": {"generate_s": g, "train_s": t, "sync_s": s},
              # the measured placement, predicted: the colocated run on the trainer's device alone against the
              # trainer's device plus a rollout device of its own (not what one shared GPU gives)
              "predicted": {"k0_over_colocated": (g + s + t) / (g + t), "k1_over_colocated": max(g, t + s) / (g + t)},
              # equal device counts: colocated on both devices against one each side, and two each side
              "model_1_plus_1": predict(g, t, s),
              "model_2_plus_2": predict(g, t, s, rollout=2, trainer=2),
              "published": PUBLISHED}
    bl.write_json(args.out, result)
    print(json.dumps({k: result[k] for k in ("measured", "predicted", "worker_shares_the_trainer_s_device",
                                             "model_inputs", "model_1_plus_1")}, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--out", required=True)
    m.add_argument("--iterations", type=int, default=5)
    m.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "rlhf_bench_async"))
    gq = sub.add_parser("gpu")
    gq.add_argument("--dir", required=True)
    gq.add_argument("--out", required=True)
    q = sub.add_parser("model")
    for name in ("generate", "train", "sync"):
        q.add_argument(f"--{name}", type=float, required=True)
    for name in ("measured_rollout_devices", "measured_trainer_devices", "rollout_devices", "trainer_devices"):
        q.add_argument(f"--{name}", type=int, default=1)
    args = p.parse_args(argv)
    if args.cmd == "measure":
        return measure(args)
    if args.cmd == "gpu":
        return from_gpu(args)
    print(json.dumps(predict(args.generate, args.train, args.sync, args.measured_rollout_devices,
                             args.measured_trainer_devices, args.rollout_devices, args.trainer_devices), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
