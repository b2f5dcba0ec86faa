"""The one reader of a model config's position limit (engine start-up checks, the packing probe, reward inputs)."""
from transformers import GPT2Config, LlamaConfig, OPTConfig

from rlhf_engine.hf_fields import max_positions


def test_each_architecture_s_name_for_its_positions_is_read():
    assert max_positions(GPT2Config(n_positions=96)) == 96
    assert max_positions(LlamaConfig(max_position_embeddings=300)) == 300
    assert max_positions(OPTConfig(max_position_embeddings=2048)) == 2048
    assert max_positions(type("Bare", (), {"seq_length": 7})()) == 7


def test_no_limit_or_a_meaningless_one_is_none():
    assert max_positions(object()) is None
    assert max_positions(type("Zero", (), {"max_position_embeddings": 0, "n_positions": None})()) is None
