"""Resume on another world size with the same global batch (CPU, gloo, the deepspeed launcher): a checkpoint of 2
ranks resumes on 1 (and 1 on 2, slow), ZeRO's partitioned optimizer state going through DeepSpeed's universal
checkpoints. Right after the load, every trained role's gathered fp32 weights and Adam moments equal the saved ones
exactly (a conversion that resumes as if untrained would fail here), and training continues."""
import os

import pytest
import torch

from _support import SCRIPTS, check, launch, ppo_args

HARNESS = os.path.join(SCRIPTS, "elastic_checks.py")
# 8 prompts per generation step and a PPO mini-batch of 4 over all ranks, whatever the world size
PER_WORLD = {2: dict(per_device_generation_batch_size=4, per_device_training_batch_size=2,
                     gradient_accumulation_steps=1),
             1: dict(per_device_generation_batch_size=8, per_device_training_batch_size=2,
                     gradient_accumulation_steps=2)}
RUN = dict(ppo_epochs=1, seed=13, actor_learning_rate=1e-3, critic_learning_rate=1e-3, export_final="false",
           keep_last=0)


def _elastic(tiny, tmp_path, first: int, second: int, stage: int, dtype: str = "fp32"):
    out = str(tmp_path / "run")
    zero = dict(actor_zero_stage=stage, critic_zero_stage=stage, dtype=dtype)
    saved, loaded = str(tmp_path / "saved.pt"), str(tmp_path / "loaded.pt")
    check(launch(HARNESS, ["--out", saved, "--after", "--", *ppo_args(tiny, out, max_steps=2, **zero, **RUN,
                                                                      **PER_WORLD[first])], nproc=first))
    proc = check(launch(HARNESS, ["--out", loaded, "--", *ppo_args(tiny, out, max_steps=3, resume="auto", **zero,
                                                                    **RUN, **PER_WORLD[second])], nproc=second))
    a, b = torch.load(saved, weights_only=True), torch.load(loaded, weights_only=True)
    assert (a["world_size"], b["world_size"], b["iteration"]) == (first, second, 3)
    for role, parts in a["state"].items():
        for kind, tensors in parts.items():
            got = b["state"][role][kind]
            assert tensors.keys() == got.keys() and tensors, (role, kind)
            for name, t in tensors.items():
                assert torch.equal(t, got[name]), (role, kind, name, float((t - got[name]).abs().max()))
        assert any(float(t.abs().max()) > 0 for t in parts["exp_avg"].values())  # moments worth carrying
    assert f"written by {first} ranks, on {second}" in proc.stdout + proc.stderr
    return out


@pytest.mark.distributed
def test_two_ranks_resume_on_one_at_zero2(tiny, tmp_path):
    out = _elastic(tiny, tmp_path, 2, 1, stage=2)
    assert os.path.isfile(os.path.join(out, "checkpoints", "iter_000002", "universal", "actor.done"))
    assert os.path.isfile(os.path.join(out, "checkpoints", "iter_000003", "COMPLETE"))


@pytest.mark.slow
@pytest.mark.parametrize("first, second, stage, dtype", [(1, 2, 2, "fp32"), (2, 1, 0, "fp32"), (1, 2, 0, "fp32"),
                                                         (2, 1, 3, "fp32"), (1, 2, 3, "fp32"), (2, 1, 0, "bf16")])
def test_other_world_sizes_and_stages(tiny, tmp_path, first, second, stage, dtype):
    _elastic(tiny, tmp_path, first, second, stage, dtype)


@pytest.mark.distributed
def test_a_changed_global_batch_is_refused_naming_the_fields(tiny, tmp_path):
    out = str(tmp_path / "run")
    check(launch(os.path.join(os.path.dirname(SCRIPTS), "..", "..", "launch", "train_ppo.py"),
                 ppo_args(tiny, out, max_steps=1, **RUN, **PER_WORLD[2]), nproc=2))
    proc = launch(os.path.join(os.path.dirname(SCRIPTS), "..", "..", "launch", "train_ppo.py"),
                  ppo_args(tiny, out, max_steps=2, resume="auto", **RUN, **dict(PER_WORLD[1],
                                                                              per_device_generation_batch_size=4)),
                  nproc=1, launcher="python")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "global_generation_batch_size = 4" in proc.stderr and "had global_generation_batch_size = 8" in \
        proc.stderr, proc.stderr[-3000:]
