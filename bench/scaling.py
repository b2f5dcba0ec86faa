"""Scaling tables: the same global batch on 1 rank and on 2 ranks, ZeRO 0/2/3, optimizer offload on/off, and
gather-once on/off when TrainConfig has such a switch.

    python bench/scaling.py --preset cpu-small --out bench/results/cpu/scaling.json

Launch kinds (torchrun, one process per rank):
    1r  1 rank x 1 thread       2r  2 ranks x 1 thread each       1r2t  1 rank x 2 threads (the same cores as 2r)
Every launch builds ALL variants side by side and interleaves their iterations (ppo_iteration.py); the launches
themselves alternate (1r, 2r, 1r2t, 1r, 2r, 1r2t, ...), so a change in machine load hits every cell alike. A cell's
throughput is its samples / its wall time summed over the measured iterations of all launches of its kind.
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

KINDS = {"1r": (1, 1), "2r": (2, 1), "1r2t": (1, 2)}  # name -> (ranks, threads per rank)
RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
             "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def variants() -> list[str]:
    return ["zero0:zero=0", "zero2:zero=2", "zero3:zero=3,gather_once=0", "zero2+offload:zero=2,offload=1",
            "zero3+gather_once:zero=3,gather_once=1"]


def launch(kind: str, args, out: str, variant_specs: list[str]) -> dict:
    nproc, threads = KINDS[kind]
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update(OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               DS_ACCELERATOR=env.get("DS_ACCELERATOR", "cpu"), PYTHONPATH=bl.ROOT)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
           os.path.join(BENCH, "ppo_iteration.py"), "--preset", args.preset, "--global-batch", str(args.global_batch),
           "--warmup", str(args.warmup), "--iterations", str(args.iterations), "--label", f"scaling-{kind}",
           "--work-dir", args.work_dir, "--out", out]
    for v in variant_specs:
        cmd += ["--variant", v]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=bl.ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if p.returncode != 0:
        raise SystemExit(f"scaling: launch {kind} failed (rc {p.returncode}):\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    with open(out) as f:
        res = json.load(f)
    res["launch_s"] = time.perf_counter() - t0
    return res


def merge(launches: list[tuple[str, dict]]) -> dict:
    cells: dict = {}
    for kind, res in launches:
        for v in res["variants"]:
            c = cells.setdefault(v["name"], {}).setdefault(kind, {"iterations": [], "skipped": None})
            if v.get("skipped") or v.get("error"):
                c["skipped"] = v.get("skipped") or v.get("error")
                continue
            c["iterations"] += [e for e in v["iterations"] if not e["warmup"]]
    table = {}
    for name, kinds in cells.items():
        for kind, c in kinds.items():
            its = c["iterations"]
            if not its:
                table.setdefault(name, {})[kind] = {"skipped": c["skipped"] or "no measured iteration"}
                continue
            wall = sum(e["wall_s"] for e in its)
            phases = {k: sum(e["phases_s"][k] for e in its) / wall for k in its[0]["phases_s"]}
            flops = sum(sum(e["flops_per_rank"].values()) for e in its)
            table.setdefault(name, {})[kind] = {
                "iterations": len(its), "samples_per_s": sum(e["samples"] for e in its) / wall,
                "generated_tokens_per_s": sum(e["generated_tokens"] for e in its) / wall,
                "iteration_s_median": bl.median([e["wall_s"] for e in its]),
                "iteration_s": [round(e["wall_s"], 4) for e in its],
                "share": phases, "tflops_per_rank": flops / wall / 1e12,
                "peak_mem_mib_per_rank": [max(e["peak_mem_mib"][r] for e in its)
                                          for r in range(len(its[0]["peak_mem_mib"]))],
                "B_per_rank": its[0]["shape"]["B_per_rank"],
            }
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2, help="launches of each kind (alternating)")
    p.add_argument("--kinds", default="1r,2r,1r2t")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--work-dir", default=os.environ.get("BENCH_WORK_DIR", os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "rlhf_bench")))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import ppo_iteration as pi

    specs = variants()
    kinds = args.kinds.split(",")
    launches = []
    raw_dir = os.path.join(args.work_dir, "scaling_raw")
    os.makedirs(raw_dir, exist_ok=True)
    for rep in range(args.repeats):
        for kind in kinds:
            res = launch(kind, args, os.path.join(raw_dir, f"{kind}-{rep}.json"), specs)
            launches.append((kind, res))
            print(f"[scaling] {kind} launch {rep}: {res['launch_s']:.0f}s", flush=True)
    first = launches[0][1]
    result = {
        "kind": "scaling", "preset": args.preset,
        "command": bl.command_line([os.path.relpath(sys.argv[0], bl.ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "machine": first["machine"], "setup": first["setup"], "matmul_params": first["matmul_params"],
        "flop_formula": bl.FLOP_FORMULA, "kinds": {k: {"ranks": KINDS[k][0], "threads_per_rank": KINDS[k][1]}
                                                   for k in kinds},
        "launch_order": [k for k, _ in launches], "launch_s": [round(r["launch_s"], 1) for _, r in launches],
        "gather_once": pi.GATHER_ONCE_FLAG,
        "variants": specs, "table": merge(launches),
    }
    bl.write_json(args.out, result)
    for name, row in result["table"].items():
        print(f"[scaling] {name}: " + ", ".join(
            f"{k} {c['samples_per_s']:.2f} samples/s" if "samples_per_s" in c else f"{k} skipped"
            for k, c in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
