"""The lean backend's token selection (engine/generation/sampling.py): exact frequencies, masked tokens never drawn,
log-probs equal to log_softmax, the min_new_tokens stop mask."""
import math

import torch

from rlhf_engine.engine.generation.sampling import greedy_from_scores, sample_from_scores, step_scores
from rlhf_engine.ppo_math import STOP_MASK_VALUE

N = 40_000


def _frequencies(scores: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens, _ = sample_from_scores(scores.expand(N, -1).contiguous(), generator=g)
    return torch.bincount(tokens, minlength=scores.shape[-1]).double() / N


def test_frequencies_match_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    freq = _frequencies(probs.log()[None])
    # 5 binomial standard deviations of N draws: a sampler off by 2% of the mass fails
    bound = 5 * torch.sqrt(probs.double() * (1 - probs.double()) / N)
    assert bool(((freq - probs.double()).abs() <= bound).all()), (freq, probs)


def test_negative_control_a_tempered_distribution_is_detected():
    """The same check against softmax(scores / 0.8) fails: the tolerance can tell the two apart."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    freq = _frequencies((probs.log() / 0.8)[None])
    bound = 5 * torch.sqrt(probs.double() * (1 - probs.double()) / N)
    assert not bool(((freq - probs.double()).abs() <= bound).all())


def test_masked_tokens_are_never_drawn_and_log_probs_are_log_softmax():
    scores = torch.randn(64, 300, generator=torch.Generator().manual_seed(1)) * 4
    scores[:, ::3] = float("-inf")  # zero mass
    scores[:, 1] = STOP_MASK_VALUE  # the stop mask: exp underflows to exactly 0
    tokens, lp = sample_from_scores(scores, generator=torch.Generator().manual_seed(2))
    assert bool((tokens % 3 != 0).all()) and bool((tokens != 1).all())
    expected = torch.log_softmax(scores, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(lp, expected, atol=1e-5, rtol=0), (lp - expected).abs().max()


def test_a_one_hot_distribution_always_gives_its_token():
    scores = torch.full((16, 50), -30.0)
    scores[:, 7] = 30.0
    tokens, lp = sample_from_scores(scores)
    assert tokens.tolist() == [7] * 16 and float(lp.abs().max()) < 1e-6


def test_greedy_takes_the_argmax_with_its_log_prob():
    scores = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    tokens, lp = greedy_from_scores(scores)
    assert tokens.tolist() == [1, 0]
    assert abs(float(lp[0]) - (2.0 - math.log(1 + math.e ** 2 + math.e))) < 1e-6


def test_step_scores_mask_stops_before_min_new_tokens_and_divide_by_temperature():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.bfloat16)
    stop = torch.tensor([3])
    early = step_scores(logits, 1, stop, 2, 0.5)
    assert early.dtype == torch.float32 and early[0].tolist() == [2.0, 4.0, 6.0, STOP_MASK_VALUE / 0.5]
    late = step_scores(logits, 2, stop, 2, 1.0)
    assert late[0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert logits[0, 3] == 4.0  # the model's logits are not modified
