"""The reference server's reward model scores the same rollouts as the in-process reward engine, within 1e-5: on the
actor's own ids (the server `python -m rlhf_engine.rewards.serve --reward_model` builds, here in-process), for a
reward model with its own vocabulary (the text re-encoded) and through its chat template, where both are also checked
against inputs built in the test by the tokenizer's own calls (both sides share reward_inputs). Both sides are the
trainer's real paths: `experience.score_rollout` with the reward engine (or the re-tokenizing scorer) against the same
function with `--reward_url`'s client. Rows end at EOS (== pad), at another stop token, or are cut at the length
limit."""
import json
import os
import shutil
import threading

import pytest
import torch

from rlhf_engine.rewards import RemoteReward
from rlhf_engine.rollout import PromptRow, Rollout, pad_prompts
from rlhf_engine.trainer.experience import decode_rollout, score_rollout, text_reward
from rlhf_engine.trainer.reward_shaping import RetokenizedRewardModel, reward_model_scorer

from _support import as_flags

OTHER_STOP = 7  # a second stop token besides EOS


def _engine(tiny, out, **flags):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine

    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=9, output_dir=out, advantage_estimator="grpo",
                n_samples_per_prompt=2, stop_token_ids=[0, OTHER_STOP])
    base.update(flags)
    cfg = parse_args(as_flags(base))
    from rlhf_engine.engine import init_distributed

    return RLHFEngine(cfg, init_distributed(), plan_engine(cfg, 1)), cfg


def _rollout(engine, tiny, n=7, seed=0):
    """n prompts of the data (uneven lengths: left padding) with random responses: row 0 ends at EOS after 3 tokens,
    row 1 is EOS alone, row 2 ends at the other stop token, the rest are cut at 9 tokens."""
    tok = engine.tokenizer
    texts = [json.loads(line)["prompt"] for line in open(tiny.prompts)][:n]
    ids, mask = pad_prompts([tok(t)["input_ids"] for t in texts], engine.pad_token_id)
    gen = torch.randint(OTHER_STOP + 1, len(tok), (n, 9), generator=torch.Generator().manual_seed(seed))
    gen[0, 2] = gen[1, 0] = tok.eos_token_id
    gen[2, 4] = OTHER_STOP
    r = Rollout.from_generation(ids, mask, gen, engine.stop_token_ids, engine.pad_token_id)
    assert r.ended_with_eos.tolist() == [True] * 3 + [False] * (n - 3) and ids.shape[1] > min(mask.sum(-1))
    return r.with_rows([PromptRow(t, {}) for t in texts])


def _serve(scorer):
    from rlhf_engine.rewards.serve import make_server

    server = make_server(scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}/score"


def test_served_scores_equal_the_reward_engine_on_the_actors_ids(tiny, dist_single, tmp_path):
    from rlhf_engine.rewards.scorers import ModelScorer

    engine, _ = _engine(tiny, str(tmp_path))
    rollout = _rollout(engine, tiny)
    in_process = score_rollout(rollout, lambda p, r: engine.reward_scores(r))  # the reward engine: RLHFEngine.reward_scores
    server, url = _serve(ModelScorer(tiny.reward, batch_size=3))  # what --reward_model builds; 3 + 3 + 1 rows
    try:
        client = RemoteReward(url, timeout_s=60, retries=0)
        served = score_rollout(rollout, text_reward(client, engine.tokenizer))
        # negative control: the text alone (all the server got before the ids travelled) scores differently here,
        # where pad == EOS and the decoded response has lost its stop token
        prompts, responses = decode_rollout(engine.tokenizer, rollout, keep_special_prompt=True)
        text_only = torch.tensor(client(prompts, responses))
    finally:
        server.shutdown()
        server.server_close()
    assert (served - in_process).abs().max() < 1e-5, (served, in_process)
    assert in_process.max() - in_process.min() > 1e-2  # the rows score differently: equality is not trivial
    assert (text_only - in_process).abs().max() > 1e-2


@pytest.fixture(scope="module")
def other_vocab_rm(tiny):
    """A reward model with its own tokenizer (300 tokens instead of 512) in its folder, and a copy whose tokenizer
    has a chat template."""
    from transformers import AutoTokenizer

    from rlhf_engine.assets import build_tiny_model, train_tiny_tokenizer

    root = os.path.join(tiny.root, "served_other_vocab")
    model, chat = os.path.join(root, "model"), os.path.join(root, "chat")
    if not os.path.isdir(chat):
        tok = train_tiny_tokenizer(os.path.join(root, "tok"), vocab_size=300, pad_is_eos=True)
        build_tiny_model(model, tok, arch="gpt2", head="score", dropout=0.0, seed=4)
        shutil.copytree(model, chat)
        rtok = AutoTokenizer.from_pretrained(model)
        rtok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|endoftext|>{% endfor %}"
                              "{% if add_generation_prompt %}[assistant]{% endif %}")
        rtok.save_pretrained(chat)
    return model, chat


def test_a_reward_model_with_its_own_vocabulary_or_chat_template_is_served_as_the_engine_scores_it(
        tiny, other_vocab_rm, dist_single, tmp_path):
    from rlhf_engine.cli import parse_args
    from rlhf_engine.rewards.scorers import ModelScorer

    model, chat = other_vocab_rm
    engine, cfg = _engine(tiny, str(tmp_path), reward_model_name_or_path=model, reward_tokenizer_name_or_path=model)
    chat_cfg = parse_args(as_flags(dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=model,
                                        reward_tokenizer_name_or_path=chat, reward_use_chat_template="true",
                                        data_path=tiny.prompts, output_dir=str(tmp_path))))
    rollout = _rollout(engine, tiny, seed=1)
    for config, folder, chat_template in ((cfg, model, False), (chat_cfg, chat, True)):
        scorer = reward_model_scorer(engine, config)  # the trainer's scorer of such a reward model
        assert isinstance(scorer, RetokenizedRewardModel) and scorer.use_chat_template == chat_template
        in_process = score_rollout(rollout, scorer)
        server, url = _serve(ModelScorer(folder, batch_size=4, use_chat_template=chat_template))
        try:
            served = score_rollout(rollout, text_reward(RemoteReward(url, timeout_s=60, retries=0),
                                                                engine.tokenizer))
        finally:
            server.shutdown()
            server.server_close()
        assert (served - in_process).abs().max() < 1e-5, (chat_template, served, in_process)
        assert in_process.max() - in_process.min() > 1e-2
        # both sides build their inputs with reward_inputs: check them against inputs built here, by the tokenizers'
        # own __call__ / apply_chat_template and a forward of one unpadded sequence per row
        by_hand = _scores_by_hand(folder, rollout, engine.tokenizer, chat_template)
        assert (in_process - by_hand).abs().max() < 1e-5, (chat_template, in_process, by_hand)


def _scores_by_hand(folder, rollout, actor_tok, chat_template):
    """What the docs say a reward model with its own tokenizer scores (docs/rewards.md), built without
    rlhf_engine: the prompt decoded without special tokens and encoded with the reward tokenizer's own, the response
    text encoded without, the reward tokenizer's EOS where the response ended at a stop token; or [user: the row's text, assistant: the
    response] through the chat template. The score: the head at the last token of the unpadded sequence."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rtok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    P, out = rollout.prompt_length, []
    for i in range(rollout.sequences.shape[0]):
        real = rollout.attention_mask[i].bool()
        prompt_ids = rollout.sequences[i, :P][real[:P]].tolist()
        n = int(rollout.response_lengths[i])
        ended = bool(rollout.ended_with_eos[i])
        # the response as reward functions read it: every token decoded, special ones skipped (an EOS goes, a stop
        # token that is an ordinary token stays as text)
        response = actor_tok.decode(rollout.sequences[i, P:P + n].tolist(), skip_special_tokens=True)
        if chat_template:
            ids = rtok.apply_chat_template([{"role": "user", "content": rollout.rows[i].text},
                                            {"role": "assistant", "content": response}], tokenize=True,
                                           return_dict=False)
        else:
            prompt = actor_tok.decode(prompt_ids, skip_special_tokens=True)
            ids = (rtok(prompt)["input_ids"] + rtok(response, add_special_tokens=False)["input_ids"]
                   + ([rtok.eos_token_id] if ended else []))
        assert len(ids) <= model.config.n_positions  # no truncation rule involved
        with torch.no_grad():
            hidden = model.transformer(torch.tensor([ids])).last_hidden_state
            out.append(float(model.score(hidden)[0, -1, 0]))
    return torch.tensor(out)
