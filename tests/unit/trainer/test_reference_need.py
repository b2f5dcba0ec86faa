"""No reference where nothing reads it (kl_coef 0, kl_loss_coef 0, no adaptive_kl, no --monitor_reference_kl): the
config's roles, the refusal of reference settings that would do nothing, the plan's line of forwards, and a run on one
in-process rank: no reference engine and no objective/kl, and every other metric and weight equal to the same run
with the monitor on (the reference only ever fed the monitor)."""
import pytest
import torch
from _trainer_args import train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.plan import forwards_summary

from _support import VOLATILE

FLAGS = dict(advantage_estimator="grpo", per_device_generation_batch_size=4, n_samples_per_prompt=2,
             per_device_training_batch_size=4, gradient_accumulation_steps=1, ppo_epochs=1, seed=3,
             export_final="false", actor_learning_rate=1e-3)
NO_KL = dict(kl_coef=0.0, kl_loss_coef=0.0)


@pytest.mark.parametrize("flags, has_reference", [
    (NO_KL, False),
    ({**NO_KL, "monitor_reference_kl": "true"}, True),
    ({"kl_coef": 0.05, "kl_loss_coef": 0.0}, True),
    ({"kl_coef": 0.0, "kl_loss_coef": 0.01}, True),
    ({**NO_KL, "adaptive_kl": "true"}, True),
    ({}, True),  # grpo's defaults: kl_loss_coef 0.001 (config.ppo GROUP_KL_IN_LOSS)
])
def test_the_reference_is_a_role_only_where_something_reads_it(tiny, tmp_path, flags, has_reference):
    cfg = parse_args(train_args(tiny, str(tmp_path), **{**FLAGS, **flags}))
    assert ("reference" in cfg.active_roles) == has_reference, (flags, cfg.active_roles)
    assert cfg.active_roles[0] == "actor" and "critic" not in cfg.active_roles


def test_reference_settings_without_a_reader_are_refused_by_name(tiny, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(train_args(tiny, str(tmp_path), reference_model_name_or_path=tiny.actor, **FLAGS, **NO_KL))
    msg = str(e.value)
    assert "reference_model_name_or_path" in msg and "nothing reads it" in msg and "--monitor_reference_kl" in msg
    # the same settings with a reader are accepted
    parse_args(train_args(tiny, str(tmp_path), reference_model_name_or_path=tiny.actor, monitor_reference_kl="true",
                          **FLAGS, **NO_KL))


def test_the_plan_names_each_forward_and_why(tiny, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), **FLAGS, **NO_KL))
    line = forwards_summary(cfg, dict.fromkeys(cfg.active_roles), "lean")
    assert line.startswith("forwards per iteration: generation on generation_backend lean; actor experience forward")
    assert "no reference (kl_coef 0, kl_loss_coef 0: nothing reads it" in line
    assert "no critic (grpo needs none)" in line and "reward model forward (the scores)" in line
    cfg = parse_args(train_args(tiny, str(tmp_path), **{**FLAGS, "kl_coef": 0.05, "kl_loss_coef": 0.01}))
    line = forwards_summary(cfg, dict.fromkeys(cfg.active_roles), "lean")
    assert ("reference forward (kl_coef 0.05: the reward's KL penalty, kl_loss_coef 0.01: the KL loss, "
            "objective/kl)") in line


def _run(tiny, out, **flags):
    # every old log-prob from the experience forward in both runs (the monitor's reference would otherwise turn
    # old_logprobs_from_update off in one of them only): the reference is then the only difference
    trainer = build_trainer(parse_args(train_args(tiny, str(out), max_steps=2, old_logprobs_from_update="false",
                                                  **FLAGS, **NO_KL, **flags)))
    try:
        recs = [trainer.step() for _ in range(2)]
        weights = {k: v.clone() for k, v in trainer.engine.actor.module.state_dict().items()}
        return trainer, recs, weights
    finally:
        trainer.metrics.close()


def test_no_reference_is_built_and_the_run_equals_the_monitored_one(tiny, dist_single, tmp_path):
    lean, lean_recs, lean_w = _run(tiny, tmp_path / "lean")
    assert not lean.engine.has_reference and "reference" not in lean.engine.engines
    assert not (tmp_path / "lean" / "ds_config_reference.json").exists()
    assert lean.last_experience.ref_logprobs is None
    assert all("objective/kl" not in r for r in lean_recs)
    with pytest.raises(RuntimeError, match="no reference"):
        lean.engine.ref_logprobs(lean.last_experience.rollout)

    seen, seen_recs, seen_w = _run(tiny, tmp_path / "seen", monitor_reference_kl="true")
    assert "reference" in seen.engine.engines
    kls = [r["objective/kl"] for r in seen_recs]
    assert kls[0] == 0.0 and kls[1] != 0.0  # the reference is the initial actor; lr > 0 moved the actor after step 1
    for a, b in zip(lean_recs, seen_recs):  # the same keys but objective/kl, the same values: the monitor's only
        stable = {k for k in b if not k.startswith(VOLATILE)} - {"objective/kl"}
        assert {k for k in a if not k.startswith(VOLATILE)} == stable
        assert {k: a[k] for k in stable} == {k: b[k] for k in stable}
    assert lean_recs[0]["objective/score"] != lean_recs[1]["objective/score"]  # the records are not all alike
    assert lean_w.keys() == seen_w.keys() and all(torch.equal(lean_w[k], seen_w[k]) for k in lean_w)
