"""The critic-free estimators and the DAPO / aggregation pieces against numbers computed by hand."""
import math

import pytest
import torch

from rlhf_engine import estimators
from rlhf_engine.estimators import group_advantages, reinforce_pp_advantages, uniform_groups
from rlhf_engine.ppo_math import kl_loss, loss_token_weights, policy_loss
from rlhf_engine.trainer.reward_shaping import overlong_penalty

# two groups of uneven sizes, not sorted by group: A = rows 0, 2, 4 (scores 1, 2, 3), B = rows 1, 3 (a tie: 5, 5);
# uneven response lengths 3, 1, 2, 3, 1
SCORES = torch.tensor([1.0, 5.0, 2.0, 5.0, 3.0])
GROUPS = torch.tensor([0, 1, 0, 1, 0])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])


def _per_row(adv):
    """Every real token of a row holds its sequence's value; padding is 0."""
    assert torch.equal(adv * (1 - MASK), torch.zeros_like(adv))
    vals = [adv[i, MASK[i].bool()] for i in range(len(adv))]
    assert all(torch.equal(v, v[:1].expand_as(v)) for v in vals)
    return [float(v[0]) for v in vals]


def test_grpo_dr_grpo_rloo_by_hand():
    # A: mean 2, unbiased std 1 (squares 1 + 0 + 1 over n - 1 = 2); B: std 0 -> 0 / eps = 0
    assert _per_row(group_advantages(SCORES, GROUPS, MASK, "grpo")) == pytest.approx(
        [-1 / (1 + 1e-6), 0.0, 0.0, 0.0, 1 / (1 + 1e-6)], abs=1e-7)
    assert _per_row(group_advantages(SCORES, GROUPS, MASK, "dr_grpo")) == pytest.approx([-1, 0, 0, 0, 1], abs=1e-7)
    # leave one out: 1 - (2 + 3) / 2, 2 - (1 + 3) / 2, 3 - (1 + 2) / 2; B: 5 - 5
    assert _per_row(group_advantages(SCORES, GROUPS, MASK, "rloo")) == pytest.approx([-1.5, 0, 0, 0, 1.5], abs=1e-7)


def test_reinforce_pp_baseline_whitens_the_centred_tokens():
    adv = group_advantages(SCORES, GROUPS, MASK, "reinforce_pp_baseline")
    # centred values per token: row 0: -1 x3, row 1: 0, row 2: 0 x2, row 3: 0 x3, row 4: 1 -> 10 tokens
    tokens = [-1.0] * 3 + [0.0] + [0.0] * 2 + [0.0] * 3 + [1.0]
    mean = sum(tokens) / 10  # -0.2
    var = sum((t - mean) ** 2 for t in tokens) / 9
    want = [(-1 - mean) / math.sqrt(var + 1e-8), (0 - mean) / math.sqrt(var + 1e-8)]
    assert _per_row(adv) == pytest.approx([want[0], want[1], want[1], want[1], (1 - mean) / math.sqrt(var + 1e-8)],
                                          abs=1e-6)


def test_reinforce_pp_discounted_returns_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 1.0, 7.0]])  # row 1's 7.0 sits on padding: ignored
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # row 0: 1 at t2, 0.5 at t1, 0.25 at t0; row 1: 1 at t1, 0.5 + 0.5 = 1 at t0
    assert torch.allclose(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 1.0, 0.0]]))
    vals = [0.25, 0.5, 1.0, 1.0, 1.0]
    mean = sum(vals) / 5
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / 4 + 1e-8)
    assert torch.allclose(adv, torch.tensor([[(0.25 - mean) / sd, (0.5 - mean) / sd, (1 - mean) / sd],
                                             [(1 - mean) / sd, (1 - mean) / sd, 0.0]]), atol=1e-6)


def test_global_statistics_and_the_per_rank_negative_control():
    """Two 'ranks' holding halves of the batch: local whitening differs from the full batch's; whitening with the
    full batch's statistics (what the trainer all-reduces) reproduces it exactly."""
    rewards = torch.tensor([[0.0, 1.0], [2.0, 0.0], [0.0, -3.0], [0.5, 0.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    full, _ = reinforce_pp_advantages(rewards, mask, gamma=1.0)
    halves = [slice(0, 2), slice(2, 4)]
    local = torch.cat([reinforce_pp_advantages(rewards[h], mask[h], 1.0)[0] for h in halves])
    assert (local - full).abs().max() > 0.1  # the negative control: per-rank statistics give other advantages
    _, ret = reinforce_pp_advantages(rewards, mask, 1.0)
    m = mask.bool()
    mean, var = ret[m].mean(), ret[m].var(unbiased=True)
    shared = torch.cat([reinforce_pp_advantages(rewards[h], mask[h], 1.0, mean=mean, var=var)[0] for h in halves])
    assert torch.allclose(shared, full, atol=1e-6)


def test_registry_entries_use_the_summed_per_token_rewards():
    rewards = torch.tensor([[0.0, -0.1, 1.0], [0.2, 0.0, 0.0], [0.0, 0.0, 0.0], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    groups = torch.tensor([0, 0, 1, 1])
    adv, ret = estimators.get("dr_grpo").fn(rewards=rewards, action_mask=mask, group_ids=groups, gamma=1.0, lam=1.0,
                                            values=None, scores=torch.zeros(4))
    # returns 0.9, 0.2 (mean 0.55), 0, 3 (mean 1.5)
    assert ret is None and torch.allclose(adv[:, 0], torch.tensor([0.35, -0.35, -1.5, 1.5]), atol=1e-6)
    assert not any(e.needs_critic for n, e in estimators.ESTIMATORS.items() if n != "gae")
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(SCORES, torch.arange(5), MASK, "grpo")


def test_uniform_groups():
    assert uniform_groups(SCORES, GROUPS).tolist() == [False, True, False, True, False]


def test_clip_higher_by_hand():
    lp, old = torch.tensor([[math.log(1.3)]]), torch.zeros(1, 1)
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    loss, _ = policy_loss(lp, old, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-6)  # max(-1.3, -1.2): the clipped term
    loss_hi, _ = policy_loss(lp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert loss_hi.item() == pytest.approx(-1.28, abs=1e-6)
    low, _ = policy_loss(torch.tensor([[math.log(0.7)]]), old, -adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert low.item() == pytest.approx(0.8, abs=1e-6)  # the lower bound is still 1 - clip_eps: max(0.7, 0.8)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_gradients_by_hand(estimator):
    d = torch.tensor([[0.5, -0.25, 2.0]])
    lp = d.clone().requires_grad_(True)
    ref, mask = torch.zeros(1, 3), torch.tensor([[1, 1, 0]])
    w = loss_token_weights(mask, "token_mean", 2, 1, 3)
    loss, _ = kl_loss(lp, ref, mask, estimator, w)
    loss.backward()
    dv = d[0, :2]
    value = {"k1": dv, "k2": dv ** 2 / 2, "k3": torch.exp(-dv) - 1 + dv}[estimator]
    grad = {"k1": torch.ones(2), "k2": dv, "k3": 1 - torch.exp(-dv)}[estimator]
    assert loss.item() == pytest.approx(value.sum().item() / 2, abs=1e-6)
    assert torch.allclose(lp.grad[0], torch.cat([grad / 2, torch.zeros(1)]), atol=1e-6)  # padding: no gradient


@pytest.mark.parametrize("junk", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_ignores_junk_at_padding(estimator, junk):
    """Non-finite log-probs at padding give the same loss and gradient as zeros there (negative control: the
    estimator evaluated before masking, as before the fix, gives a NaN gradient under k3 / k2)."""
    mask, ref = torch.tensor([[1, 1, 0]]), torch.zeros(1, 3)
    w = loss_token_weights(mask, "token_mean", 2, 1, 3)
    clean = torch.tensor([[0.5, -0.25, 0.0]], requires_grad=True)
    dirty = torch.tensor([[0.5, -0.25, junk]], requires_grad=True)
    (l_clean, _), (l_dirty, _) = kl_loss(clean, ref, mask, estimator, w), kl_loss(dirty, ref, mask, estimator, w)
    l_clean.backward()
    l_dirty.backward()
    assert l_dirty.item() == l_clean.item() and torch.equal(dirty.grad, clean.grad)
    assert dirty.grad[0, 2] == 0.0
    if (estimator, math.isnan(junk)) in (("k2", True), ("k3", True)) or (estimator, junk) == ("k3", -math.inf):
        # the old order, by hand: the estimator's derivative at the junk (NaN, or k3's exp(inf)) times a zero
        late = dirty.detach().clone().requires_grad_(True)
        d = late - ref
        k = {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) - 1 + d}[estimator]
        torch.where(mask.bool(), k * w, 0.0).sum().backward()
        assert not bool(torch.isfinite(late.grad).all())


def test_aggregation_modes_on_a_ragged_batch_and_any_split():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    tokens, seqs = 6, 3
    w = {m: loss_token_weights(mask, m, tokens, seqs, max_len=4) for m in
         ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")}
    assert torch.allclose(w["token_mean"], mask / 6)
    assert torch.allclose(w["seq_mean_token_mean"], torch.tensor([[1 / 9] * 3, [1 / 3, 0, 0], [1 / 6, 1 / 6, 0]]))
    assert torch.allclose(w["seq_mean_token_sum_norm"], mask / 12)
    terms = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [5.0, 6.0, 9.0]])
    for mode, weights in w.items():  # micro-batches of 1 and 2 rows with the global counts give the same loss
        whole = (terms * weights).sum()
        parts = sum((terms[s] * loss_token_weights(mask[s], mode, tokens, seqs, 4)).sum()
                    for s in (slice(0, 1), slice(1, 3)))
        assert parts.item() == pytest.approx(whole.item(), abs=1e-6), mode
    # seq_mean_token_mean by hand: (mean(1,2,3) + 4 + mean(5,6)) / 3
    assert (terms * w["seq_mean_token_mean"]).sum().item() == pytest.approx((2 + 4 + 5.5) / 3, abs=1e-6)


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([3, 4, 5, 8])
    assert overlong_penalty(lengths, max_len=8, buffer_len=4, factor=2.0).tolist() == [0.0, 0.0, -0.5, -2.0]
    assert overlong_penalty(lengths, max_len=8, buffer_len=0, factor=2.0).tolist() == [0.0] * 4
