"""The lean backend against the Hugging Face one (the reference): fp32 greedy outputs identical, sampled frequencies
of a model whose next-token distribution is fixed by construction equal to the hand-computed softmax, the stop and
length rules, and its generation-time log-probs. The ZeRO-3 modes (replica, gathered, per-layer in lockstep) run on
2 ranks: tests/distributed/test_engine_extensions.py."""
import dataclasses
import math

import pytest
import torch
from _support import Z, as_flags, fixed_model, z_logits

from rlhf_engine.cli import parse_args
from rlhf_engine.engine import RLHFEngine
from rlhf_engine.engine.generation import BACKENDS, SamplingParams
from rlhf_engine.engine.preflight import plan_engine
from rlhf_engine.rollout import pad_prompts

P_Z, VOCAB = 0.6, 512


def make_engine(actor, reward, prompts, out, dist, **flags) -> RLHFEngine:
    base = dict(actor_model_name_or_path=actor, reward_model_name_or_path=reward, data_path=prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, output_dir=str(out), generation_backend="lean")
    cfg = parse_args(as_flags({**base, **flags}))
    return RLHFEngine(cfg, dist, plan_engine(cfg, 1))


def prompts_of(engine, n: int):
    """n left-padded prompts of different lengths (3 .. 3 + n - 1 tokens)."""
    rows = [[(7 * i + 11 * j) % 400 + 20 for j in range(3 + i)] for i in range(n)]
    return pad_prompts(rows, engine.pad_token_id)


@pytest.fixture(scope="module")
def pair(tiny, dist_single, tmp_path_factory):
    e = make_engine(tiny.actor, tiny.reward, tiny.prompts, tmp_path_factory.mktemp("lean"), dist_single)
    return e, BACKENDS["hf"](e.generator.ctx)


def greedy_with_stops(e, ids, mask, min_new: int = 0):
    """Greedy parameters whose stop tokens are tokens the model does produce greedily (the last token of row 0 and
    the first of row 2, so that responses end at different lengths; the random tiny model repeats tokens and rarely
    meets a fixed stop list)."""
    free = dataclasses.replace(e.sampling.greedy(), stop_token_ids=(), min_new_tokens=0)
    r = e.generator.generate(ids, mask, free).rollout.responses
    return dataclasses.replace(free, stop_token_ids=(int(r[0, -1]), int(r[2, 0])), min_new_tokens=min_new)


def test_lean_is_the_default_backend(pair):
    assert pair[0].generator.name == "lean"


@pytest.mark.parametrize("min_new", [0, 2])
def test_fp32_greedy_outputs_are_identical_to_hugging_face(pair, min_new):
    e, hf = pair
    ids, mask = prompts_of(e, 6)
    params = greedy_with_stops(e, ids, mask, min_new)
    lean_out, hf_out = e.generator.generate(ids, mask, params), hf.generate(ids, mask, params)
    a, b = lean_out.rollout, hf_out.rollout
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.attention_mask, b.attention_mask)
    assert a.response_lengths.tolist() == b.response_lengths.tolist()
    lengths = a.response_lengths
    assert int(lengths.min()) >= max(min_new, 1) and bool(a.ended_with_eos.any())  # stop tokens did end responses
    if not min_new:
        assert lengths[2] == 1 and lengths[0] < 8 and int(lengths.max()) == 8
    assert torch.allclose(lean_out.logprobs, hf_out.logprobs, atol=1e-5, rtol=0)
    if not min_new:  # (the engine's forwards mask its own stop tokens under its own min_answer_seq_len, here 0)
        # generation-time log-probs equal the recomputed ones of the full forward (what PPO scores)
        assert torch.allclose(lean_out.logprobs, e.actor_logprobs(a), atol=1e-5, rtol=0)


def test_the_length_limit_and_the_padding_after_a_stop(pair):
    e, hf = pair
    ids, mask = prompts_of(e, 4)
    params = dataclasses.replace(greedy_with_stops(e, ids, mask), max_new_tokens=3, min_new_tokens=0)
    r = e.generator.generate(ids, mask, params).rollout
    assert r.response_width <= 3 and torch.equal(r.sequences, hf.generate(ids, mask, params).rollout.sequences)
    pad = r.responses.masked_select(r.action_mask == 0)
    assert bool((pad == e.pad_token_id).all())


@pytest.fixture(scope="module")
def fixed(tiny, dist_single, tmp_path_factory):
    """An engine whose actor gives token Z probability 0.6 at every position (the rest uniform)."""
    root = tmp_path_factory.mktemp("fixed_lean")
    model = fixed_model(tiny, str(root / "model"), z_logits(VOCAB, P_Z), {})
    e = make_engine(model, model, "", root / "out", dist_single, critic_init_from="actor", max_answer_seq_len=6)
    return e, BACKENDS["hf"](e.generator.ctx)


def _z_share(backend, e, temperature: float, rows: int = 500) -> tuple[float, int]:
    ids, mask = prompts_of(e, 1)
    params = dataclasses.replace(e.sampling, temperature=temperature)
    r = backend.generate(ids.repeat(rows, 1), mask.repeat(rows, 1), params).rollout
    real = r.action_mask.bool()
    return float((r.responses[real] == Z).double().mean()), int(real.sum())


def _p_z(temperature: float) -> float:
    """Hand-computed p(Z) under softmax(logits / T): Z's logit is a, the other VOCAB - 1 logits are 0."""
    a = math.log(P_Z) - math.log((1 - P_Z) / (VOCAB - 1))
    return 1.0 / (1.0 + (VOCAB - 1) * math.exp(-a / temperature))


@pytest.mark.parametrize("name", ["lean", "hf"])
def test_sampled_frequencies_match_the_fixed_distribution(fixed, name):
    e, hf = fixed
    backend = e.generator if name == "lean" else hf
    torch.manual_seed(3)
    for temperature in (1.0, 0.8):
        share, n = _z_share(backend, e, temperature)
        p = _p_z(temperature)
        bound = 5 * math.sqrt(p * (1 - p) / n)  # 5 binomial standard deviations (about 0.03 with 3000 draws)
        assert abs(share - p) <= bound, (name, temperature, share, p, bound)
    # negative control: temperature 0.8's frequencies (p 0.877) fail the same check against temperature 1's (0.6)
    assert abs(share - _p_z(1.0)) > 5 * bound


def test_trimmed_forwards_equal_the_full_ones(pair):
    """trim_padding: the engine's forwards on a batch whose rows pad differently give the full batch's numbers at
    every real token (fp32 kernel rounding apart) and 0 on padding."""
    e, _ = pair
    ids, mask = prompts_of(e, 6)
    r = e.generator.generate(ids, mask, greedy_with_stops(e, ids, mask)).rollout.select([0, 2])  # lengths 6 and 1
    t = r.trimmed()
    assert t.prompt_length < r.prompt_length and t.response_width < r.response_width
    out, saved = {}, e.trim_padding
    for trim in (True, False):
        e.trim_padding = trim
        out[trim] = (e.actor_logprobs(r, with_entropy=True), e.critic_values(r), e.reward_scores(r))
    e.trim_padding = saved
    for a, b in zip(out[True][0] + out[True][1:], out[False][0] + out[False][1:]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0), (a - b).abs().max()
    assert float(out[True][0][0][1, 1:].abs().max()) == 0.0  # padding after row 2's one-token response


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["tiny", "tiny_llama"])
def test_prepared_decode_masks_equal_the_models_own(request, monkeypatch, arch, attn):
    """The decode steps' 4D masks, built once, give the log-probs and tokens of the 2D masks the model expands
    itself at every step (left-padded prompts, sampled, fp32); a mask that ignores the padding does not."""
    from transformers import AutoModelForCausalLM

    from rlhf_engine.engine.generation import lean

    setup = request.getfixturevalue(arch)
    model = AutoModelForCausalLM.from_pretrained(setup.actor, attn_implementation=attn).eval()
    ids, mask = pad_prompts([[(5 * i + 3 * j) % 300 + 20 for j in range(2 + 3 * i)] for i in range(4)], 0)
    params = SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0, do_sample=True, top_k=0,
                            top_p=1.0, stop_token_ids=(), pad_token_id=0)

    def decode(masks):
        monkeypatch.setattr(lean, "decode_step_masks", masks)
        torch.manual_seed(0)
        with torch.no_grad():
            return lean.LeanBackend._decode(None, model, ids, mask, torch.tensor([], dtype=torch.long), params, False)

    build = lean.decode_step_masks
    prepared = build(model, torch.cat([mask, mask.new_ones(4, 6)], 1))
    assert prepared is not None and prepared.shape == (4, 1, 1, ids.shape[1] + 6)
    ours, own = decode(build), decode(lambda m, f: None)
    assert torch.equal(ours[0], own[0]) and torch.allclose(ours[1], own[1], atol=1e-6, rtol=0), \
        (ours[1] - own[1]).abs().max()
    everything = decode(lambda m, f: build(m, torch.ones_like(f)))  # negative control
    assert (everything[1] - own[1]).abs().max() > 1e-3
