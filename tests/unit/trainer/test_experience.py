"""The experience (the trainer's path: experience_forwards + build_experience) on a one-rank engine, checked by index against plain Hugging Face forwards on unpadded rows.

The batch is built by hand so it holds every row kind the indexing bugs hide in (pad == EOS tokenizer): a row ended by
EOS, a row truncated at the length limit, a length-1 row (EOS first) and a short EOS-ended row, with prompts of
different lengths (left padding differs per row). Each expected number comes from a forward of the row's real tokens
alone (no padding at all), so a wrong position id, a shifted logit slice, a score read at the wrong token or a reward
placed one token off shows up as a mismatch at a named row and index.
"""
import dataclasses

import pytest
import torch

from rlhf_engine.rollout import Rollout, pad_prompts
from rlhf_engine.trainer.experience import (NonFiniteError, build_experience, experience_forwards, global_mean_var,
                                            group_ids_of)


def experience_of(engine, rollout, ppo, kl_coef, reward_fn=None):
    """The trainer's path: the experience forwards, then `build_experience` with the group ids and global
    moments (one response per prompt here); a scoring failure raised."""
    fw = experience_forwards(engine, rollout, reward_fn or (lambda p, r: engine.reward_scores(r)))
    if fw.error is not None:
        raise fw.error
    exp = build_experience(rollout, fw, fw.scores, ppo, kl_coef, moments=global_mean_var,
                           group_ids=group_ids_of(rollout.batch_size, 1, rollout.sequences.device))
    return exp, fw.entropy

EOS = 0  # the tiny tokenizer: <|endoftext|> is id 0 and, with pad_is_eos, also the pad token
PROMPTS = [[264, 78, 324], [309, 280, 78, 70, 300, 301], [77], [100, 101, 102, 103]]
GENERATED = [  # what generate emitted (pad == EOS fills finished rows)
    [11, 12, 13, EOS, EOS, EOS],  # EOS-ended, length 4 (EOS counted)
    [21, 22, 23, 24, 25, 26],  # truncated at the limit, length 6
    [EOS, EOS, EOS, EOS, EOS, EOS],  # EOS first: length 1
    [31, EOS, EOS, EOS, EOS, EOS],  # length 2
]
LENGTHS, ENDED = [4, 6, 1, 2], [True, False, True, True]
KL_COEF = 0.1


def hand_rollout(engine) -> Rollout:
    ids, mask = pad_prompts(PROMPTS, engine.pad_token_id)
    full = torch.cat([ids, torch.tensor(GENERATED)], dim=1)  # [B, P + G]: the prompt in front, as generate returns
    return Rollout.from_generation(ids, mask, full, engine.stop_token_ids, engine.pad_token_id)


def direct_forwards(engine):
    """Per row, from HF models loaded afresh (eval mode, so the config's dropout is off) on the row's real tokens only:
    actor and reference log-probs of each response token, critic values before each action, and the reward score at
    the last real token (EOS included)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    plans = engine.plans
    actor = AutoModelForCausalLM.from_pretrained(plans["actor"].path).eval()
    ref = AutoModelForCausalLM.from_pretrained(plans["reference"].path).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(plans["reward"].path).eval()
    critic = AutoModelForSequenceClassification.from_pretrained(plans["critic"].path).eval()
    out = []
    with torch.no_grad():
        for prompt, gen, n in zip(PROMPTS, GENERATED, LENGTHS):
            resp = gen[:n]
            ids = torch.tensor([prompt + resp])
            P = len(prompt)

            def lp(model):
                logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
                return torch.stack([logp[P - 1 + t, resp[t]] for t in range(n)])

            def head(model):
                return model.score(model.transformer(input_ids=ids).last_hidden_state)[0, :, 0]

            out.append(dict(actor=lp(actor), ref=lp(ref), values=head(critic)[P - 1: P - 1 + n],
                            score=head(reward)[-1]))
    return out, reward


def test_layout_of_the_hand_batch(engine1):
    r = hand_rollout(engine1)
    assert engine1.pad_token_id == EOS and EOS in engine1.stop_token_ids
    assert r.response_lengths.tolist() == LENGTHS
    assert r.ended_with_eos.tolist() == ENDED
    assert r.response_width == 6 and r.prompt_length == 6


def test_experience_by_index(engine1):
    rollout = hand_rollout(engine1)
    raw = engine1.reward_scores(rollout)
    # a clip between the 2nd and 3rd smallest |score|: two rows are clipped, two are not
    mags = raw.abs().sort().values
    clip = float((mags[1] + mags[2]) / 2)
    ppo = dataclasses.replace(engine1.cfg.ppo, reward_clip=clip, kl_estimator="k1")
    exp, entropy = experience_of(engine1, rollout, ppo, KL_COEF)
    direct, hf_reward = direct_forwards(engine1)
    R = rollout.response_width
    assert exp.rewards.shape == exp.kl.shape == exp.old_logprobs.shape == (4, R)
    clipped = 0
    for b, (d, n) in enumerate(zip(direct, LENGTHS)):
        where = f"row {b} (length {n})"
        torch.testing.assert_close(exp.old_logprobs[b, :n], d["actor"], atol=1e-5, rtol=0, msg=f"actor lp {where}")
        torch.testing.assert_close(exp.ref_logprobs[b, :n], d["ref"], atol=1e-5, rtol=0, msg=f"ref lp {where}")
        torch.testing.assert_close(exp.values[b, :n], d["values"], atol=1e-5, rtol=0, msg=f"values {where}")
        torch.testing.assert_close(exp.scores[b], d["score"], atol=1e-5, rtol=0, msg=f"score {where}")
        for name in ("old_logprobs", "ref_logprobs", "values", "rewards", "kl", "advantages", "returns"):
            assert (getattr(exp, name)[b, n:] == 0).all(), f"{name} is not 0 after the last real token of {where}"
        assert (entropy[b, n:] == 0).all() and (entropy[b, :n] > 0).all()
        # k1 KL per token, and the reward: -beta*KL everywhere, plus the clipped score at index n - 1
        kl = exp.old_logprobs[b, :n] - exp.ref_logprobs[b, :n]
        torch.testing.assert_close(exp.kl[b, :n], kl, atol=1e-6, rtol=0)
        assert (exp.kl[b, :n].abs() > 0).any(), "the reference differs from the actor: KL must not vanish"
        target = max(-clip, min(clip, float(exp.scores[b])))
        clipped += abs(float(exp.scores[b])) > clip
        got = float(exp.rewards[b, n - 1] + KL_COEF * exp.kl[b, n - 1])
        assert got == pytest.approx(target, abs=1e-6), f"score not at index {n - 1} of {where}"
        torch.testing.assert_close(exp.rewards[b, : n - 1], -KL_COEF * exp.kl[b, : n - 1], atol=1e-7, rtol=0)
        # the score reaches the trained (masked) actions: DeepSpeed-Chat's index n would put it on padding
        masked_sum = float((exp.rewards[b] * rollout.action_mask[b]).sum() + KL_COEF * exp.kl[b, :n].sum())
        assert masked_sum == pytest.approx(target, abs=1e-5)
    assert clipped == 2
    # negative control for the score position: HF's own pooling finds the last token that is not pad, which with
    # pad == EOS is the token BEFORE the EOS; row 0 then gets another score, so the check above can fail
    with torch.no_grad():
        hf_pooled = hf_reward(input_ids=rollout.sequences, attention_mask=rollout.attention_mask,
                              position_ids=rollout.position_ids).logits[:, 0]
    assert abs(float(hf_pooled[0]) - direct[0]["score"]) > 1e-4
    # the truncated row has no EOS: its score is at its last generated token, like HF's for that row
    assert float(hf_pooled[1]) == pytest.approx(float(exp.scores[1]), abs=1e-5)


def test_reward_fn_replaces_the_reward_model(engine1):
    rollout = hand_rollout(engine1)
    seen = {}

    def reward_fn(prompt_ids, r):
        seen["prompts"] = prompt_ids
        return torch.tensor([10.0, -10.0, 0.25, 1.0])

    ppo = dataclasses.replace(engine1.cfg.ppo, reward_clip=2.0)
    exp, _ = experience_of(engine1, rollout, ppo, KL_COEF, reward_fn=reward_fn)
    assert torch.equal(seen["prompts"], rollout.prompts)
    assert exp.scores.tolist() == [10.0, -10.0, 0.25, 1.0]
    for b, (n, target) in enumerate(zip(LENGTHS, [2.0, -2.0, 0.25, 1.0])):
        assert float(exp.rewards[b, n - 1] + KL_COEF * exp.kl[b, n - 1]) == pytest.approx(target, abs=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scores_name_the_rows(engine1, bad):
    rollout = hand_rollout(engine1)
    ppo = engine1.cfg.ppo
    with pytest.raises(NonFiniteError, match=r"non-finite scores for rows \[1, 3\]"):
        experience_of(engine1, rollout, ppo, KL_COEF, reward_fn=lambda p, r: torch.tensor([0.0, bad, 1.0, bad]))


def test_reward_fn_wrong_shape(engine1):
    rollout = hand_rollout(engine1)
    with pytest.raises(ValueError, match=r"reward_fn returned scores of shape \(4, 1\); expected \(4,\)"):
        experience_of(engine1, rollout, engine1.cfg.ppo, KL_COEF, reward_fn=lambda p, r: torch.zeros(4, 1))
