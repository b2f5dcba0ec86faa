"""Steps 1 and 2 in process: the SFT label mask and loss (prompt tokens weigh exactly 0), the layout shared with PPO,
the pairwise loss, the response policies of the data layer, evaluation sharding and the configs / flags.

The models are the tiny GPT-2 test assets (pad == EOS tokenizer made by the test session); no engine is built here.
"""
import json
import math

import pytest
import torch

from rlhf_engine.cli import build_parser, parse_args
from rlhf_engine.config import DataConfig, RewardTrainConfig, SFTConfig
from rlhf_engine.data.prompts import collate_prompts, load_prompt_data
from rlhf_engine.data.supervised import (collate_pairs, collate_sft, eval_shards, load_preference_data,
                                         load_sft_data)
from rlhf_engine.engine.role_engine import rollout_inputs
from rlhf_engine.errors import ConfigError
from rlhf_engine.ppo_math import logprobs_from_logits, pairwise_loss, sft_loss

TEMPLATE = "Question: {prompt}\nAnswer:\n"
ROWS = [  # prompts and responses of different token lengths, so both paddings differ per row
    {"prompt": "What is the boiling point of water?", "response": "100 degrees Celsius at sea level."},
    {"prompt": "Name a colour.", "response": "Blue."},
    {"prompt": "Give me a long, detailed and careful answer about the weather in spring, please.",
     "response": "Spring weather changes quickly: mild sunny days, cold nights and sudden showers."},
    {"prompt": "Hi", "response": "Hello! How can I help you today?"},
]


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny):
    from rlhf_engine.engine import load_tokenizer

    return load_tokenizer(tiny.actor)


@pytest.fixture(scope="module")
def model(tiny):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(tiny.actor)
    m.eval()  # the asset has dropout 0.1 in its config
    return m


@pytest.fixture
def sft_batch(tmp_path, tok):
    data = DataConfig(data_path=_write(tmp_path / "sft.jsonl", ROWS), prompt_template=TEMPLATE)
    ds = load_sft_data(data, tok, max_prompt_seq_len=64, max_answer_seq_len=64, verbose=False).train
    return ds, collate_sft(ds, list(range(len(ds))), tok.pad_token_id, tok.eos_token_id)


# ---- the layout and the label mask ----------------------------------------------------------------------------------
def test_label_mask_is_zero_on_every_prompt_token_and_one_on_the_response_and_its_eos(tmp_path, tok, sft_batch):
    ds, b = sft_batch
    r = b.rollout
    P = r.prompt_length
    assert len(ds) == len(ROWS) and P == max(len(x) for x in ds.input_ids)
    for i, row in enumerate(ROWS):
        prompt_len = len(ds.input_ids[i])
        resp = tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert ds.extra["response"][i] == resp  # the response as PPO would generate it: its tokens, then EOS
        assert b.loss_mask[i, :P].eq(0).all()  # every prompt token (and the left padding): weight exactly 0
        assert b.loss_mask[i, P:P + len(resp)].eq(1).all()  # every response token, the EOS included
        assert b.loss_mask[i, P + len(resp):].eq(0).all()  # right padding
        assert r.sequences[i, P + len(resp) - 1] == tok.eos_token_id
        assert r.sequences[i, P - prompt_len:P].tolist() == ds.input_ids[i]
        assert r.score_index()[i] == P + len(resp) - 1  # where a reward model reads its score: the EOS
    assert torch.equal(b.labels, r.sequences)
    assert torch.equal(r.position_ids, (r.attention_mask.cumsum(-1) - 1).clamp(min=0))
    # the prompts are exactly the ids and the left-padded layout the PPO data layer produces for the same rows
    ppo = load_prompt_data(DataConfig(data_path=_write(tmp_path / "p.jsonl", ROWS), prompt_template=TEMPLATE), tok,
                           64, verbose=False).train
    ids, mask = collate_prompts(ppo, list(range(len(ppo))), tok.pad_token_id)
    assert torch.equal(ids, r.prompts) and torch.equal(mask, r.attention_mask[:, :P])


def _loss(model, b, labels=None):
    logits = model(**rollout_inputs(b.rollout), use_cache=False).logits
    return sft_loss(logits, b.labels if labels is None else labels, b.loss_mask)


def test_loss_is_unchanged_when_a_prompt_label_changes_and_changes_with_a_response_label(model, tok, sft_batch):
    _, b = sft_batch
    P = b.rollout.prompt_length
    with torch.no_grad():
        base, stats = _loss(model, b)
        assert stats["tokens"] == b.rollout.action_mask.sum()  # the tokens counted are the response tokens
        lengths = [len(x) for x in sft_batch[0].input_ids]
        for i, n in enumerate(lengths):
            # every real prompt position of the row (its first token, the middle, the last one before the response)
            for t in sorted({P - n, P - n + n // 2, P - 1}):
                labels = b.labels.clone()
                labels[i, t] = (labels[i, t] + 7) % len(tok)
                assert torch.equal(_loss(model, b, labels)[0], base), (i, t)
        for t in (P, P + int(b.rollout.response_lengths[0]) - 1):  # first response token, and the EOS
            labels = b.labels.clone()
            labels[0, t] = (labels[0, t] + 7) % len(tok)
            assert abs(_loss(model, b, labels)[0].item() - base.item()) > 1e-4, t


def test_no_gradient_reaches_the_logits_of_prompt_positions(model, sft_batch):
    _, b = sft_batch
    P = b.rollout.prompt_length
    logits = model(**rollout_inputs(b.rollout), use_cache=False).logits.detach().requires_grad_(True)
    loss, _ = sft_loss(logits, b.labels, b.loss_mask)
    loss.backward()
    g = logits.grad.abs().sum(-1)  # [B, L]
    assert g[:, :P - 1].eq(0).all()  # positions that predict prompt tokens (or padding) get nothing
    assert (g[:, P - 1] > 0).all()  # the last prompt position predicts the first response token
    # nothing after the last response token either (the EOS is predicted at P + len - 2, the last trained position)
    for i, n in enumerate(b.rollout.response_lengths.tolist()):
        assert g[i, P + n - 1:].eq(0).all() and (g[i, P + n - 2] > 0)


def test_sft_token_logprobs_are_ppos_actor_logprobs(model, sft_batch):
    """The SFT loss is -mean of exactly the log-probs PPO's actor computes for the same ids (action_slice layout)."""
    _, b = sft_batch
    r = b.rollout
    with torch.no_grad():
        logits = model(**rollout_inputs(r), use_cache=False).logits
        loss, stats = sft_loss(logits, b.labels, b.loss_mask)
        ppo_lp = logprobs_from_logits(r.action_slice(logits), r.responses) * r.action_mask  # RLHFEngine._lm_forward
    assert torch.allclose(stats["nll_sum"], -ppo_lp.sum(), rtol=0, atol=1e-5)
    assert torch.allclose(loss, -ppo_lp.sum() / r.action_mask.sum(), rtol=0, atol=1e-6)


def test_sft_loss_with_a_global_token_count_sums_to_the_full_batch_mean(model, tok, sft_batch):
    """Micro-batches (other paddings) whose losses are divided by the global token count add up to the token mean of
    the whole batch, whatever the split (what the trainer relies on across micro-batches and ranks)."""
    ds, b = sft_batch
    with torch.no_grad():
        full, _ = _loss(model, b)
        parts = [collate_sft(ds, idx, tok.pad_token_id, tok.eos_token_id) for idx in ([0, 3], [1], [2])]
        n = sum(p.num_tokens for p in parts)
        total = sum(sft_loss(model(**rollout_inputs(p.rollout), use_cache=False).logits, p.labels, p.loss_mask,
                             num_tokens=n)[0] for p in parts)
    assert torch.allclose(total, full, atol=1e-5)


# ---- the pairwise loss ---------------------------------------------------------------------------------------------
def test_pairwise_loss_by_hand():
    c = torch.tensor([2.0, 0.0, 1.0, 5.0], requires_grad=True)
    r = torch.tensor([0.0, 1.0, 1.0, -5.0])
    mask = torch.tensor([1, 1, 1, 0])  # the last pair is padding
    loss, s = pairwise_loss(c, r, margin=0.5, pair_mask=mask, num_pairs=6)

    def nls(x):  # -log sigmoid(x)
        return math.log1p(math.exp(-x))

    expect = (nls(2 - 0.5) + nls(-1 - 0.5) + nls(0 - 0.5)) / 6
    assert loss.item() == pytest.approx(expect, abs=1e-6)
    assert s["pairs"].item() == 3 and s["correct"].item() == 1  # ties (c == r) are not correct
    assert s["gap_sum"].item() == pytest.approx(1.0) and s["chosen_sum"].item() == pytest.approx(3.0)
    loss.backward()
    assert c.grad[3] == 0  # the padding pair contributes nothing
    plain, _ = pairwise_loss(c.detach()[:3], r[:3])
    assert plain.item() == pytest.approx((nls(2) + nls(-1) + nls(0)) / 3, abs=1e-6)
    with pytest.raises(ValueError, match="margin"):
        pairwise_loss(c, r, margin=-1)


def test_pair_batch_puts_chosen_then_rejected_behind_the_same_prompts(tmp_path, tok):
    rows = [{"prompt": r["prompt"], "chosen": r["response"], "rejected": "No."} for r in ROWS]
    data = DataConfig(data_path=_write(tmp_path / "pref.jsonl", rows), prompt_template=TEMPLATE)
    ds = load_preference_data(data, tok, 64, 64, verbose=False).train
    b = collate_pairs(ds, [2, 0, 1], tok.pad_token_id, tok.eos_token_id, row_mask=[True, True, False])
    r, B, P = b.rollout, 3, b.rollout.prompt_length
    assert r.batch_size == 2 * B and b.pair_mask.tolist() == [1, 1, 0]
    assert torch.equal(r.prompts[:B], r.prompts[B:]) and torch.equal(r.attention_mask[:B, :P], r.attention_mask[B:, :P])
    no = tok("No.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    for k, i in enumerate([2, 0, 1]):
        n = len(ds.extra["chosen"][i])
        assert r.responses[k, :n].tolist() == ds.extra["chosen"][i]
        assert r.responses[B + k, :len(no)].tolist() == no
        assert r.score_index()[k] == P + n - 1 and r.score_index()[B + k] == P + len(no) - 1


# ---- the data layer's checks and policies --------------------------------------------------------------------------
def test_bad_and_long_responses_are_named_with_file_column_and_rows(tmp_path, tok):
    rows = ROWS + [{"prompt": "a", "response": ""}, {"prompt": "b", "response": 3}, {"prompt": "c"},
                   {"prompt": "d", "response": "word " * 60}]
    path = _write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError) as info:
        load_sft_data(DataConfig(data_path=path), tok, 64, 30, verbose=False)
    msg = str(info.value)
    assert path in msg
    assert "rows (0-based) 4, 6 hold an empty response" in msg  # blank and missing
    assert "'response' in rows (0-based) 5 is not a string" in msg
    assert "max_answer_seq_len = 30: 2 response(s)" in msg and "long_response_policy" in msg
    assert "row 2 'response' (54 tokens), row 7 'response'" in msg  # 54 with this tokenizer, its EOS included
    with pytest.raises(ConfigError, match="response_column = 'answer': no such column"):
        load_sft_data(DataConfig(data_path=path), tok, 64, 64, response_column="answer", verbose=False)
    with pytest.raises(ConfigError, match="chosen_column = 'chosen': no such column"):
        load_preference_data(DataConfig(data_path=path), tok, 64, 64, verbose=False)
    # skip: the bad rows and the long ones are dropped and counted
    data = DataConfig(data_path=path, bad_row_policy="skip")
    ds = load_sft_data(data, tok, 64, 30, long_response_policy="skip", verbose=False).train
    st = ds.stats.sources[0]
    assert len(ds) == 3 and (st.empty, st.not_text, st.response_too_long_skipped, st.usable) == (2, 1, 2, 3)
    # truncate: the first 30 tokens are kept, without EOS (like a PPO response cut at the length limit)
    ds = load_sft_data(data, tok, 64, 30, long_response_policy="truncate", verbose=False).train
    assert len(ds) == 5 and ds.stats.sources[0].response_truncated == 2
    cut = ds.extra["response"][4]
    assert len(cut) == 30 and tok.eos_token_id not in cut
    b = collate_sft(ds, [4, 1], tok.pad_token_id, tok.eos_token_id)
    assert b.rollout.ended_with_eos.tolist() == [False, True] and b.loss_mask[0].sum() == 30


def test_a_response_that_already_ends_with_eos_gets_no_second_one(tmp_path, tok):
    path = _write(tmp_path / "eos.jsonl", [{"prompt": "x", "response": "done" + tok.eos_token}])
    ds = load_sft_data(DataConfig(data_path=path), tok, 64, 64, verbose=False).train
    ids = ds.extra["response"][0]
    assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1


@pytest.mark.parametrize("n,bs,world", [(12, 4, 2), (7, 2, 2), (5, 4, 2), (1, 3, 2), (9, 2, 3), (4, 8, 1)])
def test_eval_shards_count_every_row_once_with_the_same_number_of_forwards_per_rank(n, bs, world):
    shards = [eval_shards(n, bs, r, world) for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # ZeRO-3 forwards are collective: equal counts on every rank
    counted = sorted(i for s in shards for idx, valid in s for i, v in zip(idx, valid) if v)
    assert counted == list(range(n))
    assert all(len(idx) <= bs for s in shards for idx, _ in s)


# ---- configs and flags ---------------------------------------------------------------------------------------------
def test_sft_and_reward_flags_are_flat_and_validated():
    cfg = parse_args(["--model_name_or_path", "m", "--data_path", "d.jsonl", "--learning_rate", "3e-4",
                      "--zero_stage", "3", "--num_train_epochs", "2", "--response_column", "answer",
                      "--prompt_template", TEMPLATE, "--max_answer_seq_len", "64", "--local_rank=0"],
                     config_cls=SFTConfig)
    assert (cfg.model.model_name_or_path, cfg.model.learning_rate, cfg.model.zero_stage) == ("m", 3e-4, 3)
    assert (cfg.train.num_train_epochs, cfg.train.max_answer_seq_len, cfg.response_column) == (2, 64, "answer")
    assert cfg.data.prompt_template == TEMPLATE and cfg.model.dtype == "auto" and cfg.run.output_dir == "runs/sft"
    rm = parse_args(["--model_name_or_path", "m", "--data_path", "d.jsonl", "--margin", "0.5"],
                    config_cls=RewardTrainConfig)
    assert rm.margin == 0.5 and rm.chosen_column == "chosen" and rm.run.output_dir == "runs/reward"
    with pytest.raises(SystemExit):  # the critic-only field is no flag here, nor are PPO's
        parse_args(["--model_name_or_path", "m", "--data_path", "d", "--init_from", "actor"], config_cls=SFTConfig)
    with pytest.raises(ConfigError) as info:
        parse_args(["--margin", "-1", "--chosen_column", "rejected", "--per_device_training_batch_size", "0",
                    "--long_response_policy", "drop", "--offload_params"], config_cls=RewardTrainConfig)
    fields = {p.field for p in info.value.problems}
    assert {"model_name_or_path", "data_path", "margin", "chosen_column", "per_device_training_batch_size",
            "long_response_policy", "offload_params"} <= fields
    help_text = build_parser("", SFTConfig).format_help()
    for section in ("model:", "SupervisedConfig:", "DataConfig:", "LoggingConfig:", "SFTConfig:"):
        assert section in help_text, section
