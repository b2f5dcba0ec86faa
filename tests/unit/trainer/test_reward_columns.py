"""The calling rule through the trainer: a reward function taking a data column receives, for every sample (each of
a prompt's N samples alike), its row's value and the prompt as the model saw it (chat template and special tokens
kept); a plain two-argument function is called as before; a missing column stops the run before any engine."""
import json
import os

import pytest
from _trainer_args import train_args
from transformers import AutoTokenizer

from rlhf_engine.cli import parse_args
from rlhf_engine.trainer import build_trainer

import launch.train_ppo as train_ppo

CALLS = []
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant:{% endif %}")


def with_answer(prompts, responses, answer):
    CALLS.append((list(prompts), list(answer)))
    return [float(len(r)) for r in responses]


def plain(prompts, responses):
    CALLS.append((list(prompts), None))
    return [0.0] * len(responses)


def needs_solution(prompts, responses, solution):
    return [0.0] * len(responses)


@pytest.fixture(scope="module")
def chat_setup(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = AutoTokenizer.from_pretrained(tiny.actor)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(root / "tok"))
    raw = [json.loads(line)["prompt"] for line in open(tiny.prompts)][:16]
    (root / "p.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "gold:" + p}) + "\n" for p in raw))
    return str(root / "tok"), str(root / "p.jsonl")


def _run(tiny, chat_setup, out, fn):
    tok_dir, data = chat_setup
    args = train_args(tiny, out, data_path=data, actor_tokenizer_name_or_path=tok_dir, use_chat_template="true",
                      max_prompt_seq_len=96,
                      reward_fn=f"test_reward_columns:{fn}", n_samples_per_prompt=2, advantage_estimator="grpo",
                      per_device_generation_batch_size=4, per_device_training_batch_size=4,
                      gradient_accumulation_steps=1, max_steps=1, export_final="false", eval_interval=1,
                      eval_split=0.25)
    args = [a for a in args if a not in ("--reward_model_name_or_path", tiny.reward)]
    CALLS.clear()
    trainer = build_trainer(parse_args(args), args)
    trainer.step()
    trainer.metrics.close()
    return trainer


def test_columns_and_templated_prompts_reach_the_reward_function(tiny, chat_setup, tmp_path, dist_single,
                                                                 monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    trainer = _run(tiny, chat_setup, str(tmp_path / "cols"), "with_answer")
    assert [len(p) for p, _ in CALLS] == [4, 8]  # the evaluation before iteration 0 (4 held-out prompts), training
    tok = trainer.engine.tokenizer
    for prompts, answers in CALLS:
        for prompt, answer in zip(prompts, answers, strict=True):
            raw = answer[len("gold:"):]
            rendered = tok.apply_chat_template([{"role": "user", "content": raw}], tokenize=False,
                                               add_generation_prompt=True)
            assert prompt == tok.decode(tok(rendered, add_special_tokens=False)["input_ids"])  # as the model saw it
            assert prompt.startswith("<s>user: ")  # special tokens kept
    _, answers = CALLS[1]
    assert answers[0::2] == answers[1::2] and len(set(answers)) == 4  # each prompt's 2 samples, its own row
    # the legacy form: the same prompts, decoded without special tokens, no columns
    _run(tiny, chat_setup, str(tmp_path / "plain"), "plain")
    plain_prompts, none = CALLS[1]
    assert none is None and all("<s>" not in p and p.startswith("user: ") for p in plain_prompts)


def test_a_missing_column_is_an_error_before_any_engine(tiny, chat_setup, tmp_path, capsys, dist_single,
                                                        monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    out = tmp_path / "run"
    rc = train_ppo.main(train_args(tiny, str(out), data_path=chat_setup[1],
                                   reward_fn="test_reward_columns:needs_solution", reward_model_name_or_path=""))
    err = capsys.readouterr().err
    assert rc == 2 and "reward_fn" in err and "['solution']" in err and "'answer'" in err
    assert not out.exists()
