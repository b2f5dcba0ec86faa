"""What the per-node tokenized-data cache saves at start-up: every rank tokenizing the whole dataset (no_cache), local
rank 0 building the entry while the node's other ranks wait and read it (cold), every rank reading an earlier run's
entry (warm). The variants alternate round after round in one launch (no_cache and cold swap places every round, so
an order effect cancels out); bench/README.md says what is measured.

    torchrun --nproc_per_node 2 bench/tokenize_cache.py --prompts 20000 --rounds 3 \
        --out bench/results/cpu/tokenize_cache.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

VARIANTS = ("no_cache", "cold", "warm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=8000, help="vocabulary of the trained BPE tokenizer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=os.path.join(os.environ.get("BENCH_WORK_DIR", tempfile.gettempdir()),
                                                   "tokenize_cache"))
    ap.add_argument("--local_rank", type=int, default=None)  # passed by some launchers
    args = ap.parse_args()

    from rlhf_engine import assets, comm
    from rlhf_engine.config import DataConfig
    from rlhf_engine.data import load_prompt_data
    from rlhf_engine.engine import init_distributed, load_tokenizer

    dist = init_distributed(30)
    data_file = os.path.join(args.work, f"prompts-{args.prompts}.jsonl")
    tok_dir = os.path.join(args.work, f"tokenizer-{args.vocab}")
    cache_dir = os.path.join(args.work, "cache")
    if dist.is_main:
        os.makedirs(args.work, exist_ok=True)
        if not os.path.isdir(tok_dir):
            assets.train_tiny_tokenizer(tok_dir, args.vocab)
        if not os.path.isfile(data_file):
            with open(data_file + ".tmp", "w") as f:
                f.writelines(json.dumps({"prompt": p}) + "\n" for p in assets.tiny_prompts(args.prompts))
            os.replace(data_file + ".tmp", data_file)
    comm.barrier()
    tok = load_tokenizer(tok_dir)
    base = DataConfig(data_path=data_file, prompt_template="Question: {prompt}\nAnswer:", eval_split=0.01)

    def timed(name: str) -> dict:
        data = dataclasses.replace(base, data_cache_dir="none" if name == "no_cache" else cache_dir)
        comm.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        out = load_prompt_data(data, tok, 512, seed=1, verbose=False)
        cpu = time.process_time() - c0
        comm.barrier()
        ranks = comm.all_gather_object((time.perf_counter() - w0, cpu, out.cache.status))
        return {"wall_s": max(w for w, _, _ in ranks), "cpu_s_all_ranks": sum(c for _, c, _ in ranks),
                "cache_status_by_rank": [s for _, _, s in ranks]}

    rounds = []
    for r in range(args.rounds):
        if dist.is_main and os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir)  # cold starts without an entry
        comm.barrier()
        rounds.append({n: timed(n) for n in (VARIANTS if r % 2 == 0 else ("cold", "no_cache", "warm"))})
        if dist.is_main:
            print(f"round {r}: " + ", ".join(f"{n} {x['wall_s']:.2f}s wall / {x['cpu_s_all_ranks']:.2f}s cpu"
                                             for n, x in rounds[-1].items()), flush=True)
    if dist.is_main:
        def med(f):
            return bl.median([f(x) for x in rounds])

        summary = {n: {"wall_s": med(lambda x: x[n]["wall_s"]),
                       "cpu_s_all_ranks": med(lambda x: x[n]["cpu_s_all_ranks"]),
                       "ratio_wall": med(lambda x: x["no_cache"]["wall_s"] / x[n]["wall_s"]),
                       "ratio_cpu": med(lambda x: x["no_cache"]["cpu_s_all_ranks"] / x[n]["cpu_s_all_ranks"]),
                       "cache_status_by_rank": rounds[-1][n]["cache_status_by_rank"]} for n in VARIANTS}
        entry = [f for f in os.listdir(cache_dir) if f.endswith(".pkl")]
        bl.write_json(args.out, {
            "benchmark": "tokenize_cache", "machine": bl.machine_info(), "ranks": dist.world_size,
            "command": bl.command_line(["torchrun", "--nproc_per_node", str(dist.world_size)] + sys.argv),
            "prompts": args.prompts, "vocab": args.vocab, "tokenizer": "byte-level BPE trained by rlhf_engine.assets",
            "entry_mib": os.path.getsize(os.path.join(cache_dir, entry[0])) / 2 ** 20 if entry else None,
            "data_file_mib": os.path.getsize(data_file) / 2 ** 20, "rounds": rounds, "summary": summary})
        print(json.dumps(summary, indent=1))
    comm.shutdown(ok=True)


if __name__ == "__main__":
    main()
