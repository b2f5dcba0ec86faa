"""What the per-node tokenized-data cache saves at start-up: every rank tokenizing the whole dataset (no cache)
against local rank 0 building the entry while the node's other ranks wait and read it (cold), and every rank reading
an entry of an earlier run (warm). Variants run interleaved, round after round, in one launch (no cache
and cold swap places every round).

    torchrun --nproc_per_node 2 bench/tokenize_cache.py --prompts 20000 --rounds 3 --out bench/results/cpu/tokenize_cache.json

Per variant and round: wall time of `load_prompt_data` from a barrier before to a barrier after (the slowest rank:
training starts only then), and CPU seconds summed over the ranks (`time.process_time`: the node's cores spent).
Ratios: no cache / variant, the median over rounds of the two timings of a round. The tokenizer is trained by the
script (`rlhf_engine.assets`, a byte-level BPE; `--vocab`), prompts are `assets.tiny_prompts` text written to one
.jsonl file, with a prompt template so the template step is measured too.
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
import benchlib  # noqa: E402

VARIANTS = ("no_cache", "cold", "warm")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--vocab", type=int, default=8000, help="vocabulary of the trained BPE tokenizer")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default=os.path.join(os.environ.get("BENCH_WORK_DIR", tempfile.gettempdir()),
                                                   "tokenize_cache"))
    ap.add_argument("--local_rank", type=int, default=None)
    args = ap.parse_args()

    from rlhf_engine import assets, comm
    from rlhf_engine.config import DataConfig
    from rlhf_engine.data import load_prompt_data
    from rlhf_engine.engine import init_distributed, load_tokenizer

    dist = init_distributed(30)
    work = args.work
    data_file = os.path.join(work, f"prompts-{args.prompts}.jsonl")
    tok_dir = os.path.join(work, f"tokenizer-{args.vocab}")
    if dist.is_main:
        os.makedirs(work, exist_ok=True)
        if not os.path.isdir(tok_dir):
            assets.train_tiny_tokenizer(tok_dir, args.vocab)
        if not os.path.isfile(data_file):
            with open(data_file + ".tmp", "w") as f:
                for p in assets.tiny_prompts(args.prompts):
                    f.write(json.dumps({"prompt": p}) + "\n")
            os.replace(data_file + ".tmp", data_file)
    comm.barrier()
    tok = load_tokenizer(tok_dir)
    base = DataConfig(data_path=data_file, prompt_template="Question: {prompt}\nAnswer:", eval_split=0.01)
    cache_dir = os.path.join(work, "cache")

    def timed(data) -> tuple[float, float, str]:
        comm.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        out = load_prompt_data(data, tok, 512, seed=1, verbose=False)
        cpu = time.process_time() - c0
        comm.barrier()
        stats = comm.all_gather_object((time.perf_counter() - w0, cpu))
        return max(w for w, _ in stats), sum(c for _, c in stats), out.cache.status

    rounds = []
    for r in range(args.rounds):
        if dist.is_main and os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir)  # cold: no entry
        comm.barrier()
        rec = {}
        # no_cache and cold swap places every round (warm needs cold's entry): an order effect cancels out
        for name in (VARIANTS if r % 2 == 0 else ("cold", "no_cache", "warm")):
            data = dataclasses.replace(base, data_cache_dir="none" if name == "no_cache" else cache_dir)
            wall, cpu, status = timed(data)
            statuses = comm.all_gather_object(status)
            rec[name] = {"wall_s": wall, "cpu_s_all_ranks": cpu, "cache_status_by_rank": statuses}
        rounds.append(rec)
        if dist.is_main:
            print(f"round {r}: " + ", ".join(f"{n} {rec[n]['wall_s']:.2f}s wall / {rec[n]['cpu_s_all_ranks']:.2f}s "
                                             f"cpu" for n in VARIANTS), flush=True)
    if dist.is_main:
        entry = [f for f in os.listdir(cache_dir) if f.endswith(".pkl")]
        summary = {}
        for name in VARIANTS:
            summary[name] = {
                "wall_s": benchlib.median([x[name]["wall_s"] for x in rounds]),
                "cpu_s_all_ranks": benchlib.median([x[name]["cpu_s_all_ranks"] for x in rounds]),
                "ratio_wall": benchlib.median([x["no_cache"]["wall_s"] / x[name]["wall_s"] for x in rounds]),
                "ratio_cpu": benchlib.median([x["no_cache"]["cpu_s_all_ranks"] / x[name]["cpu_s_all_ranks"]
                                              for x in rounds]),
                "cache_status_by_rank": rounds[-1][name]["cache_status_by_rank"],
            }
        benchlib.write_json(args.out, {
            "benchmark": "tokenize_cache", "command": benchlib.command_line(["torchrun", "--nproc_per_node",
                                                                            str(dist.world_size)] + sys.argv),
            "machine": benchlib.machine_info(), "ranks": dist.world_size, "prompts": args.prompts,
            "vocab": args.vocab, "tokenizer": "byte-level BPE trained by rlhf_engine.assets",
            "entry_mib": os.path.getsize(os.path.join(cache_dir, entry[0])) / 2 ** 20 if entry else None,
            "data_file_mib": os.path.getsize(data_file) / 2 ** 20, "rounds": rounds, "summary": summary})
        print(json.dumps(summary, indent=1))
    comm.shutdown(ok=True)


if __name__ == "__main__":
    main()
