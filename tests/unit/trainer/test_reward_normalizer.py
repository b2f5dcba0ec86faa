"""Score shaping (trainer/reward_shaping.py): the running reward normalizer (statistics, order, state), the
missing-EOS penalty, both through the trainer; and a reward model with its own tokenizer (decode, re-encode, score at
the last real token), against plain Hugging Face forwards."""
import math
import os

import numpy as np
import pytest
import torch

from _trainer_args import train_args
from rlhf_engine.cli import parse_args
from rlhf_engine.errors import ConfigError
from rlhf_engine.trainer import build_trainer
from rlhf_engine.trainer.experience import decode_rollout
from rlhf_engine.trainer.reward_shaping import (RetokenizedRewardModel, RewardNormalizer, ScoreShaper,
                                                apply_missing_eos_penalty)
from rlhf_engine.trainer.reward_sources import RewardFnSource

STOP_IDS = [t for t in range(3, 512) if (t * 2654435761) % 7 < 1]  # ~1/7 of the vocabulary ends a response


def test_running_statistics_match_numpy_over_every_batch_and_round_trip(dist_single):
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=n).astype(np.float32).astype(np.float64) for n in (4, 1, 7, 5)]
    norm = RewardNormalizer()
    for i, b in enumerate(batches):
        out = norm(torch.tensor(b, dtype=torch.float32))
        seen = np.concatenate(batches[: i + 1])
        assert norm.count == len(seen)
        assert abs(norm.mean - seen.mean()) < 1e-12 and abs(norm.std - seen.std()) < 1e-12
        # the batch is normalized with the statistics that already include it
        assert np.allclose(out.numpy(), (b - seen.mean()) / (seen.std() + 1e-8), atol=1e-6)
    other = RewardNormalizer()
    other.load_state_dict(norm.state_dict())
    x = torch.tensor([0.0, 1.0, 10.0])
    assert torch.equal(other.normalize(x), norm.normalize(x))
    assert RewardNormalizer().normalize(x).tolist() == pytest.approx(x.tolist())  # no statistics yet: unchanged


def test_missing_eos_penalty_and_order():
    scores, ended = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True])
    assert apply_missing_eos_penalty(scores, ended, 0.5).tolist() == [1.0, 1.5, 3.0]
    assert apply_missing_eos_penalty(scores, ended, 0.0) is scores
    shaper = ScoreShaper(normalize=True, missing_eos_penalty=1.0)
    rollout = type("R", (), {"ended_with_eos": ended})()
    out = shaper(scores, rollout)  # normalized first (mean 2, std sqrt(2/3)), then the penalty in those units
    expect = (scores - 2.0) / (math.sqrt(2 / 3) + 1e-8) - torch.tensor([0.0, 1.0, 0.0])
    assert torch.allclose(out, expect, atol=1e-6)
    assert not ScoreShaper(False, 0.0).active


def test_normalizer_and_penalty_through_the_trainer(tiny, dist_single, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), max_steps=2, per_device_generation_batch_size=8,
                                per_device_training_batch_size=8, normalize_reward="true", missing_eos_penalty=0.5,
                                stop_token_ids=STOP_IDS, export_final="false"))
    trainer = build_trainer(cfg)
    raw = []

    def reward_fn(prompt_ids, rollout):  # deterministic, uneven scores
        s = rollout.response_lengths.float() * 0.7 + torch.arange(rollout.batch_size).float()
        raw.append(s)
        return s

    trainer.reward_source = RewardFnSource(reward_fn)
    recs = [trainer.step() for _ in range(2)]
    trainer.metrics.close()
    assert trainer.state_providers["reward_normalizer"] is trainer.shaper.normalizer
    seen = torch.cat(raw).double()
    norm = trainer.shaper.normalizer
    assert norm.count == 16 and abs(norm.mean - seen.mean().item()) < 1e-9
    assert abs(norm.std - seen.std(unbiased=False).item()) < 1e-9
    exp = trainer.last_experience
    ended = exp.rollout.ended_with_eos
    assert ended.any() and not ended.all(), ended  # both kinds of rows (stop ids end some responses)
    expect = (raw[-1].double() - norm.mean) / (norm.std + 1e-8) - 0.5 * (~ended).double()
    assert torch.allclose(exp.scores.double(), expect, atol=1e-6)
    assert recs[-1]["objective/score"] == pytest.approx(raw[-1].mean().item())  # raw scores
    assert recs[-1]["objective/shaped_score"] == pytest.approx(expect.mean().item(), abs=1e-6)


@pytest.fixture(scope="module")
def other_vocab_reward(tiny):
    """A reward model with its own tokenizer (another vocabulary: 300 tokens instead of 512)."""
    from rlhf_engine.assets import build_tiny_model, train_tiny_tokenizer

    root = os.path.join(tiny.root, "reward_other_vocab")
    tok = os.path.join(root, "tok")
    model = os.path.join(root, "model")
    if not os.path.isdir(model):
        train_tiny_tokenizer(tok, vocab_size=300, pad_is_eos=True)
        build_tiny_model(model, tok, arch="gpt2", head="score", dropout=0.0, seed=4)
    return tok, model


def test_reward_model_with_its_own_tokenizer(tiny, dist_single, tmp_path, other_vocab_reward):
    from rlhf_engine.engine.preflight import plan_engine
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok_path, model_path = other_vocab_reward
    base = dict(reward_model_name_or_path=model_path, critic_init_from="actor", max_steps=1,
                per_device_generation_batch_size=4, per_device_training_batch_size=4, export_final="false")
    with pytest.raises(ConfigError, match=r"reward_model_name_or_path = .*vocabulary size \d+ differs from the "
                                          r"actor's 512.*reward_tokenizer_name_or_path"):
        plan_engine(parse_args(train_args(tiny, str(tmp_path / "refused"), **base)))
    cfg = parse_args(train_args(tiny, str(tmp_path / "run"), reward_tokenizer_name_or_path=tok_path, **base))
    trainer = build_trainer(cfg)
    assert isinstance(trainer.reward_source.retokenized, RetokenizedRewardModel)
    trainer.step()
    trainer.metrics.close()
    exp = trainer.last_experience
    # by hand: decode with the actor's tokenizer, encode with the reward's, one unpadded row at a time
    rtok = AutoTokenizer.from_pretrained(tok_path)
    hf = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    prompts, responses = decode_rollout(trainer.engine.tokenizer, exp.rollout)
    expect = []
    with torch.no_grad():
        for p, r, e in zip(prompts, responses, exp.rollout.ended_with_eos.tolist()):
            ids = rtok(p)["input_ids"] + rtok(r, add_special_tokens=False)["input_ids"] + (
                [rtok.eos_token_id] if e else [])
            hidden = hf.transformer(input_ids=torch.tensor([ids])).last_hidden_state
            expect.append(hf.score(hidden)[0, -1, 0].item())
    assert torch.allclose(exp.scores, torch.tensor(expect), atol=1e-5), (exp.scores, expect)
    # a reward tokenizer with the actor's vocabulary needs no re-encoding
    same = parse_args(train_args(tiny, str(tmp_path / "same"), reward_tokenizer_name_or_path=tiny.tokenizer,
                                 max_steps=1))
    plan_engine(same).roles


def test_reward_model_scores_conversations_through_its_chat_template(tiny, dist_single, tmp_path,
                                                                    other_vocab_reward):
    """--reward_use_chat_template: [user: the data row's prompt, assistant: the response] in the reward tokenizer's
    template, scored at its last token; a reward tokenizer without a template is refused before any engine."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok_path, model_path = other_vocab_reward
    base = dict(reward_model_name_or_path=model_path, critic_init_from="actor", max_steps=1,
                per_device_generation_batch_size=4, per_device_training_batch_size=4, export_final="false",
                reward_use_chat_template="true")
    with pytest.raises(ConfigError, match=r"reward_use_chat_template = True: the reward tokenizer .* has no "
                                          r"chat_template"):
        build_trainer(parse_args(train_args(tiny, str(tmp_path / "refused"), reward_tokenizer_name_or_path=tok_path,
                                            **base)))
    rtok = AutoTokenizer.from_pretrained(tok_path)
    rtok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|endoftext|>{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}")
    chat_tok = str(tmp_path / "chat_tok")
    rtok.save_pretrained(chat_tok)
    trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path / "run"), reward_tokenizer_name_or_path=chat_tok,
                                                  **base)))
    assert isinstance(trainer.reward_source.retokenized, RetokenizedRewardModel) and trainer.reward_source.retokenized.use_chat_template
    trainer.step()
    trainer.metrics.close()
    exp = trainer.last_experience
    _, responses = decode_rollout(trainer.engine.tokenizer, exp.rollout)
    hf = AutoModelForSequenceClassification.from_pretrained(model_path).eval()
    expect = []
    with torch.no_grad():
        for row, r in zip(exp.rollout.rows, responses):
            text = rtok.apply_chat_template([{"role": "user", "content": row.text},
                                             {"role": "assistant", "content": r}], tokenize=False)
            assert text.startswith(f"[user] {row.text}<|endoftext|>[assistant] ")
            hidden = hf.transformer(input_ids=torch.tensor([rtok(text, add_special_tokens=False)["input_ids"]]))
            expect.append(hf.score(hidden.last_hidden_state)[0, -1, 0].item())
    assert torch.allclose(exp.scores, torch.tensor(expect), atol=1e-5), (exp.scores, expect)
