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
