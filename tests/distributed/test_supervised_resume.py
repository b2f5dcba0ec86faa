"""Checkpoints and resume of steps 1 and 2 (SFT, reward model) on 2 CPU ranks, through the real entry points in one
launch (scripts/entry_points.py):

* SFT at ZeRO 3 (gradient accumulation 2, cosine schedule with warm-up), 12 steps straight with a checkpoint every 4;
  then, in the same launch but as new runs in new folders, the same run resumed from its step-4 checkpoint; the
  negative control resumes it without the data position (the TEST HOOK `SKIP_ON_RESUME`); a resume with another seed
  is refused (exit 2) naming the key.
* The reward model at ZeRO 2, 8 steps straight with a checkpoint every 3, and resumed from step 3.

A resumed run must log the straight run's metrics for its steps and export the same weights (within 1e-6).
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from _support import SCRIPTS, as_flags, check, launch, make_tiny_setup
from rlhf_engine.outputs.metrics import read_metrics

pytestmark = pytest.mark.distributed
ATOL = 1e-6
SFT = dict(zero_stage=3, per_device_training_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
           learning_rate=5e-3, lr_scheduler_type="cosine", num_warmup_steps=2, save_interval=4, keep_last=0, seed=7,
           max_prompt_seq_len=80, max_answer_seq_len=80)
RM = dict(zero_stage=2, per_device_training_batch_size=4, num_train_epochs=2, learning_rate=2e-3, save_interval=3,
          keep_last=0, seed=7, max_prompt_seq_len=80, max_answer_seq_len=80, margin=0.1)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from rlhf_engine.assets import tiny_prompts

    root = tmp_path_factory.mktemp("supervised_resume")
    setup = make_tiny_setup(str(root / "models"), n_prompts=8)
    prompts = tiny_prompts(48, seed=11)
    sft = _jsonl(root / "sft.jsonl", [{"prompt": p, "response": " ".join(reversed(p.split()))} for p in prompts])
    prefs = _jsonl(root / "prefs.jsonl", [{"prompt": p, "chosen": p.split()[0] + " good", "rejected": "bad bad"}
                                          for p in prompts[:32]])
    d = {k: str(root / k) for k in ("sft", "sft_resumed", "sft_nodata", "sft_refused", "rm", "rm_resumed")}
    sft_args = as_flags({"model_name_or_path": setup.actor, "data_path": sft, **SFT})
    rm_args = as_flags({"model_name_or_path": setup.reward, "data_path": prefs, **RM})
    sft_ckpt = os.path.join(d["sft"], "checkpoints", "iter_000004")
    spec = {"runs": [
        ["train_sft.py", sft_args + ["--output_dir", d["sft"]]],
        ["train_sft.py", sft_args + ["--output_dir", d["sft_resumed"], "--resume", sft_ckpt]],
        ["train_sft.py", sft_args + ["--output_dir", d["sft_nodata"], "--resume", sft_ckpt],
         {"skip_on_resume": ["data"]}],
        ["train_sft.py", sft_args + ["--output_dir", d["sft_refused"], "--resume", sft_ckpt, "--seed", "8"],
         {"expect_exit": 2}],
        ["train_reward.py", rm_args + ["--output_dir", d["rm"]]],
        ["train_reward.py", rm_args + ["--output_dir", d["rm_resumed"], "--resume",
                                       os.path.join(d["rm"], "checkpoints", "iter_000003")]],
    ]}
    (root / "spec.json").write_text(json.dumps(spec))
    proc = check(launch(os.path.join(SCRIPTS, "entry_points.py"), ["--spec", str(root / "spec.json")], launcher="fork",
                        timeout=600))
    return dict(dirs=d, stdout=proc.stdout + proc.stderr)


def _metric_diff(a: list, b: list) -> dict:
    assert [r["iteration"] for r in a] == [r["iteration"] for r in b]
    worst = {}
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k, v in x.items():
            if isinstance(v, float) and not k.startswith("time/"):
                worst[k] = max(worst.get(k, 0.0), abs(v - y[k]))
    return worst


def _weight_diff(dir_a: str, dir_b: str) -> float:
    x = load_file(os.path.join(dir_a, "model", "model.safetensors"))
    y = load_file(os.path.join(dir_b, "model", "model.safetensors"))
    assert x.keys() == y.keys()
    return max(float((x[k].float() - y[k].float()).abs().max()) for k in x)


def test_sft_checkpoints_hold_the_engine_and_the_data_position(runs):
    root = os.path.join(runs["dirs"]["sft"], "checkpoints")
    assert sorted(os.listdir(root)) == ["iter_000004", "iter_000008", "iter_000012"]  # every 4 steps, keep_last 0
    meta = json.load(open(os.path.join(root, "iter_000004", "COMPLETE")))
    assert meta["iteration"] == 4 and meta["roles"] == ["model"] and meta["world_size"] == 2
    assert meta["fingerprint"]["zero_stage"] == 3 and meta["fingerprint"]["num_rows"] == 48
    state = torch.load(os.path.join(root, "iter_000004", "state_rank1.pt"), weights_only=True)
    assert set(state["providers"]) == {"trainer", "data", "rng"}
    assert state["providers"]["data"]["epoch"] == 0 and state["providers"]["data"]["batch"] == 4  # mid-epoch (6/epoch)
    assert os.path.isdir(os.path.join(root, "iter_000004", "model"))


def test_sft_resumed_in_a_new_run_equals_the_straight_run(runs):
    d = runs["dirs"]
    straight, resumed = read_metrics(d["sft"]), read_metrics(d["sft_resumed"])
    assert len(straight) == 12 and [r["iteration"] for r in resumed] == list(range(4, 12))
    lrs = [r["sft/lr"] for r in straight]
    assert len(set(lrs)) > 6  # warm-up and cosine decay: the schedule's state matters
    worst = _metric_diff(straight[4:], resumed)
    assert max(worst.values()) <= ATOL, worst
    assert _weight_diff(d["sft"], d["sft_resumed"]) <= ATOL


def test_sft_negative_control_without_the_data_position_differs(runs):
    d = runs["dirs"]
    straight, nodata = read_metrics(d["sft"]), read_metrics(d["sft_nodata"])
    assert [r["iteration"] for r in nodata] == list(range(4, 12))
    assert _metric_diff(straight[4:], nodata)["sft/loss"] > 1e-4
    assert _weight_diff(d["sft"], d["sft_nodata"]) > 1e-4


def test_sft_resume_of_another_run_is_refused(runs):
    assert "this run differs from the checkpoint's in 1 key (seed)" in runs["stdout"]
    assert "seed = 8: the checkpoint's run had seed = 7" in runs["stdout"]
    assert not os.path.exists(os.path.join(runs["dirs"]["sft_refused"], "metrics.jsonl"))


def test_reward_model_resumed_equals_the_straight_run(runs):
    d = runs["dirs"]
    straight, resumed = read_metrics(d["rm"]), read_metrics(d["rm_resumed"])
    assert len(straight) == 8 and [r["iteration"] for r in resumed] == list(range(3, 8))
    worst = _metric_diff(straight[3:], resumed)
    assert max(worst.values()) <= ATOL, worst
    assert _weight_diff(d["rm"], d["rm_resumed"]) <= ATOL
    # every 3 steps and the end (8 is not a multiple of 3)
    assert sorted(os.listdir(os.path.join(d["rm"], "checkpoints"))) == ["iter_000003", "iter_000006", "iter_000008"]
