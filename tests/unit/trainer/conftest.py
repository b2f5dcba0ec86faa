"""Fixtures for in-process trainer tests: a one-rank RLHFEngine on the tiny GPT-2 assets (pad == EOS)."""
import os

import pytest

from _trainer_args import train_args


@pytest.fixture(scope="session")
def other_reference(tiny):
    """A second tiny causal LM (other weights), used as the reference so the KL term is not 0."""
    from rlhf_engine.assets import build_tiny_model

    path = os.path.join(tiny.root, "reference_other")
    if not os.path.isdir(path):
        build_tiny_model(path, tiny.tokenizer, arch="gpt2", dropout=0.1, seed=2)
    return path


@pytest.fixture(scope="module")
def engine1(tiny, other_reference, dist_single, tmp_path_factory):
    """A one-rank RLHFEngine: tiny actor, a different reference, the tiny reward model as reward and critic."""
    from rlhf_engine.cli import parse_args
    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine

    out = str(tmp_path_factory.mktemp("engine1"))
    cfg = parse_args(train_args(tiny, out, reference_model_name_or_path=other_reference, kl_coef=0.1))
    return RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))
