"""Scaling tables: the same global batch on 1 and 2 ranks, ZeRO 0/2/3, optimizer offload, and ZeRO-3 with
generation_gather_once off and on.

    python bench/scaling.py --preset cpu-small --out bench/results/cpu/scaling.json

Launch kinds (torchrun): 1r = 1 rank x 1 thread, 2r = 2 ranks x 1 thread, 1r2t = 1 rank x 2 threads (2r's cores).
Every launch runs bench/ppo_iteration.py with ALL variants, interleaved; the launches alternate (1r, 2r, 1r2t, 1r, ...)
so a change in machine load hits every cell alike. A cell sums the measured iterations of all launches of its kind.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402
from ppo_iteration import GATHER_ONCE_FLAG, summarize  # noqa: E402

KINDS = {"1r": (1, 1), "2r": (2, 1), "1r2t": (1, 2)}  # name -> (ranks, threads per rank)
VARIANTS = ["zero0:zero=0", "zero2:zero=2", "zero3:zero=3,gather_once=0", "zero2+offload:zero=2,offload=1",
            "zero3+gather_once:zero=3,gather_once=1"]
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, args, out: str) -> dict:
    nproc, threads = KINDS[kind]
    # a launch of its own: no rank variables inherited from a launcher this script may run under
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"), PYTHONPATH=bl.ROOT)
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), os.path.join(BENCH, "ppo_iteration.py"), "--preset", args.preset,
           "--global-batch", str(args.global_batch), "--warmup", str(args.warmup), "--iterations", str(args.iterations),
           "--label", f"scaling-{kind}", "--work-dir", args.work_dir, "--out", out]
    for v in VARIANTS:
        cmd += ["--variant", v]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=bl.ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"scaling: launch {kind} failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    with open(out) as f:
        return json.load(f) | {"launch_s": time.perf_counter() - t0}


def cell(its: list) -> dict:
    s = summarize(its)  # a single run's sums, over the measured iterations of all launches of a kind
    return {"iterations": len(its), "samples_per_s": s["samples_per_s"],
            "generated_tokens_per_s": s["generated_tokens_per_s"], "iteration_s_median": s["iteration_s_median"],
            "iteration_s": [round(e["wall_s"], 4) for e in its], "share": s["share"],
            "tflops_per_rank": s["tflops_per_rank"]["overall"], "peak_mem_mib_per_rank": s["peak_mem_mib_per_rank"],
            "B_per_rank": its[0]["shape"]["B_per_rank"]}


def merge(launches: list) -> dict:
    """variant -> launch kind -> the cell of all measured iterations of that kind (or why there is none)."""
    its, why = {}, {}
    for kind, res in launches:
        for v in res["variants"]:
            its.setdefault(v["name"], {}).setdefault(kind, [])
            if v.get("skipped") or v.get("error"):
                why[v["name"], kind] = v.get("skipped") or v.get("error")
            else:
                its[v["name"]][kind] += [e for e in v["iterations"] if not e["warmup"]]
    return {name: {kind: cell(x) if x else {"skipped": why.get((name, kind), "no measured iteration")}
                   for kind, x in kinds.items()} for name, kinds in its.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(p, preset="cpu-small", iterations=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="launches of each kind (alternating)")
    p.add_argument("--kinds", default="1r,2r,1r2t")
    p.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    raw_dir = os.path.join(args.work_dir, "scaling_raw")
    launches = []
    for rep in range(args.repeats):
        for kind in kinds:
            launches.append((kind, launch(kind, args, os.path.join(raw_dir, f"{kind}-{rep}.json"))))
            print(f"[scaling] {kind} launch {rep}: {launches[-1][1]['launch_s']:.0f}s", flush=True)
    first = launches[0][1]
    result = {"kind": "scaling", "preset": args.preset, "command": bl.script_command(), "machine": first["machine"],
              "setup": first["setup"], "matmul_params": first["matmul_params"], "flop_formula": bl.FLOP_FORMULA,
              "kinds": {k: {"ranks": KINDS[k][0], "threads_per_rank": KINDS[k][1]} for k in kinds},
              "launch_order": [k for k, _ in launches], "launch_s": [round(r["launch_s"], 1) for _, r in launches],
              "gather_once": GATHER_ONCE_FLAG, "variants": VARIANTS, "table": merge(launches)}
    bl.write_json(args.out, result)
    for name, row in result["table"].items():
        print(f"[scaling] {name}: " + ", ".join(f"{k} {c['samples_per_s']:.2f} samples/s" if "samples_per_s" in c
                                                 else f"{k} skipped" for k, c in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
