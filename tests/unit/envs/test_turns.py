"""Token in, token out: the chat template's turn wrapping read from the template, stop strings cut on sampled ids."""
import pytest
from transformers import AutoTokenizer

from rlhf_engine.envs import TurnFormat, cut_at_stop_strings
from rlhf_engine.envs.turns import wrapping

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chatml(tiny):
    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def test_wrapping_read_from_the_template(chatml):
    assert wrapping(chatml) == ("<|im_end|>\n", "<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")


def test_a_template_that_rewrites_earlier_turns_is_refused(chatml, tiny):
    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    # drops every assistant turn but the last: not append-only
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}{{ m['role'] }}: "
                         "{{ m['content'] }}\n{% endif %}{% endfor %}")
    with pytest.raises(ValueError, match="not append-only"):
        wrapping(tok)


def test_episode_is_the_template_of_the_whole_conversation(chatml):
    turns = TurnFormat(chatml, chat=True)
    end = chatml.convert_tokens_to_ids("<|im_end|>")
    prompt = turns.first_prompt("What is 12*7?")
    t1 = turns.encode("I will use <calc>12*7</calc>") + [end]  # the model closed its turn with its stop token
    ctx = turns.context("<result>84</result>", closed_by=end)
    t2 = turns.encode("84")  # cut by the length: no stop token, the close is context
    ctx2 = turns.context("thanks", closed_by=None)
    episode = prompt + t1 + ctx + t2 + ctx2
    conversation = [{"role": "user", "content": "What is 12*7?"},
                    {"role": "assistant", "content": "I will use <calc>12*7</calc>"},
                    {"role": "user", "content": "<result>84</result>"},
                    {"role": "assistant", "content": "84"},
                    {"role": "user", "content": "thanks"}]
    text = chatml.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert chatml.decode(episode) == text
    # the model's ids are the tokenizer's own here, so the ids agree too
    assert episode == chatml(text, add_special_tokens=False)["input_ids"]
    # negative control: a close that ignored the model's own stop token would hold <|im_end|> twice
    assert "<|im_end|><|im_end|>" in chatml.decode(prompt + t1 + turns.context("<result>84</result>", closed_by=None))


def test_plain_prompts_append_the_observation_as_text(tiny):
    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    turns = TurnFormat(tok, chat=False)
    assert turns.context(" result 4", closed_by=0) == tok(" result 4", add_special_tokens=False)["input_ids"]
    assert turns.context(None, closed_by=None) == []


def test_cut_at_stop_strings_keeps_a_prefix_of_the_sample(tiny):
    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    ids = tok("x <calc>1+2</calc> and more", add_special_tokens=False)["input_ids"]
    k = cut_at_stop_strings(tok, ids, ["</calc>"])
    assert tok.decode(ids[:k]).endswith("</calc>") or "</calc>" in tok.decode(ids[:k])
    assert "</calc>" not in tok.decode(ids[:k - 1])
    assert cut_at_stop_strings(tok, ids, ["<never>"]) == len(ids)
    assert cut_at_stop_strings(tok, ids, []) == len(ids)
