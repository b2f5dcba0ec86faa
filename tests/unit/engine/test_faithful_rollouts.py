"""The sampled distribution is the scored distribution: exact sampling whatever the model's generation_config says,
stop tokens from every source, min_answer_seq_len masked in every log-prob, and the live check of generation-time
log-probs. Models whose next-token distribution is fixed by construction make sampled frequencies checkable."""
import copy
import logging
import math
import os

import pytest
import torch
from _support import STOP_IDS, Z, as_flags, fixed_model, z_logits

from rlhf_engine.cli import parse_args
from rlhf_engine.engine import RLHFEngine
from rlhf_engine.engine.preflight import end_of_turn_token, plan_engine
from rlhf_engine.errors import ConfigError
from rlhf_engine.trainer import build_trainer

E2, N = 9, 400  # a second EOS id, rows sampled


def train_args(tiny, output_dir: str, **flags) -> list[str]:
    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, output_dir=output_dir)
    return as_flags({**base, **flags})


@pytest.fixture(scope="module")
def penalized(tiny, tmp_path_factory):
    """p(Z) = 0.987, and a generation_config asking for repetition_penalty 50 and an n-gram ban."""
    vocab = 512
    return fixed_model(tiny, str(tmp_path_factory.mktemp("fixed") / "penalized"), z_logits(vocab, 0.987),
                       dict(repetition_penalty=50.0, no_repeat_ngram_size=1, eos_token_id=0))


def engine_for(model, out, dist, **flags):
    cfg = parse_args(train_args(_Tiny(model), str(out), reward_model_name_or_path=model, critic_init_from="actor",
                                **flags))
    return RLHFEngine(cfg, dist, plan_engine(cfg, 1))


class _Tiny:
    def __init__(self, model):
        self.actor = self.reward = model
        self.prompts = ""


def _z_count(rollout) -> int:
    return int((rollout.responses[:, 0] == Z).sum())


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_sampling_ignores_the_models_generation_config(penalized, tmp_path, dist_single, caplog, backend):
    with caplog.at_level(logging.WARNING):
        e = engine_for(penalized, tmp_path, dist_single, max_answer_seq_len=1, generation_backend=backend)
    assert any("repetition_penalty=50.0" in m and "no_repeat_ngram_size=1" in m and "not used" in m
               for m in caplog.messages), caplog.messages
    ids = torch.tensor([[Z, Z, 7]] * N)  # Z is in every prompt: a repetition penalty would push it down
    torch.manual_seed(0)
    r = e.generate(ids, torch.ones_like(ids))
    expect, sd = N * 0.987, math.sqrt(N * 0.987 * 0.013)
    assert abs(_z_count(r) - expect) <= 6 * sd, (_z_count(r), expect, sd)
    if backend != "hf":
        return
    # negative control: the model's generation_config copied and updated (the old way) samples Z about 0.2% of the time
    model = e.actor.module
    kw = e.generator.generation_kwargs(e.sampling)
    kw.pop("synced_gpus")
    old = copy.deepcopy(model.generation_config)
    old.update(**kw)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=old)
    assert abs(int((out[:, 3] == Z).sum()) - expect) > 6 * sd


def test_a_second_eos_of_the_generation_config_ends_responses(tiny, tmp_path, dist_single):
    logits = torch.zeros(512)
    logits[E2] = 30.0  # the model emits E2 at once
    model = fixed_model(tiny, str(tmp_path / "eos2"), logits, dict(eos_token_id=[0, E2]))
    e = engine_for(model, tmp_path / "run", dist_single, max_answer_seq_len=6)
    assert E2 in e.stop_token_ids and 0 in e.stop_token_ids
    ids = torch.tensor([[7, 8, 11]] * 4)
    r = e.generate(ids, torch.ones_like(ids))
    assert r.response_lengths.tolist() == [1] * 4 and r.ended_with_eos.all()
    # negative control: with the tokenizer's EOS alone every response runs to the length limit
    only_eos = type(e.sampling)(**{**e.sampling.__dict__, "stop_token_ids": (0,)})
    r2 = e.generate(ids, torch.ones_like(ids), only_eos)
    assert r2.response_lengths.tolist() == [6] * 4 and not r2.ended_with_eos.any()


def test_stop_token_outside_the_vocabulary_is_a_start_up_error(tiny, tmp_path):
    cfg = parse_args(train_args(tiny, str(tmp_path), stop_token_ids=[3, 4096]))
    with pytest.raises(ConfigError) as e:
        plan_engine(cfg)
    (p,) = [q for q in e.value.problems if q.field == "stop_token_ids"]
    assert p.value == [4096] and "vocabulary (size 512)" in p.fix


def test_chat_template_end_of_turn_is_found_by_rendering(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<s>\n{% endfor %}"
    assert end_of_turn_token(tok) == tok.convert_tokens_to_ids("<s>") == 2
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_token(tok) is None  # no special token closes the turn


@pytest.mark.parametrize("flag", [{"top_p": 0.9}, {"top_k": 40}])
def test_truncated_sampling_is_refused_by_name(tiny, tmp_path, flag):
    with pytest.raises(ConfigError) as e:
        parse_args(train_args(tiny, str(tmp_path), **flag))
    assert [p.field for p in e.value.problems] == list(flag)
    parse_args(train_args(tiny, str(tmp_path), do_sample="false", **flag))  # greedy: nothing to truncate


# ---- the live check -----------------------------------------------------------------------------------------------
FLAGS = dict(per_device_generation_batch_size=8, per_device_training_batch_size=4, max_steps=1, seed=5,
             actor_learning_rate=0.0, critic_learning_rate=0.0, export_final="false", stop_token_ids=STOP_IDS)


@pytest.mark.parametrize("backend", ["lean", "hf"])
@pytest.mark.parametrize("min_len", [0, 3])
def test_generation_logprobs_match_the_recomputed_ones(tiny, dist_single, tmp_path, min_len, backend):
    trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path), min_answer_seq_len=min_len,
                                                  generation_backend=backend, **FLAGS)))
    rec = trainer.step()
    exp = trainer.last_experience
    assert rec["rollout/logprob_diff_max"] <= 1e-5 and rec["rollout/seq_logratio_max"] <= 1e-5, rec
    assert rec["rollout/logprob_diff_mean"] <= rec["rollout/logprob_diff_max"]
    assert rec["policy/ratio_max"] == rec["policy/ratio_min"] == 1.0
    lengths = exp.rollout.response_lengths
    assert int(lengths.min()) >= max(min_len, 1) and int(lengths.max()) > int(lengths.min())  # stops did happen
    trainer.metrics.close()


def test_negative_control_min_len_without_the_mask_in_the_logprobs(tiny, dist_single, tmp_path, monkeypatch):
    """Without the stop-token mask in the recomputed log-probs the live check sees the off-policy step."""
    from rlhf_engine.engine import rlhf_engine as module

    monkeypatch.setattr(module, "mask_stop_tokens_", lambda logits, ids, n, **where: logits)
    trainer = build_trainer(parse_args(train_args(tiny, str(tmp_path), min_answer_seq_len=3, **FLAGS)))
    rec = trainer.step()
    assert rec["rollout/logprob_diff_max"] > 1e-2 and rec["rollout/seq_logratio_max"] > 1e-2, rec
    trainer.metrics.close()
