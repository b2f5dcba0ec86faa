"""`--dtype auto` (the default of PPO and of steps 1 and 2): resolved once, in the plan, and stored resolved."""
import pytest
import torch
from _support import ppo_args as train_args

from rlhf_engine.cli import parse_args
from rlhf_engine.config import SFTConfig, TrainConfig
from rlhf_engine.engine.preflight import plan_engine, plan_model, resolve_dtype
from rlhf_engine.trainer.state import run_fingerprint, supervised_fingerprint


def test_auto_resolves_by_device(monkeypatch):
    assert resolve_dtype("auto", cuda=False) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", cuda=True) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100
    assert resolve_dtype("auto", cuda=True) == "fp16"
    for explicit in ("fp32", "bf16", "fp16"):  # an explicit dtype is never changed
        assert resolve_dtype(explicit, cuda=True) == resolve_dtype(explicit, cuda=False) == explicit


def test_auto_is_the_default_and_the_plan_holds_the_resolved_dtype(tiny, tmp_path):
    assert TrainConfig().dtype == "auto" and SFTConfig().model.dtype == "auto"
    cfg = parse_args(train_args(tiny, str(tmp_path)))
    assert cfg.dtype == "auto"
    roles = plan_engine(cfg).roles
    assert {r: p.dtype for r, p in roles.items()} == {r: "fp32" for r in roles}  # this machine has no GPU
    fp = run_fingerprint(cfg, roles, 1, 32)
    assert (fp["actor_dtype"], fp["critic_dtype"]) == ("fp32", "fp32")
    # negative control: an explicit dtype and a per-role override reach the plan and the fingerprint as given
    bf = parse_args(train_args(tiny, str(tmp_path), dtype="bf16", critic_dtype="fp32"))
    fp = run_fingerprint(bf, plan_engine(bf).roles, 1, 32)
    assert (fp["actor_dtype"], fp["critic_dtype"]) == ("bf16", "fp32")


@pytest.mark.parametrize("flag, expect", [([], "fp32"), (["--dtype", "bf16"], "bf16")])
def test_supervised_plan_resolves_auto(tiny, flag, expect):
    cfg = parse_args(["--model_name_or_path", tiny.actor, "--data_path", "d.jsonl", *flag], config_cls=SFTConfig)
    model, tok = plan_model(cfg.model, 64)
    assert model.dtype == expect and tok.padding_side == "left"
    assert supervised_fingerprint(cfg, model, 1, 8)["dtype"] == expect


def test_bf16_on_a_cpu_without_bf16_instructions_is_named(caplog, tmp_path):
    """A CPU whose flags hold neither avx512_bf16 nor amx_bf16 runs bf16 matrix products in slow kernels: the plan
    names the roles whose Linear layers take the fp32 kernel (cpu_bf16_matmul, engine/cpu_matmul.py) in one line, and
    warns for those left on the bf16 kernels. Nothing with the instructions, for fp32, or where the flags cannot be
    read."""
    from rlhf_engine.engine.preflight import RolePlan, log_dtypes, read_cpu_flags

    roles = {"actor": RolePlan("a", 2, "bf16", True, "fp32"), "critic": RolePlan("c", 2, "bf16", True, "native"),
             "reward": RolePlan("r", 0, "fp32", False)}
    for flags, named in (({"avx2", "avx512f"}, True), ({"avx512f", "avx512_bf16"}, False),
                         ({"amx_bf16"}, False), (None, False)):
        caplog.clear()
        with caplog.at_level("INFO"):
            log_dtypes(roles, {"actor": "bf16", "critic": "bf16", "reward": "fp32"}, cpu_flags=lambda: flags)
        infos = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert (infos == [] and warnings == []) if not named else (len(infos) == len(warnings) == 1), caplog.text
        if named:
            assert infos[0].startswith("dtype bf16 (actor) on a CPU without bf16 instructions") and "fp32 kernel" in \
                infos[0]
            assert warnings[0].startswith("dtype bf16 (critic) with cpu_bf16_matmul native on a CPU without bf16 "
                                          "instructions")
    caplog.clear()
    with caplog.at_level("INFO"):
        log_dtypes({"reward": roles["reward"]}, {"reward": "fp32"}, cpu_flags=lambda: {"avx2"})
    assert not caplog.text


def test_the_plan_resolves_cpu_bf16_matmul(tiny, tmp_path, monkeypatch):
    """Each role's cpu_bf16_matmul is resolved once, in the plan, from this machine's flags (here made up)."""
    import rlhf_engine.engine.preflight as preflight

    monkeypatch.setattr(preflight, "read_cpu_flags", lambda: {"avx2"})
    cfg = parse_args(train_args(tiny, str(tmp_path), dtype="bf16", critic_dtype="fp32",
                                reward_cpu_bf16_matmul="native"))
    roles = plan_engine(cfg).roles
    assert {r: p.matmul for r, p in roles.items()} == {"actor": "fp32", "reference": "fp32", "critic": "native",
                                                       "reward": "native"}
    monkeypatch.setattr(preflight, "read_cpu_flags", lambda: {"avx2", "avx512_bf16"})
    assert {p.matmul for p in plan_engine(cfg).roles.values()} == {"native"}
    sft = parse_args(["--model_name_or_path", tiny.actor, "--data_path", "d.jsonl", "--dtype", "bf16",
                      "--cpu_bf16_matmul", "fp32"], config_cls=SFTConfig)
    assert plan_model(sft.model, 64)[0].matmul == "fp32"
    with pytest.raises(Exception, match="cpu_bf16_matmul"):
        parse_args(train_args(tiny, str(tmp_path), actor_cpu_bf16_matmul="bf16"))


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    from rlhf_engine.engine.preflight import read_cpu_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16\n")
    assert read_cpu_flags(str(cpuinfo)) == {"fpu", "sse2", "avx2", "amx_bf16"}
    assert read_cpu_flags(str(tmp_path / "missing")) is None
