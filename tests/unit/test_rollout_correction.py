"""--rollout_correction: the four modes against hand numbers (ppo_math.rollout_correction), the policy loss and its
gradient through the production steps with shifted generation log-probs, the renamed modes, and a run."""
import math

import pytest
import torch
from _support import STOP_IDS, as_flags

from rlhf_engine.ppo_math import rollout_correction

OLD = torch.zeros(3, 3)
ROLL = torch.tensor([[-1.0, -0.5, 0.0], [-0.2, -0.2, 9.0], [1.0, 0.0, 0.0]])  # d = old - roll
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])


E = math.exp
# d = old - roll: [1, 0.5, 0] | [0.2, 0.2, (padding)] | [-1, 0, 0]; sequence sums 1.5, 0.4, -1
CASES = {  # mode -> (weights, policy mask, capped tokens, masked tokens, masked responses), cap 2
    "token_truncate": ([[2.0, E(0.5), 1.0], [E(0.2), E(0.2), 0.0], [E(-1), 1.0, 1.0]], MASK.tolist(), 1, 0, 0),
    "token_mask": ([[0.0, E(0.5), 1.0], [E(0.2), E(0.2), 0.0], [E(-1), 1.0, 1.0]],
                   [[0, 1, 1], [1, 1, 0], [1, 1, 1]], 0, 1, 0),
    "sequence_truncate": ([[2.0, 2.0, 2.0], [E(0.4), E(0.4), 0.0], [E(-1)] * 3], MASK.tolist(), 3, 0, 0),
    "sequence_mask": ([[0.0, 0.0, 0.0], [E(0.4), E(0.4), 0.0], [E(-1)] * 3], [[0, 0, 0], [1, 1, 0], [1, 1, 1]],
                      0, 3, 1),
}


@pytest.mark.parametrize("mode", list(CASES))
def test_each_mode_against_hand_numbers(mode):
    want_w, want_keep, capped, masked, masked_seqs = CASES[mode]
    w, keep, s = rollout_correction(OLD, ROLL, MASK, mode, cap=2.0)
    assert torch.allclose(w, torch.tensor(want_w), atol=1e-6), w
    assert keep.tolist() == want_keep
    assert (s["capped"].item(), s["masked"].item(), s["masked_seqs"].item()) == (capped, masked, masked_seqs)
    # the largest |w - 1| of a kept token: the cap's 2 where one is capped, else the farthest kept weight
    dev = {"token_truncate": 1.0, "token_mask": E(0.5) - 1, "sequence_truncate": 1.0, "sequence_mask": 1 - E(-1)}
    assert s["weight_dev_max"].item() == pytest.approx(dev[mode], abs=1e-6)


@pytest.mark.parametrize("mode", list(CASES))
def test_the_policy_loss_and_its_gradient_carry_the_weights(mode):
    """Generation log-probs shifted on purpose (ROLL), the actor at pi_old (ratio 1, no clip active): through the
    production steps (`objectives.correct`, `corrected_advantages`, the registered ppo_clip), each kept token's loss
    term is -A_t w_t / N (N = the kept tokens) and its gradient d loss / d logprob_t = -A_t w_t / N; a masked token has
    neither."""
    from rlhf_engine.policy_losses import get_policy_loss
    from rlhf_engine.rollout import Experience, Rollout, pad_prompts
    from rlhf_engine.trainer.metric_sums import MetricSums
    from rlhf_engine.trainer.objectives import corrected_advantages, correct

    ids, pmask = pad_prompts([[5], [6], [7]], 0)
    rollout = Rollout.from_responses(ids, pmask, [[11, 12, 13], [14, 15], [16, 17, 18]], 0)
    assert torch.equal(rollout.action_mask, MASK)
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, -1.0, 0.0], [0.25, 2.0, -4.0]]) * MASK
    z = torch.zeros(3, 3)
    exp = Experience(rollout=rollout, old_logprobs=OLD, ref_logprobs=z, values=None, scores=torch.zeros(3),
                     rewards=z, kl=z, advantages=adv, returns=None, rollout_logprobs=ROLL)
    exp = correct(exp, MetricSums(), 0, mode, 2.0)
    logprobs = OLD.clone().requires_grad_(True)
    keep = exp.policy_mask
    n = keep.sum().float()
    loss, stats = get_policy_loss("ppo_clip")(logprobs=logprobs, old_logprobs=exp.old_logprobs,
                                              advantages=corrected_advantages(exp), action_mask=keep,
                                              clip_eps=0.2, num_tokens=n)
    loss.backward()
    w = torch.tensor(CASES[mode][0])
    want = (-adv * w * keep) / n
    assert loss.item() == pytest.approx(float(want.sum()), abs=1e-6)
    assert torch.allclose(logprobs.grad, want, atol=1e-6), logprobs.grad
    assert stats["clipfrac"].item() == 0.0


def test_none_changes_nothing_and_bad_arguments_are_named():
    w, keep, s = rollout_correction(OLD, ROLL, MASK, "none", cap=2.0)
    assert torch.equal(w, MASK.float()) and torch.equal(keep, MASK) and s["weight_dev_max"].item() == 0.0
    with pytest.raises(ValueError, match="cap"):
        rollout_correction(OLD, ROLL, MASK, "token_truncate", cap=1.0)
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(OLD, ROLL, MASK, "is", cap=2.0)
    with pytest.raises(ValueError, match="'tis' is now 'token_truncate'"):
        rollout_correction(OLD, ROLL, MASK, "tis", cap=2.0)


@pytest.mark.parametrize("old, new", [("tis", "token_truncate"), ("mis", "sequence_mask")])
def test_the_old_names_are_refused_naming_the_new_mode(old, new):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"rollout_correction = '{old}': was renamed: use {new}"):
        parse_args(["--actor_model_name_or_path", "/x", "--data_path", "/x.jsonl", "--rollout_correction", old])


def _args(tiny, out, **flags):
    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, output_dir=out, per_device_generation_batch_size=8,
                per_device_training_batch_size=4, max_steps=1, seed=5, actor_learning_rate=0.0,
                critic_learning_rate=0.0, export_final="false", stop_token_ids=STOP_IDS)
    return as_flags({**base, **flags})


def test_in_a_run_truncation_is_neutral_for_an_exact_backend_and_sequence_mask_masks_by_hand(tiny, dist_single,
                                                                                          tmp_path):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.trainer import build_trainer

    rec = build_trainer(parse_args(_args(tiny, str(tmp_path / "tis"), rollout_correction="token_truncate"))).step()
    assert rec["rollout/correction_capped_frac"] == 0.0 and rec["policy/ratio_max"] == 1.0
    # a backend whose log-probs are 0.3 nats too low on every token: a response of n tokens has sequence log-ratio
    # 0.3 n, out of the band [-ln 2, ln 2] (ln 2 = 0.693) from n = 3 on
    trainer = build_trainer(parse_args(_args(tiny, str(tmp_path / "mis"), rollout_correction="sequence_mask")))
    sample = trainer.engine.sample

    def biased(ids, mask, params=None):
        g = sample(ids, mask, params)
        g.logprobs = g.logprobs - 0.3 * g.rollout.action_mask
        return g

    trainer.engine.sample = biased
    rec = trainer.step()
    exp = trainer.last_experience
    lengths = exp.rollout.response_lengths
    out = lengths >= 3
    assert 0 < int(out.sum()) < len(lengths), lengths  # the setup has both kinds
    assert rec["rollout/correction_masked_seq_frac"] == pytest.approx(out.float().mean().item(), abs=1e-7)
    assert rec["rollout/correction_masked_frac"] == pytest.approx(
        float(lengths[out].sum() / lengths.sum()), abs=1e-6)
    assert torch.equal(exp.policy_mask.sum(-1), torch.where(out, 0, lengths))
    assert rec["rollout/logprob_diff_mean"] == pytest.approx(0.3, abs=1e-5)
    assert rec["rollout/seq_logratio_max"] == pytest.approx(0.3 * int(lengths.max()), abs=1e-4)
    assert rec["value/loss"] is not None  # the critic still trains on every response
