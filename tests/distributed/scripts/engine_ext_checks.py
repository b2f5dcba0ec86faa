"""Engine-extension checks on several ranks in one launch; rank 0 writes one JSON file that
tests/distributed/test_engine_extensions.py asserts on (nothing is asserted here).

    deepspeed --num_gpus 2 engine_ext_checks.py --actor DIR --reward DIR --out FILE.json --workdir DIR

Three RLHFEngines are built one after the other:
  * lora_z2 / lora_z3: LoRA actor and critic at ZeRO 2 / ZeRO 3 (z3 also with gradient checkpointing on both), the
    reference = the actor with its adapter disabled. Two optimizer steps on a fixed rollout: which weights changed,
    reference log-probs vs the plain base model, merged exports reloaded with plain `from_pretrained`.
  * z3_ema: actor ZeRO 3 with an EMA (decay 0.6, ZeRO 3 too): the actor's full weights after each of 3 steps and the
    EMA at the end (the test computes the closed form), the EMA export; then generation with per-layer fetching vs
    gather-once, counting the collectives DeepSpeed issues during each generate call (2 and 8 new tokens), and a
    gather-once generate where the ranks stop at different lengths (no synced_gpus).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402

from rlhf_engine.config import TrainConfig  # noqa: E402
from rlhf_engine.engine import RLHFEngine, init_distributed  # noqa: E402
from rlhf_engine.engine.generation import BACKENDS  # noqa: E402
from rlhf_engine.engine.preflight import plan_engine  # noqa: E402
from rlhf_engine.rollout import Rollout, pad_prompts  # noqa: E402
from spec_runner import settled  # noqa: E402

LR = 1e-2


def gather(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def rows(t: torch.Tensor) -> list:
    return t.detach().float().cpu().tolist()


def fixed_rollout(rank: int, vocab: int, eos: int, pad: int) -> Rollout:
    """This rank's rollout: prompts of 5 and 2 tokens (left-padded); row 0 ends with EOS after 3 tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    ids, mask = pad_prompts([torch.randint(3, vocab, (5,), generator=g).tolist(),
                             torch.randint(3, vocab, (2,), generator=g).tolist()], pad)
    resp = torch.randint(3, vocab, (2, 6), generator=g)
    resp[0, 3] = eos
    resp[0, 4:] = pad
    return Rollout.from_generation(ids, mask, resp, [eos], pad)


def hf_logprobs(model, r: Rollout) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids).logits
    P, R = r.prompt_length, r.response_width
    lp = torch.log_softmax(logits[:, P - 1: P - 1 + R].float(), -1)
    return lp.gather(-1, r.sequences[:, P:].unsqueeze(-1)).squeeze(-1) * r.action_mask


def hf_values(model, r: Rollout) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids,
                    output_hidden_states=True)
    P, R = r.prompt_length, r.response_width
    return model.score(out.hidden_states[-1]).squeeze(-1).float()[:, P - 1: P - 1 + R] * r.action_mask


def make_cfg(args, stage: int, **engine) -> TrainConfig:
    cfg = TrainConfig()
    cfg.actor.model_name_or_path = args.actor
    cfg.reward.model_name_or_path = args.reward
    cfg.generation.max_prompt_seq_len = 16
    cfg.generation.max_answer_seq_len = 8
    cfg.generation.do_sample = False
    cfg.batch.per_device_generation_batch_size = 2
    cfg.batch.per_device_training_batch_size = 2
    for role in ("actor", "critic"):
        rc = getattr(cfg, role)
        rc.zero_stage, rc.learning_rate, rc.gradient_clipping = stage, LR, 0.0
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return cfg


def train(e: RLHFEngine, r: Rollout, steps: int, after_actor_step=None) -> None:
    tokens = r.action_mask.sum().double()
    torch.distributed.all_reduce(tokens)
    for _ in range(steps):
        lp, _ = e.actor_forward(r)
        e.backward("actor", -(lp * r.action_mask).sum() / tokens.float())
        e.step("actor")
        if after_actor_step is not None:
            after_actor_step()
        v = e.critic_forward(r)
        e.backward("critic", (((v - 1.0) ** 2) * r.action_mask).sum() / tokens.float())
        e.step("critic")


# ---- LoRA ------------------------------------------------------------------------------------------------------
@settled  # spec_runner.py: settle() once the run has returned (nothing of it held any more)
def run_lora(name: str, stage: int, args, dist) -> dict:
    t0 = time.time()
    torch.manual_seed(0)  # the adapter's initial weights (DeepSpeed broadcasts rank 0's anyway)
    cfg = make_cfg(args, stage, reference_from_actor_adapter=True)
    for role in ("actor", "critic"):
        rc = getattr(cfg, role)
        rc.lora_dim, rc.lora_alpha = 4, 8.0
        rc.gradient_checkpointing = stage == 3
    cfg.validate()
    e = RLHFEngine(cfg, dist, plan_engine(cfg, 2))
    rank = dist.rank
    r = fixed_rollout(rank, len(e.tokenizer), int(e.tokenizer.eos_token_id), e.pad_token_id)
    res = {"engines": sorted(e.engines), "stages": {k: p.stage for k, p in e.plans.items()},
           "wrapper": type(e.actor.optimizer).__name__}
    before = {role: e.full_state_dict(role) for role in ("actor", "critic")}
    trainable = {role: sorted(n for n, p in e.engines[role].module.named_parameters() if p.requires_grad)
                 for role in ("actor", "critic")}
    train(e, r, 2)
    after = {role: e.full_state_dict(role) for role in ("actor", "critic")}
    if rank == 0:
        res["trainable"] = trainable
        res["changed"] = {role: sorted(k for k in before[role] if not torch.equal(before[role][k], after[role][k]))
                          for role in ("actor", "critic")}
        res["keys"] = {role: sorted(before[role]) for role in ("actor", "critic")}
    ref = e.ref_logprobs(r)
    actor_lp = e.actor_logprobs(r)
    values = e.critic_values(r)
    from transformers import AutoModelForCausalLM

    base = hf_logprobs(AutoModelForCausalLM.from_pretrained(args.actor).eval(), r)
    res["ref_vs_base"] = gather(float((ref - base).abs().max()))
    res["actor_vs_base"] = gather(float((actor_lp - base).abs().max()))
    res["requires_grad_after_ref"] = gather(all(p.requires_grad for n, p in e.actor.module.named_parameters()
                                                if "lora_" in n))
    out_dir = os.path.join(args.workdir, f"export_{name}")
    e.export("actor", os.path.join(out_dir, "actor"))
    e.export("critic", os.path.join(out_dir, "critic"))
    if rank == 0:
        try:
            from safetensors.torch import load_file
            from transformers import AutoModelForSequenceClassification

            actor = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "actor")).eval()
            critic = AutoModelForSequenceClassification.from_pretrained(os.path.join(out_dir, "critic")).eval()
            res["export"] = {
                "actor_max_diff": float((hf_logprobs(actor, r) - actor_lp).abs().max()),
                "critic_max_diff": float((hf_values(critic, r) - values).abs().max()),
                "adapter_keys": [k for role in ("actor", "critic") for k in
                                 load_file(os.path.join(out_dir, role, "model.safetensors")) if "lora" in k]}
        except Exception:  # noqa: BLE001  (recorded for the test instead of killing the launch)
            res["export"] = {"error": traceback.format_exc()}
    torch.distributed.barrier()
    res["total_s"] = time.time() - t0
    return res


# ---- EMA and gather-once generation ----------------------------------------------------------------------------
class CollectiveCounter:
    """Counts DeepSpeed's collectives (the comm backend every ZeRO-3 fetch goes through) and torch.distributed's
    all_reduce (transformers' synced_gpus) while active."""

    NAMES = ("all_gather_into_tensor", "all_gather", "all_reduce", "broadcast", "reduce_scatter_tensor",
             "all_gather_coalesced", "barrier")

    def __init__(self):
        import deepspeed.comm.comm as ds_comm

        self.cdb = ds_comm.cdb
        self.counts = {}
        self.active = False
        for name in self.NAMES:
            fn = getattr(self.cdb, name, None)
            if fn is not None:
                setattr(self.cdb, name, self._wrap("ds." + name, fn))
        self._torch_all_reduce = torch.distributed.all_reduce
        torch.distributed.all_reduce = self._wrap("torch.all_reduce", self._torch_all_reduce)

    def _wrap(self, key, fn):
        def wrapped(*a, **kw):
            if self.active:
                self.counts[key] = self.counts.get(key, 0) + 1
            return fn(*a, **kw)
        return wrapped

    def measure(self, fn):
        self.counts = {}
        self.active = True
        try:
            out = fn()
        finally:
            self.active = False
        return out, dict(self.counts)


@settled  # spec_runner.py: settle() once the run has returned (nothing of it held any more)
def run_ema_and_gather(args, dist) -> dict:
    t0 = time.time()
    beta = 0.6
    cfg = make_cfg(args, 3, enable_ema=True, ema_decay=beta, generation_gather_once="off")
    # Make the tiny actor behave like a large one under ZeRO-3: by default DeepSpeed keeps parameters resident when
    # they are reused within 1e9 elements (the whole tiny model), so per-layer fetching would hardly fetch anything.
    # No reuse distance, no prefetch bucket and no persistent parameters: every module fetches its weights on every
    # forward, as a model of billions of parameters does. (The EMA engine keeps the default template, with persistent
    # small parameters: its update then also exercises the resident-copy path.)
    ds_file = os.path.join(args.workdir, "actor_ds.json")
    if dist.rank == 0:
        with open(ds_file, "w") as f:
            json.dump({"zero_optimization": {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                             "stage3_param_persistence_threshold": 0}}, f)
    torch.distributed.barrier()
    cfg.actor.ds_config = ds_file
    cfg.validate()
    e = RLHFEngine(cfg, dist, plan_engine(cfg, 3))
    rank = dist.rank
    res = {"stages": {k: p.stage for k, p in e.plans.items()}, "ema_wrapper": type(e.ema.optimizer).__name__}
    sizes = [(n, tuple(p.ds_tensor.shape), tuple(q.ds_tensor.shape)) for (n, p), (_, q) in
             zip(e.actor.module.named_parameters(), e.ema.module.named_parameters())]
    res["partitions_equal"] = gather(all(a == b for _, a, b in sizes))
    res["partition_numel"] = gather(sum(a[0] for _, a, _ in sizes))
    r = fixed_rollout(rank, len(e.tokenizer), int(e.tokenizer.eos_token_id), e.pad_token_id)
    thetas = [e.full_state_dict("actor")]
    updated = []

    def after_actor_step():
        updated.append(e.update_ema())
        thetas.append(e.full_state_dict("actor"))

    train(e, r, 3, after_actor_step)
    ema = e.full_state_dict("ema")
    res["updated"] = updated
    if rank == 0:
        n = len(thetas) - 1
        worst, moved = 0.0, 0.0
        for k, v in ema.items():
            want = beta ** n * thetas[0][k] + sum((1 - beta) * beta ** (n - i) * thetas[i][k] for i in range(1, n + 1))
            worst = max(worst, float((v.double() - want.double()).abs().max()))
            moved = max(moved, float((v - thetas[-1][k]).abs().max()))
        res["ema_closed_form_max_diff"] = worst
        res["ema_vs_last_actor_max_diff"] = moved
        res["ema_keys_equal_actor_keys"] = sorted(ema) == sorted(thetas[-1])
    e.export("ema", os.path.join(args.workdir, "export_ema"))
    if rank == 0:
        from transformers import AutoModelForCausalLM

        sd = AutoModelForCausalLM.from_pretrained(os.path.join(args.workdir, "export_ema")).state_dict()
        res["ema_export_max_diff"] = max(float((sd[k] - ema[k]).abs().max()) for k in ema)
    # the EMA engine's forward reads the updated partitions (persistent small parameters included)
    with torch.no_grad():
        ema_lp = e._lm_forward(e.ema, r, False)[0]
    if rank == 0:
        from transformers import AutoModelForCausalLM

        ema_model = AutoModelForCausalLM.from_pretrained(os.path.join(args.workdir, "export_ema")).eval()
        res["ema_forward_vs_export"] = float((hf_logprobs(ema_model, r) - ema_lp).abs().max())
    torch.distributed.barrier()

    # ---- generation: per-layer fetching vs gather-once ----
    counter = CollectiveCounter()
    prompts = [r.prompts[0][r.attention_mask[0, : r.prompt_length].bool()].tolist(),
               r.prompts[1][r.attention_mask[1, : r.prompt_length].bool()].tolist()]
    ids, mask = pad_prompts(prompts, e.pad_token_id)
    gen = {}
    backends = {"hf": BACKENDS["hf"](e.generator.ctx), "lean": BACKENDS["lean"](e.generator.ctx)}
    for name, backend in backends.items():
        for mode in ("off", "on", "replica"):
            for new in (2, 8):
                cfg.engine.generation_gather_once = mode
                params = dataclasses.replace(e.sampling, max_new_tokens=new)
                torch.distributed.barrier()
                t = time.time()
                out, counts = counter.measure(lambda: backend.generate(ids, mask, params))
                gen[f"{name}_{mode}_{new}"] = {"counts": counts, "responses": out.rollout.responses.tolist(),
                                               "logprobs": out.logprobs.tolist(), "s": time.time() - t,
                                               "mode": backend.zero3_mode()}
    # the replica follows training: one more actor step, then replica and per-layer fetching agree again
    train(e, r, 1)
    params = dataclasses.replace(e.sampling, max_new_tokens=8)
    for mode in ("replica", "off"):
        cfg.engine.generation_gather_once = mode
        out = backends["lean"].generate(ids, mask, params)
        gen[f"trained_{mode}"] = {"responses": out.rollout.responses.tolist(), "logprobs": out.logprobs.tolist()}
    res["generation"] = gather(gen)
    # ranks stop at different lengths (rank 0 after 1 token, rank 1 after 8) when the actor is held whole: no
    # collective while decoding
    uneven = {}
    for name, mode in (("hf", "on"), ("lean", "replica")):
        cfg.engine.generation_gather_once = mode
        params = dataclasses.replace(e.sampling, max_new_tokens=1 if rank == 0 else 8)
        torch.distributed.barrier()
        g, counts = counter.measure(lambda: backends[name].generate(ids, mask, params).rollout)
        uneven[f"{name}_{mode}"] = {"width": g.response_width, "counts": counts, "responses": g.responses.tolist(),
                                    "max_new": params.max_new_tokens}
    res["uneven"] = gather(uneven)
    res["replica_fails_on_rank1"] = gather(replica_fails_on_one_rank(e, ids, mask, rank))
    res["layers"] = len(e.actor.module.transformer.h)
    res["actor_params"] = len(list(e.actor.module.parameters()))
    res["total_s"] = time.time() - t0
    return res


def replica_fails_on_one_rank(e: RLHFEngine, ids, mask, rank: int) -> dict:
    """The replica cannot be built on rank 1 only (an out-of-memory error, which happens on one rank): every rank
    must then gather in place, and generate what the gathered mode generates (a rank left on another path would
    hang in a collective, and the launch would time out)."""
    import rlhf_engine.engine.generation.base as generation  # where the backends build their replica

    real = generation.GenerationReplica

    def fails(*a, **kw):
        raise torch.OutOfMemoryError("injected on rank 1: cannot allocate the replica")

    e.cfg.engine.generation_gather_once = "replica"
    backend = BACKENDS["lean"](e.generator.ctx)
    params = dataclasses.replace(e.sampling, max_new_tokens=4, do_sample=False)
    if rank == 1:
        generation.GenerationReplica = fails
    try:
        out = backend.generate(ids, mask, params)
    finally:
        generation.GenerationReplica = real
    e.cfg.engine.generation_gather_once = "on"
    gathered = BACKENDS["lean"](e.generator.ctx).generate(ids, mask, params)
    return {"mode": backend.zero3_mode(), "error": backend._replica_error,
            "responses": out.rollout.responses.tolist(), "gathered": gathered.rollout.responses.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--actor", required=True)
    ap.add_argument("--reward", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", required=True)
    args = ap.parse_args()
    t0 = time.time()
    dist = init_distributed()
    results = {"world_size": dist.world_size}
    results["lora_z2"] = run_lora("lora_z2", 2, args, dist)
    results["lora_z3"] = run_lora("lora_z3", 3, args, dist)
    results["z3_ema"] = run_ema_and_gather(args, dist)
    results["total_s"] = time.time() - t0
    if dist.rank == 0:
        with open(args.out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(args.out + ".tmp", args.out)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
