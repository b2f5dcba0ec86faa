"""Unit tests for rlhf_engine.ppo_math: every expected number is worked out by hand in a comment next to it.

Negative controls recompute a plausible wrong variant (DeepSpeed-Chat's reward placement, a flipped advantage sign,
averaging per-shard means, ...) and show it gives a different number, so the assertions can actually fail.
"""
import math

import pytest
import torch

from rlhf_engine import logit_kernels
from rlhf_engine.ppo_math import (
    AdaptiveKLController,
    FixedKLController,
    compute_gae,
    compute_rewards,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    masked_whiten,
    policy_loss,
    value_loss,
)

ATOL = 1e-6


def close(actual, expected, atol=ATOL):
    """assert_close against literal numbers (fp32, rtol 0)."""
    expected = torch.as_tensor(expected, dtype=torch.float32)
    assert actual.dtype == torch.float32, actual.dtype
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0.0)


def not_close(a, b, margin):
    return (torch.as_tensor(a, dtype=torch.float32) - torch.as_tensor(b, dtype=torch.float32)).abs().max() > margin


# ----------------------------------------------------------------------------------------------------------------------
# log-probs and entropy
# ----------------------------------------------------------------------------------------------------------------------


class TestLogprobs:
    def test_hand_values(self):
        # logits = log([1, 2, 3]) -> softmax = [1, 2, 3] / 6; label 2 -> log(3/6) = -0.693147, label 0 -> log(1/6)
        logits = torch.log(torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]))
        out = logprobs_from_logits(logits, torch.tensor([2, 0]))
        close(out, [-0.6931472, -1.7917595])

    def test_temperature_divides_logits(self):
        # [0, 2 ln 2] / T=2 -> [0, ln 2] -> softmax [1/3, 2/3]; label 1 -> ln(2/3) = -0.405465
        logits = torch.tensor([0.0, 2 * math.log(2.0)])
        close(logprobs_from_logits(logits, torch.tensor(1), temperature=2.0), -0.4054651)
        # negative control: without the temperature, softmax [1/5, 4/5] -> ln(4/5) = -0.223144
        assert not_close(logprobs_from_logits(logits, torch.tensor(1)), -0.4054651, 0.1)

    def test_bf16_input_is_computed_in_fp32(self):
        # logits [8, 0] (exact in bf16), label 1: -log(1 + e^8) = -8.000335406. A bf16 computation would round to -8.0
        # (bf16 spacing at 8 is 0.0625), missing the 3.35e-4 part.
        logits = torch.tensor([[8.0, 0.0]], dtype=torch.bfloat16)
        out = logprobs_from_logits(logits, torch.tensor([1]))
        assert out.dtype == torch.float32
        close(out, [-8.000335406])
        bf16_math = torch.log_softmax(logits, -1)[0, 1].float()
        assert abs(bf16_math.item() + 8.000335406) > 1e-4  # the bf16 variant really is off

    def test_chunked_equals_unchunked_formula_with_grad(self):
        torch.manual_seed(0)
        full = torch.randn(3, 6, 11, requires_grad=True)
        logits = full[:, :-1]  # non-contiguous slice, as in logits[:, :-1] vs input_ids[:, 1:]
        labels = torch.randint(0, 11, (3, 5))
        chunked = logprobs_from_logits(logits, labels, temperature=0.7, chunk_rows=2)  # 5 rows/block -> 2+2+1
        naive = torch.log_softmax(logits / 0.7, -1).gather(-1, labels[..., None]).squeeze(-1)
        close(chunked, naive.detach())
        g_chunked, = torch.autograd.grad(chunked.sum(), full)
        g_naive, = torch.autograd.grad(naive.sum(), full)
        close(g_chunked, g_naive)

    def test_default_chunking_uses_module_constant(self, monkeypatch):
        # LOGITS_CHUNK_NUMEL = 3 * V forces 3-row chunks on 20 rows; no_grad path
        torch.manual_seed(1)
        logits = torch.randn(4, 5, 7)
        labels = torch.randint(0, 7, (4, 5))
        monkeypatch.setattr(logit_kernels, "LOGITS_CHUNK_NUMEL", 3 * 7)
        out = logprobs_from_logits(logits, labels)
        close(out, torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1))

    def test_bf16_gradient_has_input_dtype(self):
        logits = torch.zeros(2, 4, dtype=torch.bfloat16, requires_grad=True)
        logprobs_from_logits(logits, torch.tensor([0, 3]), chunk_rows=1).sum().backward()
        # d log p_label / d logit_j = onehot_j - p_j = onehot - 1/4
        assert logits.grad.dtype == torch.bfloat16
        close(logits.grad.float(), [[0.75, -0.25, -0.25, -0.25], [-0.25, -0.25, -0.25, 0.75]])


class TestEntropy:
    def test_uniform_is_log_v(self):
        out = entropy_from_logits(torch.zeros(2, 3, 7), temperature=1.3, chunk_rows=4)
        close(out, torch.full((2, 3), 1.9459101))  # ln 7

    def test_hand_value_and_neg_inf_logit(self):
        # [0, ln 3] -> p = [1/4, 3/4]; H = 1/4 ln 4 + 3/4 ln(4/3) = ln 4 - 3/4 ln 3 = 0.5623351
        # [0, 0, -inf] -> p = [1/2, 1/2, 0]; H = ln 2 (0 log 0 = 0, no NaN)
        logits = torch.tensor([[0.0, math.log(3.0), -math.inf], [0.0, 0.0, -math.inf]])
        close(entropy_from_logits(logits), [0.5623351, 0.6931472])

    def test_chunked_gradient_matches_autograd(self):
        torch.manual_seed(0)
        logits = torch.randn(9, 13, requires_grad=True)
        ent = entropy_from_logits(logits, temperature=0.8, chunk_rows=4)
        logp = torch.log_softmax(logits / 0.8, -1)
        naive = -(logp.exp() * logp).sum(-1)
        close(ent, naive.detach())
        g1, = torch.autograd.grad(ent.sum(), logits)
        g2, = torch.autograd.grad(naive.sum(), logits)
        close(g1, g2)


# ----------------------------------------------------------------------------------------------------------------------
# masked statistics
# ----------------------------------------------------------------------------------------------------------------------


class TestMaskedStats:
    # masked elements: 1, 2, 4 (the NaN and the rest are padding junk)
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])

    def test_empty_mask_gives_zero_not_nan(self):
        empty = torch.zeros(2, 3)
        close(masked_whiten(self.values, empty), torch.zeros(2, 3))

    def test_whiten(self):
        # (x - 7/3) / sqrt(7/3): -4/3/1.5275252 = -0.8728716, -1/3/1.5275252 = -0.2182179, 5/3/1.5275252 = 1.0910895
        out = masked_whiten(self.values, self.mask)
        close(out, [[-0.8728716, -0.2182179, 0.0], [1.0910895, 0.0, 0.0]])
        # shift_mean=False adds 7/3 back on masked positions only
        close(masked_whiten(self.values, self.mask, shift_mean=False),
              [[-0.8728716 + 2.3333333, -0.2182179 + 2.3333333, 0.0], [1.0910895 + 2.3333333, 0.0, 0.0]])
        # negative control: whitening with the biased variance (14/9) gives -4/3/1.2472191 = -1.0690450 instead
        assert not_close(out[0, 0], (1 - 7 / 3) / math.sqrt(14 / 9), 0.1)

    def test_whiten_with_precomputed_global_stats(self):
        # mean 2, var 4 -> (x - 2) / 2: 1 -> -0.5, 2 -> 0, 4 -> 1
        out = masked_whiten(self.values, self.mask, mean=torch.tensor(2.0), var=4.0)
        close(out, [[-0.5, 0.0, 0.0], [1.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------------------------------------------------
# KL estimators and rewards
# ----------------------------------------------------------------------------------------------------------------------


class TestKLPenalty:
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])  # log r = lp - ref = [0.5, -1.0]

    def test_k1_k2_k3(self):
        close(kl_penalty(self.lp, self.ref, estimator="k1"), [[0.5, -1.0]])
        close(kl_penalty(self.lp, self.ref, estimator="k2"), [[0.125, 0.5]])  # 0.5 * [0.25, 1]
        # k3 with d = ref - lp = [-0.5, 1]: e^d - 1 - d = [0.6065307 - 0.5, 2.7182818 - 2] = [0.1065307, 0.7182818]
        close(kl_penalty(self.lp, self.ref, estimator="k3"), [[0.1065307, 0.7182818]])
        # negative control: k3 with the log-ratio sign flipped (e^{log r} - 1 - log r) = [0.1487213, 0.3678794]
        assert not_close(kl_penalty(self.ref, self.lp, estimator="k3"), [[0.1065307, 0.7182818]], 0.04)

    def test_bf16_inputs_give_fp32(self):
        out = kl_penalty(self.lp.bfloat16(), self.ref.bfloat16(), estimator="k2")
        close(out, [[0.125, 0.5]])


class TestRewards:
    def test_hand_example_kl_part_and_score_on_last_real_token(self):
        # mask 1 1 1 1 0 0; log r = lp - ref = [0.5, 0, -0.5, 0, junk, junk]; kl_coef 0.1 -> -0.1 * log r =
        # [-0.05, 0, 0.05, 0]; score 2.5 (inside the clip 5) is added at t = 4 - 1 = 3.
        lp = torch.tensor([[-1.0, -1.0, -1.0, -1.0, 80.0, -3.0]])
        ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0, -90.0, 7.0]])
        mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
        rewards, kl = compute_rewards(lp, ref, torch.tensor([2.5]), mask, kl_coef=0.1, reward_clip=5.0)
        close(kl, [[0.5, 0.0, -0.5, 0.0, 0.0, 0.0]])
        close(rewards, [[-0.05, 0.0, 0.05, 2.5, 0.0, 0.0]])
        # k3 at padding must not overflow (junk log r = 170 there): still exactly 0
        rewards3, kl3 = compute_rewards(lp, ref, torch.tensor([2.5]), mask, kl_coef=0.1, reward_clip=5.0,
                                        kl_estimator="k3")
        assert torch.isfinite(rewards3).all() and (kl3[0, 4:] == 0).all()

    def test_without_a_reference_the_kl_is_zero_and_only_the_clipped_score_remains(self):
        # no reference (a run without a KL term): kl 0 everywhere; the score 7 clipped to 5 lands on t = 3 - 1 = 2
        lp = torch.tensor([[-1.0, -2.0, -3.0, 9.0]])
        mask = torch.tensor([[1, 1, 1, 0]])
        rewards, kl = compute_rewards(lp, None, torch.tensor([7.0]), mask, kl_coef=0.0, reward_clip=5.0,
                                      kl_estimator="k3")
        assert torch.equal(kl, torch.zeros(1, 4))
        close(rewards, [[0.0, 0.0, 5.0, 0.0]])
        # a KL penalty cannot be paid without reference log-probs
        with pytest.raises(ValueError, match="kl_coef: 0.1 needs reference log-probs"):
            compute_rewards(lp, None, torch.tensor([7.0]), mask, kl_coef=0.1, reward_clip=5.0)

    def test_score_clipping(self):
        # scores 7 and -9 clipped to +5 and -5
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        zeros = torch.zeros(2, 3)
        rewards, _ = compute_rewards(zeros, zeros, torch.tensor([7.0, -9.0]), mask, kl_coef=0.1, reward_clip=5.0)
        close(rewards, [[0.0, 5.0, 0.0], [-5.0, 0.0, 0.0]])

    def test_row_kinds_in_one_batch(self):
        # EOS-ended (length 3), truncated (length 6 = R), length 1, empty. kl_coef = 0 so only scores remain.
        mask = torch.tensor([[1, 1, 1, 0, 0, 0],
                             [1, 1, 1, 1, 1, 1],
                             [1, 0, 0, 0, 0, 0],
                             [0, 0, 0, 0, 0, 0]])
        zeros = torch.zeros(4, 6)
        scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
        rewards, _ = compute_rewards(zeros, zeros, scores, mask, kl_coef=0.0, reward_clip=5.0)
        close(rewards, [[0.0, 0.0, 1.0, 0.0, 0.0, 0.0],   # t = 3 - 1 = 2
                        [0.0, 0.0, 0.0, 0.0, 0.0, 2.0],   # t = 6 - 1 = 5
                        [3.0, 0.0, 0.0, 0.0, 0.0, 0.0],   # t = 1 - 1 = 0
                        [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # empty: nothing anywhere (in particular not at t = -1)
        assert (rewards * (1 - mask)).abs().sum() == 0

    def test_non_finite_scores_name_rows(self):
        zeros = torch.zeros(4, 2)
        with pytest.raises(ValueError, match=r"scores.*\[1, 3\]"):
            compute_rewards(zeros, zeros, torch.tensor([1.0, float("nan"), 2.0, float("inf")]), torch.ones(4, 2),
                            kl_coef=0.1, reward_clip=5.0)


class TestDeepSpeedChatSeedScenario:
    """4 real tokens + 2 padding, score 2.5: the score must land on t=3 and be trained by the policy loss."""

    mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    score = torch.tensor([2.5])

    def deepspeed_chat_rewards(self):
        # DeepSpeed-Chat: ends = start + action_mask.sum() -> reward[ends] += score, i.e. t = 4, a padding action
        rewards = torch.zeros(1, 6)
        rewards[0, int(self.mask.sum())] += self.score[0]
        return rewards

    def grad_at_t3(self, rewards):
        # GAE (values 0, gamma 1, lam 0.95): the only nonzero reward is the score, so A_3 = score if it sits at t = 3.
        adv, _ = compute_gae(rewards, torch.zeros(1, 6), self.mask, gamma=1.0, lam=0.95)
        logprobs = torch.full((1, 6), -1.0, requires_grad=True)
        loss, _ = policy_loss(logprobs, logprobs.detach(), adv, self.mask, clip_eps=0.2)
        loss.backward()
        return adv, logprobs.grad[0, 3].item()

    def test_score_lands_on_last_real_token_and_is_trained(self):
        zeros = torch.zeros(1, 6)
        rewards, _ = compute_rewards(zeros, zeros, self.score, self.mask, kl_coef=0.1, reward_clip=5.0)
        close(rewards, [[0.0, 0.0, 0.0, 2.5, 0.0, 0.0]])
        assert self.mask[0, 3] == 1
        adv, grad3 = self.grad_at_t3(rewards)
        # A_3 = delta_3 = 2.5; A_2 = 0 + 1 * 0.95 * 2.5 = 2.375; A_1 = 0.95 * 2.375 = 2.25625; A_0 = 2.1434375
        close(adv, [[2.1434375, 2.25625, 2.375, 2.5, 0.0, 0.0]])
        # ratio 1 (unclipped): d loss / d logprob_3 = -A_3 * ratio / 4 tokens = -0.625
        assert grad3 == pytest.approx(-0.625, abs=ATOL)

    def test_negative_control_deepspeed_chat_placement(self):
        ds = self.deepspeed_chat_rewards()
        zeros = torch.zeros(1, 6)
        ours, _ = compute_rewards(zeros, zeros, self.score, self.mask, kl_coef=0.1, reward_clip=5.0)
        assert not_close(ours, ds, 1.0)  # our assertion above would fail for that placement
        assert self.mask[0, 4] == 0  # it sits on a masked action...
        adv, grad3 = self.grad_at_t3(ds)
        close(adv, torch.zeros(1, 6))  # ...so it never reaches the advantages
        assert grad3 == 0.0  # nor the gradient


# ----------------------------------------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------------------------------------


def naive_gae(rewards, values, mask, gamma, lam):
    """Straightforward per-row definition: only the first L = sum(mask) tokens exist, V after the last one is 0."""
    B, R = rewards.shape
    adv = torch.zeros(B, R, dtype=torch.float64)
    for b in range(B):
        length = int(mask[b].sum())
        running = 0.0
        for t in reversed(range(length)):
            next_value = float(values[b, t + 1]) if t + 1 < length else 0.0
            delta = float(rewards[b, t]) + gamma * next_value - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b, t] = running
    returns = torch.where(mask.bool(), adv + values.double(), 0.0)
    return adv.float(), returns.float()


def random_masked_batch(seed, B=5, R=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, R + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, R  # always include an empty and a full row
    mask = (torch.arange(R)[None, :] < lengths[:, None]).long()
    rewards = torch.randn(B, R, generator=g)
    values = torch.randn(B, R, generator=g)
    return rewards, values, mask, g


class TestGAE:
    def test_hand_three_tokens(self):
        # real tokens t=0..2, t=3 is padding with junk 100s. gamma 0.9, lam 0.8 (gamma*lam = 0.72)
        # t=2: delta = 2 + 0.9*0 - 1.5 = 0.5                  A_2 = 0.5
        # t=1: delta = 0 + 0.9*1.5 - 1.0 = 0.35               A_1 = 0.35 + 0.72*0.5 = 0.71
        # t=0: delta = 1 + 0.9*1.0 - 0.5 = 1.4                A_0 = 1.4 + 0.72*0.71 = 1.9112
        # returns = A + V = [2.4112, 1.71, 2.0, 0]
        rewards = torch.tensor([[1.0, 0.0, 2.0, 100.0]])
        values = torch.tensor([[0.5, 1.0, 1.5, 100.0]])
        mask = torch.tensor([[1, 1, 1, 0]])
        adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
        close(adv, [[1.9112, 0.71, 0.5, 0.0]])
        close(ret, [[2.4112, 1.71, 2.0, 0.0]])
        # negative control: bootstrapping from the unmasked junk V_3 = 100 gives delta_2 = 2 + 90 - 1.5 = 90.5
        assert not_close(adv[0, 2], 2.0 + 0.9 * 100.0 - 1.5, 50.0)

    @pytest.mark.parametrize("seed", [0, 1, 2, 3])
    def test_matches_naive_double_loop(self, seed):
        rewards, values, mask, _ = random_masked_batch(seed)
        adv, ret = compute_gae(rewards, values, mask, gamma=0.97, lam=0.9)
        exp_adv, exp_ret = naive_gae(rewards, values, mask, 0.97, 0.9)
        close(adv, exp_adv)
        close(ret, exp_ret)

    @pytest.mark.parametrize("seed", [0, 1])
    def test_junk_at_padding_changes_nothing(self, seed):
        rewards, values, mask, g = random_masked_batch(seed)
        pad = mask == 0
        junk_r = torch.where(pad, 1e4 * torch.randn(rewards.shape, generator=g), rewards)
        junk_v = torch.where(pad, 1e4 * torch.randn(values.shape, generator=g), values)
        adv, ret = compute_gae(rewards, values, mask, gamma=0.97, lam=0.9)
        adv_j, ret_j = compute_gae(junk_r, junk_v, mask, gamma=0.97, lam=0.9)
        assert torch.equal(adv, adv_j) and torch.equal(ret, ret_j)
        assert (adv[pad] == 0).all() and (ret[pad] == 0).all()

    def test_gamma_lam_one_zero_values_is_reverse_cumsum(self):
        # rewards [1, 2, 3 | pad] -> returns [6, 5, 3, 0]; rewards [4, 5, 6, 7] -> [22, 18, 13, 7]
        rewards = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 6.0, 7.0]])
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        adv, ret = compute_gae(rewards, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
        close(ret, [[6.0, 5.0, 3.0, 0.0], [22.0, 18.0, 13.0, 7.0]])
        close(adv, ret)

    def test_no_gradient(self):
        values = torch.ones(1, 3, requires_grad=True)
        adv, ret = compute_gae(torch.ones(1, 3), values, torch.ones(1, 3), gamma=1.0, lam=1.0)
        assert not adv.requires_grad and not ret.requires_grad


# ----------------------------------------------------------------------------------------------------------------------
# Losses
# ----------------------------------------------------------------------------------------------------------------------


class TestPolicyLoss:
    # old logprobs 0 -> ratio = exp(logprobs). eps = 0.2 -> clip range [0.8, 1.2]. t=5 is padding with junk that
    # would overflow exp() (logprob 100) and carry a huge advantage.
    ratios = [1.5, 0.5, 0.5, 1.5, 1.1]
    advantages = torch.tensor([[1.0, -1.0, 1.0, -1.0, 2.0, 1e3]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])

    def logprobs(self):
        return torch.tensor([[math.log(r) for r in self.ratios] + [100.0]], requires_grad=True)

    def test_clipping_both_sides(self):
        # t0: A=+1, r=1.5: pg1 = -1.5, pg2 = -1.2 -> max -1.2   (clipped above)
        # t1: A=-1, r=0.5: pg1 =  0.5, pg2 =  0.8 -> max  0.8   (clipped below)
        # t2: A=+1, r=0.5: pg1 = -0.5, pg2 = -0.8 -> max -0.5   (unclipped, pessimistic)
        # t3: A=-1, r=1.5: pg1 =  1.5, pg2 =  1.2 -> max  1.5   (unclipped)
        # t4: A=+2, r=1.1: pg1 = -2.2, pg2 = -2.2 -> max -2.2   (inside the range)
        # loss = (-1.2 + 0.8 - 0.5 + 1.5 - 2.2) / 5 = -1.6 / 5 = -0.32
        lp = self.logprobs()
        loss, stats = policy_loss(lp, torch.zeros(1, 6), self.advantages, self.mask, clip_eps=0.2)
        close(loss.detach(), -0.32)
        close(stats["clipfrac"], 0.4)  # t0, t1 of 5
        close(stats["ratio_mean"], 1.02)  # (1.5 + 0.5 + 0.5 + 1.5 + 1.1) / 5
        close(stats["ratio_max"], 1.5)
        close(stats["ratio_min"], 0.5)
        close(stats["tokens"], 5.0)
        # approx_kl = mean((r - 1) - ln r): 2*(0.5 - ln 1.5) + 2*(-0.5 + ln 2) + (0.1 - ln 1.1) = 0.5800540 -> /5
        close(stats["approx_kl"], 0.1160108)
        assert all(not v.requires_grad and v.dim() == 0 and v.dtype == torch.float32 for v in stats.values())
        # gradient: clipped tokens and padding get 0; unclipped d/dlp (-A r)/5 = -A r / 5
        loss.backward()
        close(lp.grad, [[0.0, 0.0, -0.1, 0.3, -0.44, 0.0]])

    def test_negative_controls(self):
        old = torch.zeros(1, 6)
        # flipped advantage sign: t0 1.5, t1 -0.5, t2 0.8, t3 -1.2, t4 2.2 -> 2.8 / 5 = 0.56
        flipped, _ = policy_loss(self.logprobs(), old, -self.advantages, self.mask, clip_eps=0.2)
        close(flipped.detach(), 0.56)
        assert not_close(flipped.detach(), -0.32, 0.5)
        # no clipping at all (eps huge): (-1.5 + 0.5 - 0.5 + 1.5 - 2.2) / 5 = -0.44
        unclipped, _ = policy_loss(self.logprobs(), old, self.advantages, self.mask, clip_eps=1e6)
        close(unclipped.detach(), -0.44)

    def test_dual_clip(self):
        # c = 3. t0: A=-1, r=5: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual-clipped)
        #        t1: A=-1, r=2: max(2, 1.2) = 2 -> min(2, 3) = 2
        #        t2: A=+1, r=5: max(-5, -1.2) = -1.2 (A > 0: dual clip does not apply)
        # loss = (3 + 2 - 1.2) / 3 = 1.2666667; without dual clip (5 + 2 - 1.2) / 3 = 1.9333333
        lp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0)]], requires_grad=True)
        adv = torch.tensor([[-1.0, -1.0, 1.0]])
        mask = torch.ones(1, 3)
        loss, _ = policy_loss(lp, torch.zeros(1, 3), adv, mask, clip_eps=0.2, dual_clip=3.0)
        close(loss.detach(), 1.2666667)
        plain, _ = policy_loss(lp, torch.zeros(1, 3), adv, mask, clip_eps=0.2)
        close(plain.detach(), 1.9333333)
        loss.backward()
        # dual-clipped t0 and clipped t2 carry no gradient; t1: -A r / 3 = 2/3
        close(lp.grad, [[0.0, 0.6666667, 0.0]])

    def test_empty_mask(self):
        lp = torch.zeros(2, 3, requires_grad=True)
        loss, stats = policy_loss(lp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3), clip_eps=0.2)
        close(loss.detach(), 0.0)
        close(stats["ratio_max"], 1.0)
        close(stats["ratio_min"], 1.0)
        close(stats["tokens"], 0.0)
        loss.backward()
        close(lp.grad, torch.zeros(2, 3))


class TestValueLoss:
    def test_clipping(self):
        # clip 0.2 around old = 1.0
        # t0: v=1.5 -> vc=1.2, R=2: (v-R)^2 = 0.25, (vc-R)^2 = 0.64 -> 0.64 (clipped term larger)
        # t1: v=1.5 -> vc=1.2, R=1: 0.25 vs 0.04 -> 0.25
        # t2: v=0.9 -> vc=0.9, R=0: 0.81 vs 0.81 -> 0.81 (equal: not counted as clipped)
        # loss = 0.5 * (0.64 + 0.25 + 0.81) / 3 = 0.85 / 3 = 0.2833333; clipfrac 1/3
        values = torch.tensor([[1.5, 1.5, 0.9, 50.0]], requires_grad=True)
        old = torch.tensor([[1.0, 1.0, 1.0, -50.0]])
        returns = torch.tensor([[2.0, 1.0, 0.0, 1e4]])
        mask = torch.tensor([[1, 1, 1, 0]])
        loss, stats = value_loss(values, old, returns, mask, clip_range=0.2)
        close(loss.detach(), 0.2833333)
        close(stats["clipfrac"], 0.3333333)
        close(stats["tokens"], 3.0)
        # gradient: t0 clipped -> 0; t1: (v - R)/3 = 0.5/3; t2: (0.9 - 0)/3 = 0.3; padding 0
        loss.backward()
        close(values.grad, [[0.0, 0.1666667, 0.3, 0.0]])
        # negative control: unclipped 0.5 * (0.25 + 0.25 + 0.81) / 3 = 0.2183333
        plain, _ = value_loss(values, old, returns, mask, clip_range=float("inf"))
        close(plain.detach(), 0.2183333)


class TestShardedAggregation:
    """Two shards with 10 and 1 real tokens: per-shard losses over the GLOBAL count sum to the full-batch loss."""

    def batch(self):
        torch.manual_seed(0)
        lp = torch.randn(3, 5).mul(0.1).requires_grad_(True)
        old = torch.randn(3, 5) * 0.1
        adv = torch.tensor([[1.0] * 5, [0.5] * 5, [-4.0] * 5])
        mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
        return lp, old, adv, mask

    def test_policy_loss(self):
        lp, old, adv, mask = self.batch()
        full, _ = policy_loss(lp, old, adv, mask, clip_eps=0.2)
        g_full, = torch.autograd.grad(full, lp)
        n = int(mask.sum())  # 11, as the trainer's all-reduce would give
        shards = [slice(0, 2), slice(2, 3)]
        parts = [policy_loss(lp[s], old[s], adv[s], mask[s], clip_eps=0.2, num_tokens=n)[0] for s in shards]
        total = parts[0] + parts[1]
        g_sharded, = torch.autograd.grad(total, lp)
        close(total.detach(), full.detach())
        close(g_sharded, g_full)
        # negative control: average of per-shard means weights the lone token of shard 2 by 1/2 instead of 1/11
        local = [policy_loss(lp[s], old[s], adv[s], mask[s], clip_eps=0.2)[0] for s in shards]
        naive = (local[0] + local[1]) / 2
        assert not_close(naive.detach(), full.detach(), 0.5)

    def test_value_loss_and_tensor_num_tokens(self):
        lp, old, _, mask = self.batch()
        returns = torch.tensor([[1.0] * 5, [0.0] * 5, [3.0] * 5])
        full, _ = value_loss(lp, old, returns, mask, clip_range=0.2)
        n = mask.sum().float()  # a (device) tensor, as produced by an all-reduce
        shards = [slice(0, 2), slice(2, 3)]
        total = sum(value_loss(lp[s], old[s], returns[s], mask[s], clip_range=0.2, num_tokens=n)[0] for s in shards)
        close(total.detach(), full.detach())
        naive = sum(value_loss(lp[s], old[s], returns[s], mask[s], clip_range=0.2)[0] for s in shards) / 2
        assert not_close(naive.detach(), full.detach(), 0.5)


# ----------------------------------------------------------------------------------------------------------------------
# KL controllers
# ----------------------------------------------------------------------------------------------------------------------


class TestKLControllers:
    def test_adaptive_moves_towards_target(self):
        ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
        ctl.update(current_kl=12.0, n_steps=1000)  # error clip(12/6 - 1) = 0.2 -> mult 1 + 0.2*0.1 = 1.02
        assert ctl.value == pytest.approx(0.102, abs=1e-12)
        ctl.update(current_kl=3.0, n_steps=1000)  # error clip(-0.5) = -0.2 -> mult 0.98 -> 0.09996
        assert ctl.value == pytest.approx(0.09996, abs=1e-12)
        ctl.update(current_kl=6.6, n_steps=500)  # error 0.1 (unclipped) -> mult 1 + 0.1*0.05 = 1.005
        assert ctl.value == pytest.approx(0.09996 * 1.005, abs=1e-12)
        ctl.update(current_kl=6.0, n_steps=1000)  # on target: unchanged
        assert ctl.value == pytest.approx(0.09996 * 1.005, abs=1e-12)

    def test_state_dict_round_trip(self):
        ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
        ctl.update(current_kl=20.0, n_steps=2000)
        other = AdaptiveKLController(init_kl_coef=0.5, target=6.0, horizon=10000)
        other.load_state_dict(ctl.state_dict())
        assert other.value == ctl.value == pytest.approx(0.104, abs=1e-12)
        fixed = FixedKLController(0.05)
        fixed.update(current_kl=100.0, n_steps=1000)
        assert fixed.value == 0.05
        restored = FixedKLController(1.0)
        restored.load_state_dict(fixed.state_dict())
        assert restored.value == 0.05


# ----------------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------------


class TestBadInput:
    z = torch.zeros(2, 3)
    m = torch.ones(2, 3)

    def test_shape_mismatch(self):
        with pytest.raises(ValueError, match="advantages.*shape"):
            policy_loss(self.z, self.z, torch.zeros(2, 4), self.m, clip_eps=0.2)
        with pytest.raises(ValueError, match="action_mask.*shape"):
            compute_gae(self.z, self.z, torch.ones(2, 4), gamma=1.0, lam=0.95)
        with pytest.raises(ValueError, match="scores.*shape"):
            compute_rewards(self.z, self.z, torch.zeros(3), self.m, kl_coef=0.1, reward_clip=5.0)
        with pytest.raises(ValueError, match="labels.*shape"):
            logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))

    def test_dtype_mismatch(self):
        with pytest.raises(ValueError, match="labels.*integer"):
            logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2))
        with pytest.raises(ValueError, match="values.*floating"):
            masked_whiten(torch.zeros(2, 3, dtype=torch.long), self.m)

    def test_float_mask_with_half(self):
        mask = torch.tensor([[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]])
        with pytest.raises(ValueError, match="action_mask.*0/1.*0.5"):
            policy_loss(self.z, self.z, self.z, mask, clip_eps=0.2)
        with pytest.raises(ValueError, match="mask.*0/1"):
            masked_whiten(self.z, mask)

    def test_negative_clip_values(self):
        with pytest.raises(ValueError, match="clip_eps"):
            policy_loss(self.z, self.z, self.z, self.m, clip_eps=-0.1)
        with pytest.raises(ValueError, match="clip_range"):
            value_loss(self.z, self.z, self.z, self.m, clip_range=-0.2)
        with pytest.raises(ValueError, match="reward_clip"):
            compute_rewards(self.z, self.z, torch.zeros(2), self.m, kl_coef=0.1, reward_clip=-1.0)
        with pytest.raises(ValueError, match="dual_clip"):
            policy_loss(self.z, self.z, self.z, self.m, clip_eps=0.2, dual_clip=1.0)

    def test_unknown_estimator_lists_valid_names(self):
        with pytest.raises(ValueError, match="estimator.*k1, k2, k3.*'k4'"):
            kl_penalty(self.z, self.z, estimator="k4")
        with pytest.raises(ValueError, match="kl_estimator.*k1, k2, k3"):
            compute_rewards(self.z, self.z, torch.zeros(2), self.m, kl_coef=0.1, reward_clip=5.0, kl_estimator="kl")

    def test_other_ranges(self):
        with pytest.raises(ValueError, match="temperature"):
            logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), temperature=0.0)
        with pytest.raises(ValueError, match="labels.*\\[0, 5\\)"):
            logprobs_from_logits(torch.zeros(2, 5), torch.tensor([0, 5]))
        with pytest.raises(ValueError, match="gamma"):
            compute_gae(self.z, self.z, self.m, gamma=1.5, lam=0.95)
        with pytest.raises(ValueError, match="num_tokens"):
            policy_loss(self.z, self.z, self.z, self.m, clip_eps=0.2, num_tokens=4)  # local count is 6


class TestCheckKeyword:
    """check=False (the trainer's micro-batches) skips the data-dependent checks and their host sync, nothing else."""

    z = torch.zeros(1, 3)
    half = torch.tensor([[1.0, 0.5, 0.0]])  # not a 0/1 mask

    def test_bad_mask_and_num_tokens_raise_by_default_and_pass_with_check_false(self):
        with pytest.raises(ValueError, match="action_mask.*0/1.*0.5"):
            policy_loss(self.z, self.z, torch.ones(1, 3), self.half, clip_eps=0.2)
        # negative control of the keyword: the same input is NOT detected; 0.5 then counts as a real token (!= 0):
        # ratio 1, A = 1 -> per token -1 on t0, t1 -> loss -2 / 2 = -1
        loss, stats = policy_loss(self.z, self.z, torch.ones(1, 3), self.half, clip_eps=0.2, check=False)
        close(loss, -1.0)
        close(stats["tokens"], 2.0)
        # num_tokens below the local count (2): raises by default; unchecked it is the divisor: -2 / 1
        m = torch.tensor([[1, 1, 0]])
        with pytest.raises(ValueError, match="num_tokens.*local count 2"):
            policy_loss(self.z, self.z, torch.ones(1, 3), m, clip_eps=0.2, num_tokens=1)
        loss, _ = policy_loss(self.z, self.z, torch.ones(1, 3), m, clip_eps=0.2, num_tokens=1, check=False)
        close(loss, -2.0)
        # value loss: values 1, returns 0 -> 0.5 * 1 per real token; the mask value 2 counts as real when unchecked
        two = torch.tensor([[1, 2, 0]])
        with pytest.raises(ValueError, match="action_mask.*0/1.*2"):
            value_loss(torch.ones(1, 3), torch.ones(1, 3), self.z, two, clip_range=0.2)
        vloss, vs = value_loss(torch.ones(1, 3), torch.ones(1, 3), self.z, two, clip_range=0.2, check=False)
        close(vloss, 0.5)  # 0.5 * (1 + 1) / 2
        close(vs["tokens"], 2.0)

    def test_label_range_check_and_what_skipping_it_means(self):
        logits, labels = torch.zeros(2, 5), torch.tensor([0, 5])
        with pytest.raises(ValueError, match=r"labels.*\[0, 5\).*5"):
            logprobs_from_logits(logits, labels)
        # unchecked, an out-of-range id is left to gather (on CPU an index error; on CUDA a device-side assert)
        with pytest.raises(RuntimeError, match="out of bounds"):
            logprobs_from_logits(logits, labels, check=False)
        # in range, the result is the same number: uniform over 5 -> ln(1/5) = -1.609438
        close(logprobs_from_logits(logits, torch.tensor([0, 4]), check=False), [-1.6094379, -1.6094379])

    def test_shape_dtype_and_hyperparameter_checks_still_run_with_check_false(self):
        m = torch.ones(1, 3)
        with pytest.raises(ValueError, match="advantages.*shape"):
            policy_loss(self.z, self.z, torch.zeros(1, 4), m, clip_eps=0.2, check=False)
        with pytest.raises(ValueError, match="action_mask.*shape"):
            policy_loss(self.z, self.z, self.z, torch.ones(2, 3), clip_eps=0.2, check=False)
        with pytest.raises(ValueError, match="clip_eps"):
            policy_loss(self.z, self.z, self.z, m, clip_eps=-0.1, check=False)
        with pytest.raises(ValueError, match="returns.*shape"):
            value_loss(self.z, self.z, torch.zeros(3), m, clip_range=0.2, check=False)
        with pytest.raises(ValueError, match="num_tokens.*1-element"):
            value_loss(self.z, self.z, self.z, m, clip_range=0.2, num_tokens=torch.ones(2), check=False)
        with pytest.raises(ValueError, match="labels.*shape"):
            logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), check=False)
        with pytest.raises(ValueError, match="labels.*integer"):
            logprobs_from_logits(torch.zeros(2, 5), torch.zeros(2), check=False)

    def test_training_path_calls_make_no_host_sync_with_check_false(self):
        from _host_syncs import HostSyncs

        # one training micro-batch: log-probs from logits, policy loss, value loss, one backward
        torch.manual_seed(0)
        logits = torch.randn(2, 3, 7, requires_grad=True)
        labels = torch.randint(0, 7, (2, 3))
        mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
        values = torch.randn(2, 3, requires_grad=True)
        old, adv, n = torch.zeros(2, 3), torch.ones(2, 3), torch.tensor(10.0)  # n: e.g. all-reduced

        def micro_batch(check):
            lp = logprobs_from_logits(logits, labels, check=check) * mask
            loss, _ = policy_loss(lp, old, adv, mask, clip_eps=0.2, num_tokens=n, check=check)
            vloss, _ = value_loss(values, old, adv, mask, clip_range=0.2, num_tokens=n, check=check)
            (loss + vloss).backward()
            return loss.detach(), vloss.detach()

        with HostSyncs() as checked:
            want = micro_batch(check=True)
        with HostSyncs() as unchecked:
            got = micro_batch(check=False)
        # default: one batched sync per call (_raise_first's tolist) -> 3; the counter sees them (negative control)
        assert checked.at("ppo_math/") == 3 and checked.sites["ppo_math/checks.py:_raise_first [tolist]"] == 3, \
            checked.sites
        assert sum(unchecked.sites.values()) == 0, unchecked.sites
        torch.testing.assert_close(got, want, atol=0.0, rtol=0.0)  # the same numbers


class TestEpisodeHoles:
    """A multi-turn episode's action mask has holes where observation and template tokens sit (rollout.py)."""

    # actions at 0, 1 (turn 1) and 4 (turn 2); 2 and 3 are an observation; 5 is padding
    m = torch.tensor([[1, 1, 0, 0, 1, 0]])
    junk = 7.0  # at context and padding: must change nothing

    def test_score_on_the_last_action(self):
        z = torch.zeros(1, 6)
        rewards, _ = compute_rewards(z, z, torch.tensor([2.0]), self.m, kl_coef=0.0, reward_clip=5.0)
        assert rewards.tolist() == [[0.0, 0.0, 0.0, 0.0, 2.0, 0.0]]

    def test_placed_turn_rewards(self):
        z = torch.zeros(1, 6)
        placed = torch.tensor([[0.0, 0.5, 0.0, 0.0, 9.0, 0.0]])
        lp = torch.tensor([[-1.0, -1.0, self.junk, self.junk, -2.0, self.junk]])
        rewards, kl = compute_rewards(lp, z, placed, self.m, kl_coef=0.1, reward_clip=5.0, kl_estimator="k1")
        # k1 KL = lp - ref at actions; the 9.0 is clipped at 5
        assert torch.allclose(rewards, torch.tensor([[0.1, 0.1 + 0.5, 0.0, 0.0, 0.2 + 5.0, 0.0]]), atol=1e-6)
        assert kl[0, 2:4].tolist() == [0.0, 0.0]

    def test_gae_skips_the_observation(self):
        j = self.junk
        r = torch.tensor([[0.0, 0.5, j, j, 1.0, j]])
        v = torch.tensor([[1.0, 2.0, j, j, 3.0, j]])
        adv, ret = compute_gae(r, v, self.m, gamma=0.9, lam=0.8)
        # by hand: A4 = 1 - 3 = -2; A1 = 0.5 + 0.9 * 3 - 2 + 0.72 * A4 = -0.24; A0 = 0.9 * 2 - 1 + 0.72 * A1 = 0.6272
        assert torch.allclose(adv, torch.tensor([[0.6272, -0.24, 0.0, 0.0, -2.0, 0.0]]), atol=1e-6)
        assert torch.allclose(ret, torch.tensor([[1.6272, 1.76, 0.0, 0.0, 1.0, 0.0]]), atol=1e-6)
        # negative control: the turn-1 end bootstrapping from 0 (a recursion reset at the hole) gives another A1
        assert abs(float(adv[0, 1]) - (0.5 - 2.0)) > 1.0

    def test_gae_equals_the_squeezed_row(self):
        g = torch.Generator().manual_seed(0)
        mask = (torch.rand(4, 12, generator=g) > 0.4).long()
        mask[:, 0] = 1
        r, v = torch.randn(4, 12, generator=g), torch.randn(4, 12, generator=g)
        adv, ret = compute_gae(r, v, mask, gamma=0.95, lam=0.9)
        for b in range(4):
            keep = mask[b].bool()
            a1, r1 = compute_gae(r[b][keep][None], v[b][keep][None], torch.ones(1, int(keep.sum())), 0.95, 0.9)
            assert torch.allclose(adv[b][keep], a1[0], atol=1e-6) and torch.allclose(ret[b][keep], r1[0], atol=1e-6)
            assert adv[b][~keep].abs().sum() == 0

    def test_reinforce_pp_returns_cross_the_hole(self):
        from rlhf_engine.estimators import reinforce_pp_advantages

        r = torch.tensor([[0.0, 0.5, self.junk, self.junk, 1.0, self.junk]])
        _, ret = reinforce_pp_advantages(r, self.m, gamma=0.5)
        assert ret.tolist() == [[0.5, 1.0, 0.0, 0.0, 1.0, 0.0]]
