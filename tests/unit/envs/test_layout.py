"""A hand-built 2-turn episode in the canonical layout: masks, positions, rewards and advantages by hand."""
import pytest
import torch

from rlhf_engine.config import PPOConfig
from rlhf_engine.rollout import Rollout, pad_prompts
from rlhf_engine.trainer.experience import Forwards, build_experience

PAD = 0
# prompt [5, 6, 7]; turn 1 writes [10, 11], the observation is [20, 21], turn 2 writes [12]
PROMPT, EPISODE, ACTIONS, REWARDS = [5, 6, 7], [10, 11, 20, 21, 12], [1, 1, 0, 0, 1], [0.0, 0.5, 0.0, 0.0, 1.0]


def episode() -> Rollout:
    ids, mask = pad_prompts([PROMPT, [8, 9]], PAD)  # a second, shorter row: a single-turn response
    return Rollout.from_responses(ids, mask, [EPISODE, [13, 14]], PAD, actions=[ACTIONS, [1, 1]],
                                  turn_rewards=[REWARDS, [0.0, 2.0]])


def test_masks_and_positions():
    r = episode()
    assert r.prompt_length == 3 and r.response_width == 5
    assert r.action_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert r.response_attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert r.response_lengths.tolist() == [5, 2]
    # the observation holds real positions: the model's turn 2 sits at position 7 after 3 + 4 tokens
    assert r.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert r.position_ids[1, 1:5].tolist() == [0, 1, 2, 3]
    assert r.turn_rewards[0].tolist() == REWARDS
    # trimming and re-padding keep the holes and the rewards where they are
    t = r.select([0]).trimmed()
    assert t.action_mask.tolist() == [ACTIONS] and t.turn_rewards[0].tolist() == REWARDS
    c = Rollout.cat([r.select([1]), r.select([0])], PAD)
    assert c.action_mask.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 1]]
    assert c.response_attention[1].tolist() == [1, 1, 1, 1, 1]
    assert c.turn_rewards[1].tolist() == REWARDS


def test_rewards_on_actions_only():
    with pytest.raises(ValueError, match="did not write"):
        Rollout.from_responses(*pad_prompts([PROMPT], PAD), [EPISODE], PAD, actions=[ACTIONS],
                               turn_rewards=[[0.0, 0.0, 0.5, 0.0, 1.0]])


def test_rewards_and_gae_by_hand():
    r = episode().select([0])
    lp = torch.tensor([[-1.0, -2.0, 0.0, 0.0, -1.5]])
    ref = torch.tensor([[-1.5, -2.0, 0.0, 0.0, -1.0]])
    values = torch.tensor([[0.2, 0.4, 0.0, 0.0, 0.6]])
    fw = Forwards(lp, torch.zeros_like(lp), ref, values, r.turn_rewards.sum(-1))
    ppo = PPOConfig(kl_coef=0.1, kl_estimator="k1", gamma=1.0, lam=0.5, reward_clip=5.0)
    exp = build_experience(r, fw, fw.scores, ppo, kl_coef=0.1)
    # KL k1 = lp - ref at actions: 0.5, 0, -, -, -0.5; rewards = -0.1 KL + the turn rewards at 1 and 4
    assert torch.allclose(exp.rewards, torch.tensor([[-0.05, 0.5, 0.0, 0.0, 1.05]]), atol=1e-6)
    # GAE over actions 0, 1, 4 (gamma 1, lam 0.5): A4 = 1.05 - 0.6 = 0.45; A1 = 0.5 + 0.6 - 0.4 + 0.5 A4 = 0.925;
    # A0 = -0.05 + 0.4 - 0.2 + 0.5 A1 = 0.6125
    assert torch.allclose(exp.advantages, torch.tensor([[0.6125, 0.925, 0.0, 0.0, 0.45]]), atol=1e-6)
    assert torch.allclose(exp.returns, torch.tensor([[0.8125, 1.325, 0.0, 0.0, 1.05]]), atol=1e-6)
    assert float(exp.scores) == 1.5
