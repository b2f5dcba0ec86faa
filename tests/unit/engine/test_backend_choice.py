"""`--generation_backend auto` (engine/generation/choice.py): what it stands for and why, read from the environment,
the sampling settings and vLLM's own answer for the actor. Here (the default suite's environment, without vLLM) it
is lean; in the vLLM job (tests marked vllm) vllm for the tiny Llama and lean where vLLM cannot serve the run."""
import importlib.util
import shutil

import pytest

from rlhf_engine.cli import parse_args
from rlhf_engine.engine.generation.choice import choose_backend

from _support import ppo_args

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _cfg(tiny, tmp_path, **flags):
    return parse_args(ppo_args(tiny, str(tmp_path), **flags))


@pytest.mark.skipif(HAS_VLLM, reason="checks the environment without vLLM (the default suite's)")
def test_without_vllm_auto_is_lean_and_says_why(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path)
    assert cfg.engine.generation_backend == "lean"
    assert cfg.engine.generation_backend_auto == "auto chose lean: vLLM is not installed in this environment"
    assert cfg.ppo.rollout_correction == "none"  # lean's defaults, not vllm's


def test_an_explicit_backend_is_kept(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path, generation_backend="hf")
    assert cfg.engine.generation_backend == "hf" and cfg.engine.generation_backend_auto == ""


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here (bash scripts/install.sh --vllm)")
def test_with_vllm_auto_is_vllm_where_it_serves_the_run(tiny, tiny_vllm, tmp_path):
    cfg = _cfg(tiny_vllm, tmp_path)
    assert cfg.engine.generation_backend == "vllm", cfg.engine.generation_backend_auto
    assert cfg.engine.generation_backend_auto.startswith("auto chose vllm: vLLM ")
    assert cfg.ppo.rollout_correction == "token_truncate"  # vllm's default follows the choice
    # where vLLM cannot serve the run: lean, naming why
    gpt2 = _cfg(tiny, tmp_path / "gpt2")  # head size 16: vLLM's CPU attention refuses it
    assert gpt2.engine.generation_backend == "lean" and "head size" in gpt2.engine.generation_backend_auto
    broken = shutil.copytree(tiny_vllm.actor, tmp_path / "no_config")
    (broken / "config.json").unlink()
    backend, why = choose_backend(_cfg(tiny_vllm, tmp_path / "b", generation_backend="lean",
                                       actor_model_name_or_path=str(broken)))
    assert backend == "lean" and why.startswith("the actor's config could not be read"), why
