"""build_ds_config: the DeepSpeed config of each role, and the key checks that catch misspelt DeepSpeed options."""
import json

import pytest

from rlhf_engine.config import BatchConfig, RoleConfig
from rlhf_engine.engine.ds_config import build_ds_config, load_user_config
from rlhf_engine.errors import ConfigError, Problems


def build(role=None, *, stage=2, dtype="fp32", train=True, batch=None, world_size=2, eval_mb=3, user=None):
    return build_ds_config(role or RoleConfig(), stage=stage, dtype=dtype, train=train, batch=batch or BatchConfig(),
                           world_size=world_size, eval_micro_batch_size=eval_mb, user_config=user)


def leaves(d, prefix=""):
    for k, v in d.items():
        if isinstance(v, dict):
            yield from leaves(v, prefix + k + ".")
        else:
            yield prefix + k, v


def test_trained_role_fills_every_template_field():
    role = RoleConfig(learning_rate=3e-5, weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.9, adam_eps=1e-6,
                      gradient_clipping=0.5)
    batch = BatchConfig(per_device_generation_batch_size=4, per_device_training_batch_size=2,
                        gradient_accumulation_steps=3)
    cfg = build(role, stage=2, batch=batch, world_size=4)
    # nothing of the template's "filled ..." placeholders is left
    assert not [k for k, v in leaves(cfg) if isinstance(v, str) and "fill" in v]
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["train_micro_batch_size_per_gpu"] == 2
    assert cfg["gradient_accumulation_steps"] == 3
    assert cfg["train_batch_size"] == 2 * 3 * 4  # micro x accumulation x world
    assert cfg["gradient_clipping"] == 0.5
    opt = cfg["optimizer"]
    assert opt["type"] == "AdamW"
    assert opt["params"]["lr"] == 3e-5 and opt["params"]["betas"] == [0.8, 0.9]
    assert opt["params"]["eps"] == 1e-6 and opt["params"]["weight_decay"] == 0.01
    # CPU: torch's AdamW, so neither fused_adam nor cpu_adam is JIT-compiled
    assert opt["params"]["torch_adam"] is True
    assert "offload_optimizer" not in cfg["zero_optimization"] and "offload_param" not in cfg["zero_optimization"]
    assert "bf16" not in cfg and "fp16" not in cfg


def test_eval_only_role_has_no_optimizer():
    cfg = build(stage=3, train=False, world_size=2, eval_mb=5)
    assert "optimizer" not in cfg
    assert cfg["zero_optimization"]["stage"] == 3
    assert cfg["train_micro_batch_size_per_gpu"] == 5 and cfg["train_batch_size"] == 10
    assert not [k for k, v in leaves(cfg) if isinstance(v, str) and "fill" in v]


@pytest.mark.parametrize("train,stage,offload,offload_params,expect", [
    (True, 2, True, False, {"offload_optimizer"}),
    (True, 3, True, True, {"offload_optimizer", "offload_param"}),
    (True, 3, False, False, set()),
    (False, 3, True, False, {"offload_param"}),  # eval-only: `offload` means the parameters
    (False, 0, True, False, set()),
])
def test_offload_sections(train, stage, offload, offload_params, expect):
    cfg = build(RoleConfig(offload=offload, offload_params=offload_params), stage=stage, train=train)
    zero = cfg["zero_optimization"]
    assert {k for k in ("offload_optimizer", "offload_param") if k in zero} == expect
    for k in expect:
        assert zero[k]["device"] == "cpu"
    if train:
        assert cfg["optimizer"]["params"]["torch_adam"] is True  # also with offload: no cpu_adam build


@pytest.mark.parametrize("dtype,key", [("bf16", "bf16"), ("fp16", "fp16")])
def test_half_precision_flags(dtype, key):
    cfg = build(dtype=dtype)
    assert cfg[key]["enabled"] is True
    assert ({"bf16", "fp16"} - {key}).isdisjoint(cfg)


@pytest.mark.parametrize("train,stage", [(True, 0), (True, 1), (True, 2), (True, 3), (False, 0), (False, 3)])
def test_deepspeed_accepts_every_built_config(train, stage):
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig outside a process group checks the batch arithmetic against world size 1
    cfg = build(RoleConfig(offload=stage >= 2), stage=stage, train=train, world_size=1, dtype="bf16")
    ds = DeepSpeedConfig(cfg)
    assert ds.zero_optimization_stage == stage
    assert ds.train_batch_size == cfg["train_batch_size"]


def test_user_config_merges_over_the_built_one():
    user = {"zero_optimization": {"reduce_bucket_size": 123}, "gradient_clipping": 2.0, "steps_per_print": 7}
    cfg = build(stage=2, user=user)
    assert cfg["zero_optimization"]["reduce_bucket_size"] == 123
    assert cfg["zero_optimization"]["stage"] == 2  # the rest of the section is kept
    assert cfg["zero_optimization"]["contiguous_gradients"] is True
    assert cfg["gradient_clipping"] == 2.0 and cfg["steps_per_print"] == 7


def test_unknown_keys_are_named_with_a_suggestion():
    user = {"gradient_clippping": 1.0, "zero_optimization": {"stagee": 3, "overlap_comm": False}, "bf16": {}}
    with pytest.raises(ConfigError) as ei:
        build(user=user)
    err = ei.value
    assert len(err.problems) == 2  # both found in one error
    msg = str(err)
    assert "gradient_clippping" in msg and 'did you mean "gradient_clipping"' in msg
    assert "zero_optimization.stagee" in msg and 'did you mean "stage"' in msg


def test_load_user_config_reports_bad_files(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"zero_optimization": {"stage3_max_live_parameters": 1000}, "wall_clock_breakdown": True}))
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"trian_batch_size": 8, "zero_optimization": {"offload_optimiser": {"device": "cpu"}}}))
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    p = Problems()
    assert load_user_config(str(good), "actor_ds_config", p) == json.loads(good.read_text())
    assert not p
    for path in (tmp_path / "missing.json", bad_json, typo, array):
        assert load_user_config(str(path), "critic_ds_config", p) is None
    text = "\n".join(map(str, p))
    assert len(p) == 5, text
    assert "no such file" in text and "cannot read it as JSON" in text and "JSON object" in text
    assert 'did you mean "train_batch_size"' in text and 'did you mean "offload_optimizer"' in text
    assert all(x.field.startswith("critic_ds_config") for x in p)
