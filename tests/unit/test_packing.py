"""Packed rows by hand: where each token goes, the mask, the round trip; the sliding window a config declares
(tests/unit/engine/test_packed_forwards.py checks it against what the models do)."""
import torch

from rlhf_engine.packing import pack_rows, padding_fraction, sliding_window


def batch():
    # row 0: 2 prompt pads + 3 real + 1 response pad (4 real); row 1: 6 real; row 2: 2 real
    return torch.tensor([[0, 0, 1, 1, 1, 1, 0],
                         [1, 1, 1, 1, 1, 1, 0],
                         [0, 0, 0, 0, 1, 1, 0]])


def test_first_fit_decreasing_by_hand():
    p = pack_rows(batch())  # width 7: row 1 (6) alone... row 0 (4) + row 2 (2) share a row
    assert p.shape == (2, 7)
    assert p.segment.tolist() == [[1, 1, 1, 1, 1, 1, -1], [0, 0, 0, 0, 2, 2, -1]]
    assert p.slot[0].tolist() == [-1, -1, 7, 8, 9, 10, -1]
    assert p.slot[2].tolist() == [-1, -1, -1, -1, 11, 12, -1]
    assert padding_fraction(batch()) == 1 - 12 / 21 and padding_fraction(batch(), p) == 1 - 12 / 14


def test_take_unpack_round_trip_and_restarting_positions():
    m = batch()
    pos = (m.cumsum(-1) - 1).clamp(min=0)
    p = pack_rows(m)
    assert p.take(pos).tolist() == [[0, 1, 2, 3, 4, 5, 0], [0, 1, 2, 3, 0, 1, 0]]
    x = torch.arange(21.0).view(3, 7) + 1
    back = p.unpack(p.take(x)[..., None])[..., 0]
    assert torch.equal(back, torch.where(m.bool(), x, 0.0))


def test_attention_bias_is_block_diagonal_causal():
    p = pack_rows(batch())
    allowed = p.attention_bias(torch.float32)[1, 0] == 0
    # packed row 1 holds sequence 0 in slots 0-3 and sequence 2 in slots 4-5; slot 6 is empty
    assert allowed[3].tolist() == [True, True, True, True, False, False, False]
    assert allowed[5].tolist() == [False, False, False, False, True, True, False]
    assert allowed[6].tolist() == [False] * 6 + [True]  # an empty slot sees itself only: no NaN row
    assert p.attention_bias(torch.bfloat16).dtype == torch.bfloat16


def test_same_rows_same_packing():
    m = (torch.rand(16, 30, generator=torch.Generator().manual_seed(0)) > 0.3).long().sort(-1).values
    a, b = pack_rows(m), pack_rows(m.clone())
    assert torch.equal(a.slot, b.slot) and torch.equal(a.segment, b.segment)


def test_sliding_window_of_a_multimodal_config_is_its_text_models():
    """Gemma 3's window lives in its text config; a config without one (GPT-2) or with a null one has none."""
    from transformers import Gemma3Config, Gemma3TextConfig, GPT2Config, MistralConfig

    text = Gemma3TextConfig(sliding_window=24, num_hidden_layers=2)  # both layers slide (5 of every 6 do)
    assert sliding_window(text) == 24
    assert sliding_window(Gemma3Config(text_config=text.to_dict())) == 24
    assert sliding_window(GPT2Config()) is None and sliding_window(MistralConfig(sliding_window=None)) is None
