"""--rollout_correction: TIS weights and MIS masks against hand numbers (ppo_math.rollout_correction), and in a run."""
import math

import pytest
import torch
from _support import STOP_IDS, as_flags

from rlhf_engine.ppo_math import rollout_correction

OLD = torch.zeros(3, 3)
ROLL = torch.tensor([[-1.0, -0.5, 0.0], [-0.2, -0.2, 9.0], [1.0, 0.0, 0.0]])  # d = old - roll
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])


def test_tis_caps_each_token_ratio():
    w, keep, s = rollout_correction(OLD, ROLL, MASK, "tis", cap=2.0)
    # exp(d): e^1 = 2.718 -> capped at 2; e^0.5; 1 | e^0.2 twice, padding 0 | e^-1, 1, 1
    want = torch.tensor([[2.0, math.exp(0.5), 1.0], [math.exp(0.2), math.exp(0.2), 0.0], [math.exp(-1.0), 1.0, 1.0]])
    assert torch.allclose(w, want, atol=1e-6), w
    assert torch.equal(keep, MASK) and s["capped"].item() == 1.0 and s["masked"].item() == 0.0


def test_mis_masks_whole_responses_outside_the_band():
    w, keep, s = rollout_correction(OLD, ROLL, MASK, "mis", cap=2.0)
    # sequence log-ratios: 1.5 (e^1.5 = 4.5 > 2: out), 0.4 (in; padding ignored), -1 (e^-1 = 0.37 < 1/2: out)
    assert torch.equal(keep, torch.tensor([[0, 0, 0], [1, 1, 0], [0, 0, 0]]))
    assert torch.equal(w, MASK.float()) and s["masked"].item() == 2.0
    _, keep3, s3 = rollout_correction(OLD, ROLL, MASK, "mis", cap=3.0)  # e^-1 = 0.37 >= 1/3: row 2 stays
    assert keep3[2].tolist() == [1, 1, 1] and s3["masked"].item() == 1.0


def test_none_changes_nothing_and_bad_arguments_are_named():
    w, keep, _ = rollout_correction(OLD, ROLL, MASK, "none", cap=2.0)
    assert torch.equal(w, MASK.float()) and torch.equal(keep, MASK)
    with pytest.raises(ValueError, match="cap"):
        rollout_correction(OLD, ROLL, MASK, "tis", cap=1.0)
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(OLD, ROLL, MASK, "is", cap=2.0)


def _args(tiny, out, **flags):
    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, output_dir=out, per_device_generation_batch_size=8,
                per_device_training_batch_size=4, max_steps=1, seed=5, actor_learning_rate=0.0,
                critic_learning_rate=0.0, export_final="false", stop_token_ids=STOP_IDS)
    return as_flags({**base, **flags})


def test_in_a_run_tis_is_neutral_for_an_exact_backend_and_mis_masks_by_hand(tiny, dist_single, tmp_path):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.trainer import build_trainer

    rec = build_trainer(parse_args(_args(tiny, str(tmp_path / "tis"), rollout_correction="tis"))).step()
    assert rec["rollout/correction_capped_frac"] == 0.0 and rec["policy/ratio_max"] == 1.0
    # a backend whose log-probs are 0.3 nats too low on every token: a response of n tokens has sequence log-ratio
    # 0.3 n, out of the band [-ln 2, ln 2] (ln 2 = 0.693) from n = 3 on
    trainer = build_trainer(parse_args(_args(tiny, str(tmp_path / "mis"), rollout_correction="mis")))
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
    assert rec["rollout/correction_masked_frac"] == pytest.approx(out.float().mean().item(), abs=1e-7)
    assert torch.equal(exp.policy_mask.sum(-1), torch.where(out, 0, lengths))
    assert rec["rollout/logprob_diff_mean"] == pytest.approx(0.3, abs=1e-5)
    assert rec["rollout/seq_logratio_max"] == pytest.approx(0.3 * int(lengths.max()), abs=1e-4)
    assert rec["value/loss"] is not None  # the critic still trains on every response
