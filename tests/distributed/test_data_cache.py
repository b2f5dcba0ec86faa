"""The tokenized-data cache on 2 ranks of one node (one launch): see scripts/data_cache_checks.py."""
import json
import os

import pytest

from _support import check, launch

from rlhf_engine import assets

pytestmark = pytest.mark.distributed
SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "data_cache_checks.py")


def test_local_rank_0_builds_the_other_rank_reads_and_errors_reach_every_rank(tmp_path):
    tok = assets.train_tiny_tokenizer(str(tmp_path / "tok"), 300)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in assets.tiny_prompts(10)))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"prompt": ""}\n')
    out = str(tmp_path / "res")
    check(launch(SCRIPT, ["--tokenizer", tok, "--work", str(tmp_path), "--out", out], launcher="fork"))
    r0, r1 = (json.loads(open(f"{out}.rank{r}").read()) for r in (0, 1))
    assert (r0["local_rank"], r1["local_rank"]) == (0, 1)
    assert r0["status"] == ["built", "read", "off"]  # local rank 0 built, then read its entry
    assert r1["status"] == ["read", "read", "off"]  # the other rank never tokenized through the cache
    assert r0["equal_to_uncached"] and r1["equal_to_uncached"] and r0["prompts"] == r1["prompts"] == 10
    # rank 1 waited for the slow build (10 s) longer than the job's collective timeout (6 s), without timing out
    assert r1["first_wait_s"] > 6.0
    assert (r0["split_status"], r1["split_status"]) == ("uncacheable", "off") and not r0["split_dir_used"]
    assert r0["bad_error"] and r0["bad_error"] == r1["bad_error"] and "empty prompt" in r0["bad_error"]
    assert r0["all_reduce"] == r1["all_reduce"] == 2.0
