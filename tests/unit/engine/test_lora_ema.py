"""Engine extensions on one rank, in process: LoRA (actor and critic, reference = actor without its adapter, merged
export), EMA of the actor (closed form), gradient checkpointing (equal losses and gradients, cache kept for
generation), config checks. ZeRO 2/3, gather-once generation and EMA partitions: tests/distributed/
test_engine_extensions.py.
"""
from __future__ import annotations

import os

import pytest
import torch

from rlhf_engine.errors import ConfigError

TOL = 1e-5


def make_cfg(setup, **engine_flags):
    from rlhf_engine.config import TrainConfig

    cfg = TrainConfig()
    cfg.actor.model_name_or_path = setup.actor
    cfg.reward.model_name_or_path = setup.reward
    cfg.generation.max_prompt_seq_len, cfg.generation.max_answer_seq_len = 8, 6
    cfg.generation.do_sample = False
    cfg.batch.per_device_generation_batch_size = 2
    cfg.batch.per_device_training_batch_size = 2
    for role in ("actor", "critic"):
        rc = getattr(cfg, role)
        rc.learning_rate, rc.gradient_clipping = 1e-2, 0.0
    for k, v in engine_flags.items():
        if "." in k:
            section, name = k.split(".")
            setattr(getattr(cfg, section), name, v)
        else:
            setattr(cfg.engine, k, v)
    return cfg.validate()


def fixed_rollout(vocab: int, eos: int, pad: int, seed: int = 0):
    """Two rows: left-padded prompts of 4 and 2 tokens; row 0 ends with EOS after 3 tokens, row 1 is truncated."""
    from rlhf_engine.rollout import Rollout, pad_prompts

    g = torch.Generator().manual_seed(seed)
    ids, mask = pad_prompts([torch.randint(3, vocab, (4,), generator=g).tolist(),
                             torch.randint(3, vocab, (2,), generator=g).tolist()], pad)
    resp = torch.randint(3, vocab, (2, 5), generator=g)
    resp[0, 3], resp[0, 4] = eos, pad
    return Rollout.from_generation(ids, mask, resp, [eos], pad)


def hf_logprobs(model, r) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids).logits
    P, R = r.prompt_length, r.response_width
    lp = torch.log_softmax(logits[:, P - 1: P - 1 + R].float(), -1)
    return lp.gather(-1, r.sequences[:, P:].unsqueeze(-1)).squeeze(-1) * r.action_mask


def hf_values(model, r) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids,
                    output_hidden_states=True)
    P, R = r.prompt_length, r.response_width
    return model.score(out.hidden_states[-1]).squeeze(-1).float()[:, P - 1: P - 1 + R] * r.action_mask


def train_steps(e, r, steps: int, after_step=None) -> None:
    """`steps` actor and critic optimizer steps on rollout `r` (a made-up objective that moves every weight)."""
    tokens = r.action_mask.sum().float()
    for _ in range(steps):
        lp, _ = e.actor_forward(r)
        e.backward("actor", -(lp * r.action_mask).sum() / tokens)
        e.step("actor")
        if after_step is not None:
            after_step()
        v = e.critic_forward(r)
        e.backward("critic", (((v - 1.0) ** 2) * r.action_mask).sum() / tokens)
        e.step("critic")


# ---- LoRA ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_run(tiny, dist_single, tmp_path_factory):
    """A one-rank ZeRO-0 RLHFEngine with LoRA actor and critic and the reference = actor without its adapter,
    trained 2 steps; its state before and after, and merged exports."""
    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine

    torch.manual_seed(0)
    cfg = make_cfg(tiny, reference_from_actor_adapter=True, **{"actor.lora_dim": 4, "critic.lora_dim": 4,
                                                               "actor.lora_alpha": 8.0, "critic.lora_alpha": 8.0})
    e = RLHFEngine(cfg, dist_single, plan_engine(cfg, 2))
    r = fixed_rollout(len(e.tokenizer), int(e.tokenizer.eos_token_id), e.pad_token_id)
    before = {role: e.full_state_dict(role) for role in ("actor", "critic")}
    ref_before = e.ref_logprobs(r)
    train_steps(e, r, 2)
    after = {role: e.full_state_dict(role) for role in ("actor", "critic")}
    out = str(tmp_path_factory.mktemp("lora_export"))
    e.export("actor", os.path.join(out, "actor"))
    e.export("critic", os.path.join(out, "critic"))
    return dict(e=e, r=r, before=before, after=after, ref_before=ref_before, out=out)


def test_lora_builds_no_reference_engine_and_trains_only_adapters(lora_run):
    e = lora_run["e"]
    assert "reference" not in e.engines and e.reference is None
    assert type(e.actor.module).__name__ == "PeftModel"
    for role in ("actor", "critic"):
        trainable = {n for n, p in e.engines[role].module.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n or n.endswith("score.weight") for n in trainable), (role, trainable)
        assert any(n.endswith("score.weight") for n in trainable) == (role == "critic")
        before, after = lora_run["before"][role], lora_run["after"][role]
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        # every adapter weight moved (B starts at 0, A gets a gradient once B is not 0), nothing else did; the
        # critic's score head (also reachable as `head.weight`) trained fully
        expect = {k for k in before if "lora_" in k} | ({k for k in before if k.endswith("score.weight")
                                                          or k == "head.weight"} if role == "critic" else set())
        assert changed == expect, (role, sorted(changed ^ expect)[:6])


def test_reference_is_the_base_model_and_the_adapter_matters(lora_run, tiny):
    from transformers import AutoModelForCausalLM

    e, r = lora_run["e"], lora_run["r"]
    base = hf_logprobs(AutoModelForCausalLM.from_pretrained(tiny.actor).eval(), r)
    ref = e.ref_logprobs(r)
    assert (ref - base).abs().max() <= TOL
    assert (lora_run["ref_before"] - base).abs().max() <= TOL
    # negative control: the trained adapter changed the actor, the reference did not follow it
    assert (e.actor_logprobs(r) - base).abs().max() > 1e-3
    # after the adapter-disabled forward the adapter trains again (requires_grad restored)
    assert all(p.requires_grad for n, p in e.actor.module.named_parameters() if "lora_" in n)


def test_merged_exports_equal_the_adapted_models(lora_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    e, r, out = lora_run["e"], lora_run["r"], lora_run["out"]
    for role in ("actor", "critic"):
        keys = load_file(os.path.join(out, role, "model.safetensors")).keys()
        assert not any("lora" in k or "base_layer" in k for k in keys), sorted(keys)[:5]
    actor = AutoModelForCausalLM.from_pretrained(os.path.join(out, "actor")).eval()
    critic = AutoModelForSequenceClassification.from_pretrained(os.path.join(out, "critic")).eval()
    assert (hf_logprobs(actor, r) - e.actor_logprobs(r)).abs().max() <= TOL
    assert (hf_values(critic, r) - e.critic_values(r)).abs().max() <= TOL
    # greedy generation of the merged model is the engine's
    ids, mask = r.prompts, r.attention_mask[:, : r.prompt_length]
    g = e.generate(ids, mask)
    with torch.no_grad():
        hf = actor.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                            eos_token_id=e.stop_token_ids, pad_token_id=e.pad_token_id)
    assert hf[:, r.prompt_length:].tolist() == g.responses.tolist()


# ---- EMA -------------------------------------------------------------------------------------------------------
def test_ema_is_the_closed_form_average_of_the_actor(tiny, dist_single, tmp_path):
    from transformers import AutoModelForCausalLM

    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine

    beta = 0.6
    cfg = make_cfg(tiny, enable_ema=True, ema_decay=beta)
    e = RLHFEngine(cfg, dist_single, plan_engine(cfg, 3))
    assert e.plans["ema"].stage == 0 and e.plans["ema"].dtype == "fp32"
    assert not any(p.requires_grad for p in e.ema.module.parameters())
    r = fixed_rollout(len(e.tokenizer), int(e.tokenizer.eos_token_id), e.pad_token_id, seed=1)
    thetas = [e.full_state_dict("actor")]
    updates = []

    def after_actor_step():
        updates.append(e.update_ema())
        updates.append(e.update_ema())  # a second call without a new optimizer step does nothing
        thetas.append(e.full_state_dict("actor"))

    train_steps(e, r, 3, after_actor_step)
    assert updates == [True, False] * 3
    ema = e.full_state_dict("ema")
    n = len(thetas) - 1
    worst, moved = 0.0, 0.0
    for k, v in ema.items():
        want = beta ** n * thetas[0][k] + sum((1 - beta) * beta ** (n - i) * thetas[i][k] for i in range(1, n + 1))
        worst = max(worst, float((v - want).abs().max()))
        moved = max(moved, float((v - thetas[-1][k]).abs().max()))
    assert worst <= 1e-6, worst
    assert moved > 1e-4  # negative control: the EMA is not simply the last actor
    e.export("ema", str(tmp_path / "ema"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ema")).state_dict()
    assert max(float((reloaded[k] - ema[k]).abs().max()) for k in ema) == 0.0


# ---- gradient checkpointing ------------------------------------------------------------------------------------
def _engine(setup, kind: str, checkpointing: bool, lora: int = 0):
    from rlhf_engine.config import BatchConfig, RoleConfig
    from rlhf_engine.engine.role_engine import build_role_engine

    torch.manual_seed(0)  # the same LoRA init on both sides
    rc = RoleConfig(gradient_checkpointing=checkpointing, lora_dim=lora, learning_rate=1e-3)
    path = setup.actor if kind == "causal_lm" else setup.reward
    engine, _ = build_role_engine(rc, path, kind=kind, stage=0, dtype="fp32", train=True, batch=BatchConfig(),
                                  world_size=1, eval_micro_batch_size=2, num_training_steps=1, pad_token_id=0)
    return engine


@pytest.mark.parametrize("kind,lora", [("causal_lm", 0), ("scalar", 0), ("causal_lm", 4)])
def test_gradient_checkpointing_gives_equal_losses_and_gradients(tiny, dist_single, kind, lora):
    r = fixed_rollout(512, 0, 0, seed=2)
    results = []
    for checkpointing in (False, True):
        engine = _engine(tiny, kind, checkpointing, lora)
        hf = engine.module.get_base_model() if lora else getattr(engine.module, "hf_model", engine.module)
        assert hf.is_gradient_checkpointing == checkpointing
        assert hf.config.use_cache is not False  # generation keeps its KV cache
        engine.train()
        inputs = dict(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids)
        out = engine(**inputs, use_cache=False).logits if kind == "causal_lm" else engine(**inputs)
        loss = (out.float() ** 2).mean()
        engine.backward(loss)
        grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
        assert grads and all(g is not None for g in grads.values())
        results.append((loss.item(), grads))
        engine.zero_grad()
    (l0, g0), (l1, g1) = results
    assert abs(l0 - l1) <= 1e-5
    assert g0.keys() == g1.keys()
    worst = max(float((g0[k] - g1[k]).abs().max()) for k in g0)
    assert worst <= 1e-5, worst
    assert max(float(g.abs().max()) for g in g0.values()) > 1e-4  # the gradients are not trivially zero


def test_generation_keeps_the_cache_with_gradient_checkpointing(tiny, dist_single):
    """A checkpointed actor still generates with its KV cache (HF turns the cache off only in training mode)."""
    engine = _engine(tiny, "causal_lm", True)
    model = engine.module
    model.eval()
    seen = []
    hook = model.transformer.h[0].attn.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[1]))
    try:
        with torch.no_grad():
            model.generate(input_ids=torch.tensor([[5, 6, 7]]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                           max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=0)
    finally:
        hook.remove()
    assert seen == [3, 1, 1, 1], seen  # the prompt once, then one token per step: the cache is used


# ---- config and start-up checks --------------------------------------------------------------------------------
def test_config_rejects_bad_combinations(tiny):
    from rlhf_engine.config import TrainConfig

    cfg = TrainConfig()
    cfg.actor.model_name_or_path = tiny.actor
    cfg.engine.reference_from_actor_adapter = True  # without actor LoRA
    cfg.reward.lora_dim = 4  # an eval-only role
    cfg.critic.lora_dim, cfg.critic.lora_dropout = 4, 0.1  # dropout in PPO
    cfg.engine.ema_decay = 1.0
    cfg.engine.generation_gather_once = "sometimes"
    with pytest.raises(ConfigError) as ei:
        cfg.validate()
    fields = {p.field for p in ei.value.problems}
    assert {"reference_from_actor_adapter", "reward_lora_dim", "critic_lora_dropout", "ema_decay",
            "generation_gather_once"} <= fields, fields
    cfg = TrainConfig()
    cfg.actor.model_name_or_path = tiny.actor
    cfg.actor.lora_dim = 4
    cfg.engine.enable_ema = True
    with pytest.raises(ConfigError, match="enable_ema"):
        cfg.validate()


def test_lora_target_modules_are_checked_at_start_up(tiny):
    from rlhf_engine.engine.preflight import plan_engine

    cfg = make_cfg(tiny, **{"actor.lora_dim": 4, "critic.lora_dim": 4})
    cfg.actor.lora_target_modules = "q_proj,v_proj"  # Llama names on a GPT-2
    cfg.critic.lora_target_modules = "c_attn"
    with pytest.raises(ConfigError) as ei:
        plan_engine(cfg).roles
    assert [p.field for p in ei.value.problems] == ["actor_lora_target_modules"], str(ei.value)
    assert "c_attn" in str(ei.value)  # names real layers


def test_lora_targets_skip_heads(tiny, tiny_llama):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from rlhf_engine.engine.models import lora_target_names

    lm = AutoModelForCausalLM.from_pretrained(tiny_llama.actor)
    names = lora_target_names(lm, "all-linear")
    assert "lm_head" not in names and len(names) == 2 * 7  # q k v o gate up down per layer
    assert lora_target_names(lm, "q_proj,v_proj") == [n for n in names if n.endswith(("q_proj", "v_proj"))]
    sc = AutoModelForSequenceClassification.from_pretrained(tiny.reward, num_labels=1)
    assert "score" not in lora_target_names(sc, "all-linear") and len(lora_target_names(sc, "all-linear")) == 8


# ---- Hybrid Engine: refused on CPU, or Hugging Face generation with the fallback ------------------------------
def test_hybrid_engine_is_refused_on_cpu(tiny):
    from rlhf_engine.engine.preflight import plan_engine

    cfg = make_cfg(tiny, enable_hybrid_engine=True)
    with pytest.raises(ConfigError) as ei:
        plan_engine(cfg).roles
    (problem,) = [p for p in ei.value.problems if p.field == "enable_hybrid_engine"]
    assert "no CUDA" in problem.fix and "hybrid_engine_fallback" in problem.fix


def test_hybrid_engine_reasons(tiny):
    from transformers import AutoConfig, MistralConfig

    from rlhf_engine.engine.preflight import hybrid_engine_model_types, hybrid_engine_reasons

    assert {"gpt2", "llama", "opt", "bloom", "gpt_neox"} <= hybrid_engine_model_types()
    cfg = make_cfg(tiny)
    gpt2 = AutoConfig.from_pretrained(tiny.actor)
    assert hybrid_engine_reasons(cfg, gpt2, on_gpu=True) == []
    (why,) = hybrid_engine_reasons(cfg, MistralConfig(), on_gpu=True)
    assert "'mistral' has no DeepSpeed inference container" in why
    cfg.actor.lora_dim = 4
    (why,) = hybrid_engine_reasons(cfg, gpt2, on_gpu=True)
    assert "LoRA" in why
    assert len(hybrid_engine_reasons(cfg, MistralConfig(), on_gpu=False)) == 3
    cfg.actor.lora_dim, cfg.engine.inference_tp_size = 0, 2  # its tensor-parallel rows: the log-prob recorder's limit
    (why,) = hybrid_engine_reasons(cfg, gpt2, on_gpu=True)
    assert "inference_tp_size 2 > 1" in why


def test_hybrid_engine_fallback_generates_with_hugging_face(tiny, dist_single, caplog):
    from deepspeed.runtime.config import HybridEngineConfig

    from rlhf_engine.engine import RLHFEngine
    from rlhf_engine.engine.preflight import plan_engine

    cfg = make_cfg(tiny, enable_hybrid_engine=True, hybrid_engine_fallback=True, inference_tp_size=1,
                   release_inference_cache=True, unpin_actor_parameters=True)
    with caplog.at_level("WARNING"):
        e = RLHFEngine(cfg, dist_single, plan_engine(cfg, 1))
    assert e.hybrid_engine is False and "hybrid_engine" not in e.ds_configs["actor"]
    assert any("hybrid_engine_fallback is set" in m for m in caplog.messages), caplog.messages
    r = fixed_rollout(len(e.tokenizer), int(e.tokenizer.eos_token_id), e.pad_token_id)
    g = e.generate(r.prompts, r.attention_mask[:, : r.prompt_length])
    assert g.batch_size == 2
    # what a GPU run would hand DeepSpeed is a valid hybrid_engine section
    from rlhf_engine.engine.generation.hybrid import HybridEngineBackend

    section = HybridEngineBackend.actor_ds_overrides(cfg)["hybrid_engine"]
    parsed = HybridEngineConfig(**section)
    assert parsed.enabled and parsed.max_out_tokens == 14 and parsed.pin_parameters is False
    assert parsed.release_inference_cache is True
