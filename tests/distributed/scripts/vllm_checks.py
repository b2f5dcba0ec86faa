"""Harness for tests/distributed/test_vllm_generation.py: one vLLM engine per rank, actors at several ZeRO stages
pushed into it; rank 0 writes what it measured (nothing is asserted here: the numbers travel to the test).

    deepspeed --num_gpus 2 vllm_checks.py --actor DIR --prompts FILE --out FILE.json

Per rank, in order:
  * contained: the python / numpy / torch random states, the thread count and the collector's freeze count after the
    engine is built (and after a generate call) against before (the test launches it forked: its ranks start with
    their server's start-up freeze, as a launch script's do with their own);
  * per actor variant (z0, z2, z3, and z2 with LoRA; each a DeepSpeed engine of the actor trained a few steps at a high
    learning rate, so its weights are far from the folder's): after a push, the engine's greedy tokens and log-probs
    against the actor's own forward on prompts longer than one KV block;
  * negative controls on the z2 actor: a push skipped (the engine keeps old weights), a push without the prefix
    cache reset (prompts cached before the push are served with old keys and values), and (the actor's LM head tied
    to its embedding) a push without the head's repack (on CPU its packed GEMM keeps the previous embedding);
  * a push that proves itself (on the z2 actor): a push without decoder layer 1, then one without layer 0's k_proj
    (a fused qkv layer sent in part), each stopped by the push check with its message and the loader warnings that
    reached our log; then a full push, equal again;
  * sampling: the same torch seed gives the same sampled tokens; at temperature 0.7 the engine's log-probs of its
    samples against the actor's log_softmax(logits / 0.7) (and, the negative control, against T = 1);
  * other actors, each in an engine of its own (--other NAME=DIR:DTYPE, e.g. a GPT-2, a Qwen2, a bf16 Llama): after a
    push from its z2 engine, greedy against the actor's forward; at bf16 also the actor's bf16 forward against fp32
    on the same weights (the scale of bf16's own rounding), and a skipped push (the negative control).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from rlhf_engine import comm  # noqa: E402
from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.engine import init_distributed, load_tokenizer  # noqa: E402
from rlhf_engine.engine.generation import GenerationContext, SamplingParams  # noqa: E402
from rlhf_engine.engine.generation.vllm_engine import VLLMBackend  # noqa: E402
from rlhf_engine.engine.role_engine import build_role_engine, rollout_inputs  # noqa: E402
from rlhf_engine.rollout import pad_prompts  # noqa: E402

MAX_NEW = 8
MAX_LEN = 256
VARIANTS = {"z0": (0, 0), "z2": (2, 0), "z3": (3, 0), "z2_lora": (2, 4)}  # name: (ZeRO stage, LoRA rank)


def rng_snapshot():
    return (random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist(),
            torch.get_num_threads(), torch.set_num_threads.__module__, gc.get_freeze_count())


def config(args, lora: int, actor: str = ""):
    actor = actor or args.actor
    flags = ["--actor_model_name_or_path", actor, "--reward_model_name_or_path", actor,
             "--data_path", args.prompts, "--max_prompt_seq_len", str(MAX_LEN - MAX_NEW),
             "--max_answer_seq_len", str(MAX_NEW), "--generation_backend", "vllm", "--seed", "11",
             "--output_dir", os.path.join(args.workdir, "unused")]
    if lora:
        flags += ["--actor_lora_dim", str(lora)]
    return parse_args(flags)


def trained_actor(cfg, stage: int, dist, pad: int, seed: int, dtype: str = "fp32"):
    """The actor as a DeepSpeed engine at `stage`, moved far from its folder by a few steps at a high learning rate
    on random tokens (the same on every rank: the gradients are averaged anyway)."""
    cfg.actor.learning_rate = 0.02
    torch.manual_seed(seed)  # the LoRA adapter's initial draw: the same every launch
    engine, _ = build_role_engine(cfg.actor, cfg.actor.model_name_or_path, kind="causal_lm", stage=stage, dtype=dtype,
                                  train=True, batch=cfg.batch, world_size=dist.world_size,
                                  eval_micro_batch_size=4, num_training_steps=10, pad_token_id=pad)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        x = torch.randint(3, 500, (cfg.batch.per_device_training_batch_size, 24), generator=g)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
    return engine


def long_prompts(tok, rank: int, n: int = 4):
    """Prompts of 140-200 tokens (longer than one of the engine's KV blocks), different per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    rows = [torch.randint(3, 500, (int(torch.randint(140, 200, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]
    return pad_prompts(rows, tok.pad_token_id)


def compare(backend, actor, ids, mask, params, scored_at: float = 1.0) -> dict:
    """The engine's rollout of the prompts (greedy, or sampled) against the actor's forward of it: the largest log-prob
    difference over real actions (the actor's log_softmax(logits / scored_at)), and the share of actions whose token
    is not the actor's argmax (where the actor's top two logits are more than 1e-3 apart; greedy only). Collective at
    ZeRO-3 (every rank runs the actor forward)."""
    gen = backend.generate(ids, mask, params)
    r = gen.rollout
    with torch.no_grad():
        actor.module.eval()
        logits = actor.module(**rollout_inputs(r)).logits.float()
    P = r.prompt_length
    step = logits[:, P - 1:-1]
    lp = torch.log_softmax(step / scored_at, -1).gather(-1, r.responses[..., None]).squeeze(-1)
    act = r.action_mask.bool()
    top2 = step.topk(2, -1).values
    clear = act & ((top2[..., 0] - top2[..., 1]) > 1e-3)
    wrong = (step.argmax(-1) != r.responses) & clear
    diff = (lp - gen.logprobs).abs() * act
    return {"logprob_diff": float(diff.max()), "row_diffs": diff.max(-1).values.tolist(),
            "argmax_mismatch": float(wrong.sum() / clear.sum().clamp(min=1)), "actions": int(act.sum()),
            "responses": r.responses.tolist()}


def other_actor(args, dist, folder: str, dtype: str, ids, mask, greedy) -> dict:
    """Another architecture or dtype through an engine of its own: its z2 actor pushed, greedy against the actor's
    forward; a skipped push after a step (negative control); at bf16, the actor's own bf16 forward against fp32 on
    the same weights, the scale of bf16's rounding that the engine's differences are held to."""
    cfg = config(args, 0, folder)
    actor = trained_actor(cfg, 2, dist, load_tokenizer(folder).pad_token_id, seed=args.seed + 7, dtype=dtype)
    backend = VLLMBackend(GenerationContext(actor, dist, 2, cfg, model_path=folder, dtype=dtype, max_len=MAX_LEN))
    out = {"arch": type(actor.module).__name__, "pushed": compare(backend, actor, ids, mask, greedy)}
    if dtype != "fp32":
        gen = backend.generate(ids, mask, greedy)
        inputs = rollout_inputs(gen.rollout)
        P, act = gen.rollout.prompt_length, gen.rollout.action_mask.bool()
        with torch.no_grad():
            low = actor.module(**inputs).logits.float()
            high = copy_fp32(actor.module)(**inputs).logits.float()
        lp = [torch.log_softmax(x[:, P - 1:-1], -1).gather(-1, gen.rollout.responses[..., None]).squeeze(-1)
              for x in (low, high)]
        out["actor_vs_fp32"] = float(((lp[0] - lp[1]).abs() * act).max())
        out["engine_vs_fp32"] = float(((gen.logprobs - lp[1]).abs() * act).max())
    x = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(9))
    actor.backward(actor(input_ids=x, labels=x).loss)
    actor.step()
    backend._pushed_version = backend.actor_version  # pretend the engine is current
    out["skipped_push"] = compare(backend, actor, ids, mask, greedy)
    return out


def copy_fp32(module):
    """An fp32 copy of a (ZeRO-2) model, for a reference forward on the same weights."""
    import copy

    return copy.deepcopy(module).float().eval()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--actor", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0, help="offsets the actors' training draws")
    parser.add_argument("--other", action="append", default=[], help="NAME=DIR:DTYPE: another actor, its own engine")
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    dist = init_distributed()
    tok = load_tokenizer(args.actor)
    pad = tok.pad_token_id
    out: dict = {}
    cfg = config(args, 0)
    actors = {name: trained_actor(config(args, lora) if lora else cfg, stage, dist, pad, seed=args.seed + i)
              for i, (name, (stage, lora)) in enumerate(VARIANTS.items())}

    torch.manual_seed(5)
    before = rng_snapshot()
    ctx = GenerationContext(actors["z0"], dist, 0, cfg, model_path=args.actor, dtype="fp32", max_len=MAX_LEN)
    backend = VLLMBackend(ctx)
    after_build = rng_snapshot()
    ids, mask = long_prompts(tok, dist.rank)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=pad)
    first = compare(backend, actors["z0"], ids, mask, greedy)
    after_generate = rng_snapshot()
    # the random states, the thread count and set_num_threads' owner; the freeze count apart (contained() keeps a
    # start-up freeze, the engine's objects joining it: a forked rank has its server's, as a launch script has its own)
    out["contained"] = {"build": before[:5] == after_build[:5], "generate": after_build[:5] == after_generate[:5],
                        "threads": [before[3], after_build[3]], "set_num_threads": after_build[4],
                        "freeze": [before[5], after_build[5], after_generate[5]]}
    out["startup_s"] = backend.startup_s
    out["block_size"] = backend.llm.llm_engine.vllm_config.cache_config.block_size
    out["prompt_lengths"] = mask.sum(-1).tolist()
    out["variants"] = {"z0": first}
    for name, actor in actors.items():
        backend.actor = actor
        backend._pushed_version = None  # another engine: push whatever its step count
        out["variants"][name] = compare(backend, actor, ids, mask, greedy)
    lora = actors["z2_lora"]
    with lora.module.disable_adapter():  # the adapter matters: the base model's forward is another policy
        base = compare(backend, lora, ids, mask, greedy)
    out["lora_base_vs_merged"] = base["logprob_diff"]

    # negative control 1: the actor steps, the push is skipped
    z2 = actors["z2"]
    backend.actor = z2
    backend._pushed_version = None
    compare(backend, z2, ids, mask, greedy)  # pushed and cached
    x = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(9))
    z2.backward(z2(input_ids=x, labels=x).loss)
    z2.step()
    backend._pushed_version = backend.actor_version  # pretend the engine is current
    out["skipped_push"] = compare(backend, z2, ids, mask, greedy)
    # negative control 2: pushed, but the prefix cache still holds the prompts' blocks of the old weights
    backend.load_weights()
    out["no_cache_reset"] = compare(backend, z2, ids, mask, greedy)
    backend.reset_prefix_cache()
    out["after_reset"] = compare(backend, z2, ids, mask, greedy)
    # negative control 3 (a tied LM head, as the test's actor has): the actor steps and is pushed, but the head's
    # packed GEMM is not rebuilt from the new embedding (vLLM's reload alone)
    import rlhf_engine.engine.generation.vllm_engine as vllm_engine

    out["tied_head"] = vllm_engine.repack_tied_head(backend.runner.get_model())
    z2.backward(z2(input_ids=x, labels=x).loss)
    z2.step()
    real_repack, vllm_engine.repack_tied_head = vllm_engine.repack_tied_head, lambda model: False
    try:
        out["no_head_repack"] = compare(backend, z2, ids, mask, greedy)
    finally:
        vllm_engine.repack_tied_head = real_repack
    backend._pushed_version = None
    out["after_repack"] = compare(backend, z2, ids, mask, greedy)

    # a push that proves itself: a decoder layer left out of the stream, then one part of a fused layer
    from rlhf_engine.engine.generation import vllm_push_check
    from rlhf_engine.engine.policy_weights import stream_weights

    kept = []  # what reached our log from vLLM's loaders (vllm_push_check.keep_loader_warnings)
    catcher = logging.Handler(logging.WARNING)
    catcher.emit = lambda record: kept.append(record.getMessage())
    logging.getLogger(vllm_push_check.__name__).addHandler(catcher)
    for key, prefix in (("dropped_layer", "model.layers.1."), ("dropped_part", "model.layers.0.self_attn.k_proj.")):
        kept.clear()
        try:
            backend.take_weights(((n, t) for n, t in stream_weights(z2.module) if not n.startswith(prefix)),
                                 backend.actor_version)
            out[key] = {"error": None}
        except vllm_push_check.WeightPushIncomplete as e:
            out[key] = {"error": str(e)}
        out[key]["logged"] = list(kept)
    backend._pushed_version = None
    out["after_full_push"] = compare(backend, z2, ids, mask, greedy)

    # sampling: the same torch seed, the same samples
    sampled = SamplingParams(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.0, pad_token_id=pad)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(backend.generate(ids, mask, sampled).rollout.responses.tolist())
    out["seeded_same"] = runs[0] == runs[1]
    torch.manual_seed(124)
    out["other_seed_differs"] = backend.generate(ids, mask, sampled).rollout.responses.tolist() != runs[0]
    # temperature 0.7: vLLM's processed log-probs are the tempered distribution the trainer scores
    warm = SamplingParams(max_new_tokens=MAX_NEW, do_sample=True, temperature=0.7, pad_token_id=pad)
    for key, scored_at in (("t07", 0.7), ("t07_scored_at_1", 1.0)):
        torch.manual_seed(125)  # the same samples for both comparisons
        out[key] = compare(backend, z2, ids, mask, warm, scored_at=scored_at)
    out["pushes"] = backend.pushes
    out["others"] = {}
    for spec in args.other:
        name, _, rest = spec.partition("=")
        folder, _, dtype = rest.rpartition(":")
        out["others"][name] = other_actor(args, dist, folder, dtype, ids, mask, greedy)

    per_rank = [None] * dist.world_size
    torch.distributed.all_gather_object(per_rank, out)
    if dist.is_main:
        with open(args.out, "w") as f:
            json.dump({"ranks": per_rank}, f)
    comm.shutdown(ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
