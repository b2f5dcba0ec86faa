"""2 ranks, one node: local rank 0 builds the tokenized-data cache entry, the other rank reads it; a build slower
than the job's collective timeout does not time the other rank out; ranks that disagree about the cache do not use
it (and do not wait for each other); invalid data raises the same error on every rank.

    torchrun --nproc_per_node 2 data_cache_checks.py --tokenizer DIR --work DIR --out result.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from rlhf_engine.config import DataConfig
from rlhf_engine.data import prompts
from rlhf_engine.engine import init_distributed, load_tokenizer
from rlhf_engine.errors import ConfigError

SLOW_BUILD_S = 10.0  # > the collective timeout below


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--work", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout_minutes", type=float, default=0.1)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    dist = init_distributed(args.timeout_minutes)
    tok = load_tokenizer(args.tokenizer)
    data = DataConfig(data_path=os.path.join(args.work, "prompts.jsonl"), data_cache_dir=os.path.join(args.work, "c"))
    res = {"rank": dist.rank, "local_rank": int(os.environ["LOCAL_RANK"])}

    build = prompts._build_prompt_data
    if res["local_rank"] == 0:  # this rank's builds are slow: the other rank waits longer than the timeout
        def slow(*a, **k):
            time.sleep(SLOW_BUILD_S)
            return build(*a, **k)

        prompts._build_prompt_data = slow
    t0 = time.time()
    first = prompts.load_prompt_data(data, tok, 200)
    res["first_wait_s"] = time.time() - t0
    prompts._build_prompt_data = build
    second = prompts.load_prompt_data(data, tok, 200)
    plain = prompts.load_prompt_data(dataclasses.replace(data, data_cache_dir="none"), tok, 200)
    res["status"] = [first.cache.status, second.cache.status, plain.cache.status]
    res["equal_to_uncached"] = all(x.train.input_ids == plain.train.input_ids and x.train.texts == plain.train.texts
                                   for x in (first, second))
    res["prompts"] = len(first.train)

    # the ranks disagree (rank 1 has the cache off): nobody uses it, and nobody waits for the other
    split = dataclasses.replace(data, data_cache_dir="none" if dist.rank == 1 else os.path.join(args.work, "c2"))
    res["split_status"] = prompts.load_prompt_data(split, tok, 200).cache.status
    res["split_dir_used"] = os.path.exists(os.path.join(args.work, "c2"))

    bad = dataclasses.replace(data, data_path=os.path.join(args.work, "bad.jsonl"))
    try:
        prompts.load_prompt_data(bad, tok, 200)
        res["bad_error"] = None
    except ConfigError as e:
        res["bad_error"] = str(e)
    x = torch.ones(1)
    torch.distributed.all_reduce(x)  # the default group still works after all of it
    res["all_reduce"] = x.item()
    with open(f"{args.out}.rank{dist.rank}", "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
