"""The policy-loss registry and the sequence-level losses against numbers and gradients computed by hand."""
import math

import pytest
import torch

from rlhf_engine import ppo_math
from rlhf_engine.policy_losses import POLICY_LOSSES, get_policy_loss, register_policy_loss

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
OLD = torch.zeros(2, 3)


def _run(name, lp, adv, **kw):
    logprobs = lp.clone().requires_grad_(True)
    loss, stats = get_policy_loss(name)(logprobs=logprobs, old_logprobs=OLD, advantages=adv, action_mask=MASK,
                                        clip_eps=0.2, num_tokens=MASK.sum(), **kw)
    loss.backward()
    return loss.item(), logprobs.grad, stats


def test_the_registry():
    assert set(POLICY_LOSSES) >= {"ppo_clip", "gspo", "cispo"}
    assert get_policy_loss("ppo_clip") is ppo_math.policy_loss  # the default is today's function itself
    with pytest.raises(KeyError, match="unknown policy loss 'x'; registered: cispo, gspo, ppo_clip"):
        get_policy_loss("x")
    with pytest.raises(ValueError, match="registered twice"):
        register_policy_loss("gspo")(ppo_math.gspo_loss)


def test_gspo_by_hand():
    """Sequence log-ratios are the token means: row 0 (0.3 - 0.3 + 0.6) / 3 = 0.2, row 1 (0.1 + 0.5) / 2 = 0.3
    (the padding's 9 ignored). s = e^0.2 = 1.2214 (A = +1: above 1.2, clipped: -1.2 per token, no gradient) and
    e^0.3 = 1.3499 (A = -2: -A s = 2.6997 > -A x 1.2 = 2.4, not clipped; gradient of each of its tokens
    -A s = 2.6997, through its own log-prob only). token_mean over 5 tokens."""
    lp = torch.tensor([[0.3, -0.3, 0.6], [0.1, 0.5, 9.0]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    s1 = math.exp(0.3)
    loss, grad, stats = _run("gspo", lp, adv)
    assert loss == pytest.approx((3 * -1.2 + 2 * 2 * s1) / 5, abs=1e-6)
    assert torch.allclose(grad, torch.tensor([[0.0, 0.0, 0.0], [2 * s1 / 5, 2 * s1 / 5, 0.0]]), atol=1e-6), grad
    assert stats["clipfrac"].item() == pytest.approx(3 / 5)  # the whole of row 0, none of row 1
    assert stats["ratio_max"].item() == pytest.approx(s1, abs=1e-6)
    assert stats["ratio_min"].item() == pytest.approx(math.exp(0.2), abs=1e-6)
    # negative control: token-level PPO on the same numbers clips other tokens and gives another loss
    ppo_loss, ppo_grad, _ = _run("ppo_clip", lp, adv)
    assert abs(ppo_loss - loss) > 1e-2 and not torch.allclose(ppo_grad, grad)


def test_cispo_by_hand():
    """ratios e^0.3 = 1.35 -> weight 1.2, e^-0.5 = 0.61 -> 0.8, e^0.1 = 1.105 (kept); row 1: e^0 = 1, e^0.4 = 1.49
    -> 1.2. Per token -A w lp; gradient -A w, clipped tokens included (PPO's clip would zero some of them)."""
    lp = torch.tensor([[0.3, -0.5, 0.1], [0.0, 0.4, 9.0]])
    adv = torch.tensor([[1.0, 1.0, -1.0], [2.0, 2.0, 0.0]])
    w = torch.tensor([[1.2, 0.8, math.exp(0.1)], [1.0, 1.2, 0.0]])
    loss, grad, stats = _run("cispo", lp, adv)
    want = (-adv * w * lp * MASK).sum() / 5
    assert loss == pytest.approx(float(want), abs=1e-6)
    assert torch.allclose(grad, -adv * w * MASK / 5, atol=1e-6), grad
    assert stats["clipfrac"].item() == pytest.approx(3 / 5)  # 1.2, 0.8 and row 1's 1.2
    # negative control: PPO's clip gives the first token (A > 0, ratio above 1 + eps) no gradient at all
    _, ppo_grad, _ = _run("ppo_clip", lp, adv)
    assert ppo_grad[0, 0].item() == 0.0 and grad[0, 0].item() != 0.0


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_at_the_old_policy_every_loss_has_the_policy_gradient(name):
    """logprobs = old_logprobs (ratio 1, nothing clipped): d loss / d logprob_t = -A_t / N for every loss."""
    lp = torch.tensor([[-0.7, -1.1, -2.0], [-0.2, -3.0, 0.0]])
    adv = torch.tensor([[0.5, -1.0, 2.0], [1.5, -0.5, 0.0]])
    logprobs = lp.clone().requires_grad_(True)
    loss, stats = get_policy_loss(name)(logprobs=logprobs, old_logprobs=lp, advantages=adv, action_mask=MASK,
                                        clip_eps=0.2, num_tokens=5)
    loss.backward()
    assert torch.allclose(logprobs.grad, -adv * MASK / 5, atol=1e-6)
    assert stats["ratio_max"].item() == stats["ratio_min"].item() == 1.0 and stats["clipfrac"].item() == 0.0


def test_a_dual_clip_with_another_loss_is_refused():
    from rlhf_engine.cli import parse_args
    from rlhf_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=r"dual_clip = 3.0: is a ppo_clip setting; policy_loss gspo"):
        parse_args(["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl", "--policy_loss", "gspo",
                    "--dual_clip", "3"])
