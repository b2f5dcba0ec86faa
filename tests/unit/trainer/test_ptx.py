"""PPO-ptx (trainer/ptx.py) on one in-process rank: the unsupervised data (text files, tables, problems), the sharded
resumable stream, the global token normalisation of the LM loss, unsup_coef = 0 reproducing the run without ptx
exactly, and ptx/loss falling on repeated data."""
import json
import os

import pytest
import torch

from _trainer_args import train_args
from rlhf_engine.cli import parse_args
from rlhf_engine.engine import load_tokenizer
from rlhf_engine.errors import ConfigError
from rlhf_engine.ppo_math import logprobs_from_logits
from rlhf_engine.trainer import build_trainer
from rlhf_engine.data.ptx import PtxData, collate_ptx, load_ptx_data
from rlhf_engine.trainer.ptx import ptx_loss
from rlhf_engine.data.sampler import DataCursor

VOLATILE = ("time/", "throughput/", "memory/")
DOCS = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine",
        "all that glitters is not gold", "where there is smoke there is fire"]


@pytest.fixture(scope="module")
def tok(tiny):
    return load_tokenizer(tiny.tokenizer)


def _txt(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_text_file_one_document_per_line_blank_skipped_long_cut(tok, tmp_path):
    long = " ".join(["word"] * 200)
    data = load_ptx_data(_txt(tmp_path / "u.txt", ["first doc here", "", "   ", long, "x"]), tok, max_len=16)
    assert data.rows == 5 and data.truncated == 1
    lens = [len(x) for x in data.input_ids]
    assert max(lens) == 16 and all(n >= 2 for n in lens)
    assert data.input_ids[0] == tok("first doc here")["input_ids"]
    assert data.skipped == data.rows - len(data)  # blank lines and a one-token document


def test_tokenized_documents_are_cached_and_keyed_on_the_file_and_length(tok, tmp_path):
    path = _txt(tmp_path / "u.txt", DOCS)
    cache = str(tmp_path / "cache")
    first = load_ptx_data(path, tok, 64, data_cache_dir=cache)
    second = load_ptx_data(path, tok, 64, data_cache_dir=cache)
    assert (first.cache.status, second.cache.status) == ("built", "read")
    assert second.input_ids == first.input_ids == load_ptx_data(path, tok, 64).input_ids  # default: no cache
    assert load_ptx_data(path, tok, 4, data_cache_dir=cache).cache.status == "built"  # max_len is in the key
    _txt(tmp_path / "u.txt", DOCS[:2])
    changed = load_ptx_data(path, tok, 64, data_cache_dir=cache)
    assert changed.cache.status == "built" and len(changed) == 2


def test_table_text_column_and_problems(tok, tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    assert len(load_ptx_data(str(path), tok, 64, text_column="body")) == 4
    with pytest.raises(ConfigError, match=r"unsup_text_column = 'text': no such column .*\['body'\]"):
        load_ptx_data(str(path), tok, 64)
    with pytest.raises(ConfigError, match=r"unsupervised_dataset_name = .*no usable document"):
        load_ptx_data(_txt(tmp_path / "empty.txt", ["", " "]), tok, 64)
    with pytest.raises(ConfigError, match=r"unsupervised_dataset_name = .*missing.txt.*no such file"):
        load_ptx_data(str(tmp_path / "missing.txt"), tok, 64)
    with pytest.raises(ConfigError, match=r"cannot fill one global ptx mini-batch of 4 \(per_device_training_batch_size"
                                          r" x gradient_accumulation_steps\) x 2 ranks"):
        PtxData(load_ptx_data(str(path), tok, 64, text_column="body"), 2, 2, 0, 2, seed=0, pad_token_id=0)


def test_stream_is_sharded_deterministic_and_resumes(tok, tmp_path):
    data = load_ptx_data(_txt(tmp_path / "u.txt", [f"document number {i} of many" for i in range(10)]), tok, 64)
    a = PtxData(data, 2, 1, 0, 1, seed=5, pad_token_id=tok.pad_token_id)
    first = [a.next_mini_batch("cpu")[0].input_ids for _ in range(3)]
    state = a.cursor.state_dict()
    nxt = [a.next_mini_batch("cpu")[0] for _ in range(2)]
    b = PtxData(data, 2, 1, 0, 1, seed=5, pad_token_id=tok.pad_token_id)
    b.cursor.load_state_dict(state)
    assert isinstance(b.cursor, DataCursor)
    assert all(torch.equal(x.input_ids, b.next_mini_batch("cpu")[0].input_ids) for x in nxt)
    c = PtxData(data, 2, 1, 0, 1, seed=5, pad_token_id=tok.pad_token_id)
    assert all(torch.equal(x, c.next_mini_batch("cpu")[0].input_ids) for x in first)
    # right padding, position ids from the mask, trained tokens = real tokens but the first of each row
    batch = collate_ptx(data, [0, 1], pad_token_id=tok.pad_token_id)
    n0, n1 = len(data.input_ids[0]), len(data.input_ids[1])
    assert batch.attention_mask.sum(1).tolist() == [n0, n1] and int(batch.num_tokens) == n0 + n1 - 2
    assert batch.position_ids[0, :n0].tolist() == list(range(n0))


def _documents(stream) -> list:
    """The documents of a stream's next mini-batch, as id lists (padding dropped)."""
    return [row[m.bool()].tolist() for b in stream.next_mini_batch("cpu") for row, m in
            zip(b.input_ids, b.attention_mask)]


def test_a_global_mini_batch_holds_the_same_documents_on_any_world_size_and_resumes_across_them(tok, tmp_path):
    """Global mini-batch of 4 documents: 2 ranks x 2 x 1 accumulation, or 1 rank x 2 x 2 accumulation (what an
    elastic resume turns one into). The mini-batches hold the same documents in the same order, and a position saved
    by 2 ranks loads strictly on 1 (and back) and continues with the uninterrupted run's next mini-batch."""
    data = load_ptx_data(_txt(tmp_path / "u.txt", [f"document number {i} of many" for i in range(10)]), tok, 64)
    pad = tok.pad_token_id
    assert [b.input_ids.shape[0] for b in PtxData(data, 2, 2, 0, 1, 5, pad).next_mini_batch("cpu")] == [2, 2]
    one = PtxData(data, 2, 2, 0, 1, seed=5, pad_token_id=pad)
    two = [PtxData(data, 2, 1, r, 2, seed=5, pad_token_id=pad) for r in range(2)]
    for _ in range(5):  # two epochs of 2 mini-batches and one more: the epoch boundary too
        assert _documents(one) == _documents(two[0]) + _documents(two[1])
    state = two[0].cursor.state_dict()
    resumed = PtxData(data, 2, 2, 0, 1, seed=5, pad_token_id=pad)
    resumed.cursor.load_state_dict(state)  # strict: the global mini-batch is the same
    back = [PtxData(data, 2, 1, r, 2, seed=5, pad_token_id=pad) for r in range(2)]
    for b in back:
        b.cursor.load_state_dict(one.cursor.state_dict())
    assert _documents(resumed) == _documents(one) == _documents(back[0]) + _documents(back[1])
    # negative control: another global mini-batch is another data order, refused without --resume_force
    other = PtxData(data, 2, 1, 0, 1, seed=5, pad_token_id=pad)
    with pytest.raises(ConfigError, match="cannot resume the data position"):
        other.cursor.load_state_dict(state)


def test_ptx_loss_is_a_token_mean_over_the_whole_mini_batch(tok, engine1, tmp_path):
    data = load_ptx_data(_txt(tmp_path / "u.txt", DOCS), tok, 64)
    micro = [collate_ptx(data, [0, 1], tok.pad_token_id), collate_ptx(data, [2, 3], tok.pad_token_id)]
    n = sum(b.num_tokens for b in micro).float()
    total = sum(ptx_loss(engine1, b, n)[0] for b in micro)
    # by hand: each document alone, unpadded, nll summed over tokens 1.., divided by every document's count
    nll, count = 0.0, 0
    model = engine1.actor.module
    with torch.no_grad():
        for ids in data.input_ids:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits
            nll -= logprobs_from_logits(logits[:, :-1], x[:, 1:]).sum().item()
            count += len(ids) - 1
    assert count == int(n)
    assert abs(total.item() - nll / count) < 1e-5, (total.item(), nll / count)


PTX = dict(per_device_generation_batch_size=4, per_device_training_batch_size=2, gradient_accumulation_steps=2,
           ppo_epochs=2, seed=9, actor_learning_rate=1e-3, critic_learning_rate=1e-3, export_final="false")


def _run(tiny, out, steps, **flags):
    trainer = build_trainer(parse_args(train_args(tiny, str(out), max_steps=steps, **{**PTX, **flags})))
    records = [trainer.step() for _ in range(steps)]
    trainer.metrics.close()
    params = {role: {k: v.clone() for k, v in trainer.engine.engines[role].module.state_dict().items()}
              for role in ("actor", "critic")}
    return trainer, records, params


def test_unsup_coef_zero_reproduces_the_run_without_ptx_exactly(tiny, dist_single, tmp_path):
    docs = _txt(tmp_path / "u.txt", DOCS)
    _, plain, p_plain = _run(tiny, tmp_path / "plain", 2)
    trainer, zero, p_zero = _run(tiny, tmp_path / "zero", 2, unsupervised_dataset_name=docs, unsup_coef=0.0)
    assert "ptx_data" in trainer.state_providers and trainer.state_providers["ptx_data"] is trainer.ptx.cursor
    assert trainer.ptx.cursor.consumed == 2 * 2  # iterations x epochs, one mini-batch each (a draw per mini-batch)
    for a, b in zip(plain, zero):
        assert b["ptx/loss"] > 0 and b["ptx/tokens"] > 0  # the ptx forward ran and was logged
        strip = lambda r: {k: v for k, v in r.items() if not k.startswith(VOLATILE + ("ptx/",))}  # noqa: E731
        assert strip(a) == strip(b)
    for role in ("actor", "critic"):
        assert all(torch.equal(p_plain[role][k], p_zero[role][k]) for k in p_plain[role]), role


def test_ptx_loss_falls_on_repeated_data(tiny, dist_single, tmp_path):
    docs = _txt(tmp_path / "u.txt", DOCS)  # 4 documents, 2 per micro-batch: the same ones again and again
    _, recs, _ = _run(tiny, tmp_path / "on", 4, unsupervised_dataset_name=docs, unsup_coef=1.0)
    losses = [r["ptx/loss"] for r in recs]
    assert losses[-1] < losses[0] - 0.5, losses  # measured: 6.16 -> 5.36 nats/token
    # negative control: the same run with unsup_coef 0 (PPO alone moves the actor) leaves the LM loss about flat
    _, recs, _ = _run(tiny, tmp_path / "off", 4, unsupervised_dataset_name=docs, unsup_coef=0.0)
    control = [r["ptx/loss"] for r in recs]
    assert abs(control[-1] - control[0]) < 0.2, control  # measured: 6.28 -> 6.26


def test_ptx_position_and_reward_normalizer_are_checkpointed_and_resume_exactly(tiny, dist_single, tmp_path):
    docs = _txt(tmp_path / "u.txt", [f"document {i}: " + DOCS[i % 4] for i in range(10)])
    flags = dict(unsupervised_dataset_name=docs, unsup_coef=1.0, normalize_reward="true", save_interval=1,
                 keep_last=0)
    a = build_trainer(parse_args(train_args(tiny, str(tmp_path / "a"), max_steps=2, **{**PTX, **flags})))
    a.step()
    a.checkpointer.after_iteration(a.iteration)  # iteration 1's checkpoint
    saved = {"ptx": a.ptx.cursor.state_dict(), "norm": a.shaper.normalizer.state_dict()}
    assert saved["ptx"]["consumed"] == 2 and saved["norm"]["count"] == 4  # 2 epochs x 1 mini-batch drawn
    straight = a.step()
    a.metrics.close()
    ckpt = os.path.join(str(tmp_path / "a"), "checkpoints", "iter_000001")
    b = build_trainer(parse_args(train_args(tiny, str(tmp_path / "b"), max_steps=2, resume=ckpt,
                                            **{**PTX, **flags})))
    assert b.iteration == 1
    assert b.ptx.cursor.state_dict() == saved["ptx"] and b.shaper.normalizer.state_dict() == saved["norm"]
    resumed = b.step()
    b.metrics.close()
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(VOLATILE)}  # noqa: E731
    assert strip(resumed) == strip(straight)  # ptx/loss included: the same documents in the same order
