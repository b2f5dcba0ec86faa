"""Packed forwards equal padded forwards (log-probs, entropy, values, scores, and the training forward's gradients)
for GPT-2 (absolute positions), OPT (learned positions with an offset) and Llama (rotary), on real engines; the
start-up probe refuses a model whose head the packed path does not reproduce, and catches positions that do not
restart.

Tolerance: fp32, FP32_ATOL. The packed rows run other GEMM shapes than the padded ones (a row holds several
sequences, and the head runs on the gathered response positions only), so sums are taken in another order: a few
ulps of values of size ~1-10 (1 ulp of 8 is 9.5e-7)."""
import pytest
import torch

from _support import make_tiny_setup, ppo_args
from rlhf_engine.cli import parse_args
from rlhf_engine.data.prompts import collate_prompts, load_prompt_dataset
from rlhf_engine.engine import RLHFEngine
from rlhf_engine.engine.preflight import plan_engine
from rlhf_engine.errors import ConfigError

FP32_ATOL = 2e-5


@pytest.fixture(scope="module", params=["gpt2", "opt", "llama"])
def engines(request, tmp_path_factory, dist_single):
    tiny = make_tiny_setup(str(tmp_path_factory.mktemp(f"pk_{request.param}")), arch=request.param,
                           pad_is_eos=request.param == "gpt2", n_prompts=8)
    out = {}
    for packing in ("off", "on"):
        cfg = parse_args(ppo_args(tiny, str(tmp_path_factory.mktemp("out")), packing=packing,
                                  critic_init_from="reward", seed=3))
        out[packing] = RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))
    ds = load_prompt_dataset(tiny.prompts, out["off"].tokenizer, 64)
    ids, mask = collate_prompts(ds, list(range(8)), out["off"].pad_token_id)
    torch.manual_seed(0)
    rollout = out["off"].generate(ids, mask)
    lengths = rollout.response_lengths.tolist()
    assert min(lengths) < max(lengths) and rollout.attention_mask[:, :rollout.prompt_length].min() == 0
    return request.param, out, rollout


def test_the_probe_says_yes_and_rows_are_packed(engines):
    arch, e, rollout = engines
    assert e["on"].packing and not e["off"].packing, arch
    e["on"].take_slot_counts()
    e["on"].critic_values(rollout)
    c = e["on"].take_slot_counts()
    assert c["real"] < c["packed"] < c["padded"], c  # padding left, but less of it


def test_experience_forwards_agree(engines):
    arch, e, rollout = engines
    for name, fn in (("actor", lambda x: x.actor_logprobs(rollout, with_entropy=True)),
                     ("reference", lambda x: (x.ref_logprobs(rollout),)),
                     ("critic", lambda x: (x.critic_values(rollout),)),
                     ("reward", lambda x: (x.reward_scores(rollout),))):
        for a, b in zip(fn(e["off"]), fn(e["on"])):
            assert a.shape == b.shape
            assert float((a - b).abs().max()) <= FP32_ATOL, (arch, name, float((a - b).abs().max()))
    off = ~rollout.action_mask.bool()
    assert e["on"].actor_logprobs(rollout)[off].abs().sum() == 0


def test_training_forward_and_gradients_agree(engines):
    arch, e, rollout = engines
    grads = {}
    for k in ("off", "on"):
        lp, _ = e[k].actor_forward(rollout)
        e[k].actor.module.zero_grad(set_to_none=True)
        e[k].backward("actor", lp.sum() / rollout.action_mask.sum())
        grads[k] = {n: p.grad.clone() for n, p in e[k].actor.module.named_parameters() if p.grad is not None}
        e[k].actor.module.zero_grad(set_to_none=True)
    assert grads["on"].keys() == grads["off"].keys() and grads["on"]
    worst = max(float((grads["on"][n] - grads["off"][n]).abs().max()) for n in grads["on"])
    assert worst <= FP32_ATOL, (arch, worst)


def test_negative_control_positions_that_do_not_restart_are_caught(engines, monkeypatch):
    """The probe compares packed and padded forwards: packed rows whose positions run on across sequences (what
    packing without restarting the position ids would give) fail it. Not for Llama alone: rotary attention depends
    on relative positions only, so continuing positions change nothing there, rightly."""
    arch, e, _ = engines
    from rlhf_engine.engine import packed_forward

    real = packed_forward.packed_inputs

    def continuing(packed, input_ids, position_ids, dtype):
        inputs = real(packed, input_ids, position_ids, dtype)
        N, W = inputs["position_ids"].shape
        inputs["position_ids"] = torch.arange(W).expand(N, W)
        return inputs

    monkeypatch.setattr(packed_forward, "packed_inputs", continuing)
    works = packed_forward.packing_works(e["off"].actor.module)
    assert works is (arch == "llama"), arch


def test_a_head_the_packed_path_does_not_reproduce_is_refused(tiny, dist_single, tmp_path):
    """Gemma 2 soft-caps its logits after the head: packing on is refused naming the model, auto turns it off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma2Config

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    config = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, head_dim=16, final_logit_softcapping=0.5,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    path = str(tmp_path / "gemma2")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    flags = dict(actor_model_name_or_path=path, reward_fn="rlhf_engine.rewards.sentiment:vader_positive",
                 reward_model_name_or_path="", critic_init_from="actor")
    cfg = parse_args(ppo_args(tiny, str(tmp_path / "on"), packing="on", **flags))
    with pytest.raises(ConfigError, match=r"packing.*actor model \(gemma2\)"):
        RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))
    cfg = parse_args(ppo_args(tiny, str(tmp_path / "auto"), packing="auto", **flags))
    assert not RLHFEngine(cfg, dist_single, plan_engine(cfg, 1)).packing


# ---- sliding-window attention: our packed mask has no window -------------------------------------------------------
WINDOW = 8


def windowed_config(kind: str, window=WINDOW, vocab_size: int = 128):
    """A tiny config of a model family that can attend within a sliding window (`kind` says how it is set)."""
    from transformers import Gemma3TextConfig, MistralConfig, Qwen2Config

    size = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)
    return {"mistral": lambda: MistralConfig(sliding_window=window, **size),
            "mistral_none": lambda: MistralConfig(sliding_window=None, **size),
            "qwen2": lambda: Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=0, **size),
            "qwen2_unused": lambda: Qwen2Config(use_sliding_window=False, sliding_window=window, **size),
            # windowed from layer max_window_layers = 2 on: no layer of 2 slides
            "qwen2_no_layer": lambda: Qwen2Config(use_sliding_window=True, sliding_window=window, max_window_layers=2,
                                                  **size),
            "gemma3": lambda: Gemma3TextConfig(sliding_window=window, head_dim=8, **size)}[kind]()


def tiny_lm(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("kind,window", [("mistral", WINDOW), ("mistral_none", None), ("qwen2", WINDOW),
                                         ("qwen2_unused", None), ("qwen2_no_layer", None), ("gemma3", WINDOW)])
def test_the_window_read_from_the_config_is_the_one_the_model_uses(kind, window):
    """`sliding_window` against the model's own behaviour: where it reads a window, packed and padded forwards of a
    sequence twice as long disagree (the padded one applies the window, our mask does not); where it reads none, they
    agree. Within the window every model agrees."""
    from rlhf_engine.engine.packed_forward import PROBE_ATOL, packing_gap
    from rlhf_engine.packing import sliding_window

    config = windowed_config(kind)
    assert sliding_window(config) == window, kind
    model = tiny_lm(config)
    assert packing_gap(model, longest=WINDOW) <= FP32_ATOL, kind
    past = packing_gap(model, longest=2 * WINDOW)
    assert (past > 10 * PROBE_ATOL) if window else (past <= FP32_ATOL), (kind, past)


def test_the_probe_is_capped_for_its_start_up_memory_and_the_cap_still_catches_a_window():
    """A run whose longest sequence is 8k tokens probes at PROBE_MAX_TOKENS (its full-vocabulary logits, [2, n, V],
    are allocated at start-up); below the cap it probes at the run's length, and the model's positions bound it."""
    from transformers import MistralConfig

    from rlhf_engine.engine.packed_forward import PROBE_MAX_TOKENS, PROBE_ATOL, packing_gap, probe_lengths

    size = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
    long_model = tiny_lm(MistralConfig(sliding_window=None, max_position_embeddings=16384, **size))
    assert PROBE_MAX_TOKENS == 512 and probe_lengths(long_model, longest=8192) == (512, 128)
    assert probe_lengths(long_model, longest=100) == (100, 25)
    short = tiny_lm(MistralConfig(sliding_window=None, max_position_embeddings=300, **size))
    assert probe_lengths(short, longest=8192) == (300, 75)
    # a window under the cap is still seen (refused: past PROBE_ATOL) at the capped length; one past it is not
    windowed = tiny_lm(MistralConfig(sliding_window=256, max_position_embeddings=16384, **size))
    assert packing_gap(windowed, longest=8192) > PROBE_ATOL


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_packed_rows_differ_from_padded_past_the_window_and_the_window_is_why(kind):
    """What the refusal prevents, computed without the probe: a 2W-token sequence and a 5-token one (left-padded),
    padded through the model's own masks, against one packed row under our block-diagonal causal mask. They differ at
    the tokens past W; cutting the window into our mask by hand makes them agree (the negative control: the
    window is the whole difference)."""
    from rlhf_engine.packing import pack_rows

    model = tiny_lm(windowed_config(kind))
    n, m = 2 * WINDOW, 5
    ids = torch.randint(3, 128, (2, n), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, n, dtype=torch.long)
    mask[1, :n - m] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool()
    with torch.no_grad():
        padded = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[real]
        packed = pack_rows(mask, width=n + m)
        bias = packed.attention_bias(torch.float32)
        q = torch.arange(n + m)
        windowed = bias.masked_fill((q[:, None] - q[None, :] >= WINDOW)[None, None], torch.finfo(torch.float32).min)
        out = {}
        for name, b in (("ours", bias), ("windowed", windowed)):
            logits = model(input_ids=packed.take(ids), position_ids=packed.take(pos), attention_mask=b,
                           use_cache=False).logits
            out[name] = logits.reshape(-1, logits.shape[-1])[packed.slot[real]]
    gap = (out["ours"] - padded).abs().amax(-1)  # per real token, in padded order: row 0's n, then row 1's m
    assert float(gap[:WINDOW].max()) <= FP32_ATOL, kind  # within the window: the same attention
    assert float(gap[WINDOW:n].min()) > 1e-3, (kind, gap[WINDOW:n])  # every token past it sees more than it should
    assert float(gap[n:].max()) <= FP32_ATOL, kind  # the short sequence fits its window
    assert float((out["windowed"] - padded).abs().max()) <= FP32_ATOL, kind


def save_windowed_actor(tiny, path: str, window: int) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny.tokenizer)
    config = windowed_config("mistral", window, vocab_size=len(tok))
    config.pad_token_id, config.eos_token_id, config.bos_token_id = tok.pad_token_id, tok.eos_token_id, tok.bos_token_id
    tiny_lm(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_packing_is_refused_for_a_window_shorter_than_the_longest_sequence(tiny, dist_single, tmp_path, caplog):
    """A Mistral actor (critic from it) with a 16-token window: with prompts + responses of up to 64 + 8 tokens, on is
    refused at planning (before any weight is read) naming the flag and the window, and auto is off, logged once with
    the reason. Negative control: the same model with 12 + 4 tokens (the window exactly) packs, and its probe, run at
    16 tokens, passes; one token more is refused."""
    import logging

    path = save_windowed_actor(tiny, str(tmp_path / "mistral"), 16)
    flags = dict(actor_model_name_or_path=path, reward_fn="rlhf_engine.rewards.sentiment:vader_positive",
                 reward_model_name_or_path="", critic_init_from="actor")
    cfg = lambda packing, **kw: parse_args(ppo_args(tiny, str(tmp_path / packing), packing=packing,  # noqa: E731
                                                    **flags, **kw))
    with pytest.raises(ConfigError, match=r"packing.*the actor model \(mistral\) attends within a sliding window of "
                                          r"16 tokens, shorter than the longest sequence \(max_prompt_seq_len \+ "
                                          r"max_answer_seq_len = 72\)") as err:
        plan_engine(cfg("on"), 1)
    assert len(err.value.problems) == 1  # actor, reference and critic share the model: named once
    caplog.set_level(logging.INFO, logger="rlhf_engine.engine.preflight")
    auto = cfg("auto")
    plan = plan_engine(auto, 1)
    assert plan.packing == "off"
    said = [r.getMessage() for r in caplog.records if "packing auto: off" in r.getMessage()]
    assert len(said) == 1 and "sliding window of 16 tokens" in said[0], said
    assert not RLHFEngine(auto, dist_single, plan).packing
    with pytest.raises(ConfigError, match=r"sliding window of 16 tokens.* = 17\)"):
        plan_engine(cfg("on", max_prompt_seq_len=12, max_answer_seq_len=5), 1)
    fits = cfg("on", max_prompt_seq_len=12, max_answer_seq_len=4)
    plan = plan_engine(fits, 1)
    assert plan.packing == "on" and plan.longest_sequence == 16
    assert RLHFEngine(fits, dist_single, plan).packing


def test_the_probe_at_the_longest_sequence_sees_a_window_the_config_check_misses(tiny, dist_single, tmp_path,
                                                                                  monkeypatch):
    """The config check blinded (as it would be to a window under a field name it does not know): the start-up probe
    still refuses the 16-token-window Mistral, because it runs at the run's longest sequence (64 + 8 tokens), past
    the window. A probe within the window (the old one had 5 tokens) would have passed it."""
    import rlhf_engine.packing

    path = save_windowed_actor(tiny, str(tmp_path / "mistral"), 16)
    monkeypatch.setattr(rlhf_engine.packing, "sliding_window", lambda config: None)
    cfg = parse_args(ppo_args(tiny, str(tmp_path / "on"), packing="on", actor_model_name_or_path=path,
                              reward_fn="rlhf_engine.rewards.sentiment:vader_positive", reward_model_name_or_path="",
                              critic_init_from="actor"))
    plan = plan_engine(cfg, 1)
    assert plan.packing == "on" and plan.longest_sequence == 72  # the blinded check let it through
    with pytest.raises(ConfigError, match=r"packing.*actor model \(mistral\) does not compute packed rows"):
        RLHFEngine(cfg, dist_single, plan)


# ---- ZeRO-3: the packed causal-LM forward runs inside DeepSpeed's forward ------------------------------------------
def zero3_actor(tiny, tmp_path, name: str):
    from rlhf_engine.engine.role_engine import build_role_engine

    cfg = parse_args(ppo_args(tiny, str(tmp_path / name), actor_zero_stage=3, per_device_training_batch_size=2,
                              gradient_accumulation_steps=2))
    engine, _ = build_role_engine(cfg.actor, tiny.actor, kind="causal_lm", stage=3, dtype="fp32", train=True,
                                  batch=cfg.batch, world_size=1, eval_micro_batch_size=2, num_training_steps=1)
    return engine


def test_zero3_accumulates_packed_micro_batches_as_padded_ones(tiny, dist_single, tmp_path):
    """Two micro-batches' gradients accumulated by a ZeRO-3 engine (1 rank): through packed rows, as through padded
    ones. ZeRO-3 counts micro-batches in DeepSpeed's forward: the packed forward used to call the model's parts
    directly, and the second micro-batch's gradient replaced the first's. Outside its engine, a ZeRO-3 model's packed
    forward with gradients is refused (it cannot be counted), and allowed without (the start-up probe)."""
    import deepspeed

    from rlhf_engine.engine.packed_forward import packed_inputs, packed_logits_at
    from rlhf_engine.packing import pack_rows

    gen = torch.Generator().manual_seed(2)
    batches = []
    for lengths in ((9, 4), (6, 11)):  # left-padded rows, as prompts + responses are
        L = max(lengths)
        mask = torch.tensor([[0] * (L - n) + [1] * n for n in lengths])
        batches.append((torch.randint(3, 500, (2, L), generator=gen), mask, (mask.cumsum(-1) - 1).clamp(min=0)))
    weights = torch.randn(512, generator=gen)

    def loss_of(logits):  # any function of every real token's logits, the same rows in the same order
        return (logits.float().log_softmax(-1) * weights).sum() / 100

    grads = {}
    for path in ("padded", "packed"):
        engine = zero3_actor(tiny, tmp_path, path)
        for ids, mask, pos in batches:
            real = mask.bool()
            if path == "padded":
                logits = engine(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits[real]
            else:
                packed = pack_rows(mask)
                logits = packed_logits_at(engine, packed, packed_inputs(packed, ids, pos, torch.float32),
                                          packed.slot[real])
            engine.backward(loss_of(logits), scale_wrt_gas=False)
        grads[path] = {n: deepspeed.utils.safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    assert grads["packed"].keys() == grads["padded"].keys()
    size = max(float(g.abs().max()) for g in grads["padded"].values())
    worst = max(float((grads["packed"][n] - grads["padded"][n]).abs().max()) for n in grads["padded"])
    assert worst <= FP32_ATOL < size / 100, (worst, size)
    ids, mask, pos = batches[0]
    packed = pack_rows(mask)
    at = (packed, packed_inputs(packed, ids, pos, torch.float32), packed.slot[mask.bool()])
    with pytest.raises(RuntimeError, match="through the DeepSpeed engine"):
        packed_logits_at(engine.module, *at)
    with torch.no_grad():
        assert float((packed_logits_at(engine.module, *at) - packed_logits_at(engine, *at)).abs().max()) <= FP32_ATOL
