"""Many RLHFEngine checks in one multi-rank launch; rank 0 writes one JSON file that tests/distributed/test_engine.py
asserts on. Nothing is asserted here (except internal sanity): raw numbers travel to the test so that its failure
messages show them.

    deepspeed --num_gpus 2 engine_checks.py --actor DIR --reward DIR --out FILE.json --workdir DIR
        [--placements z0,z2,z3,mixed,z2off,z3off] [--export z0,z3] [--alone z0] [--negative_control]

Per placement (a set of ZeRO stages / offload flags for the four roles), built one after the other in this process:
  * the built engines: optimizer classes, offload flags, weights right after loading vs. the model folders;
  * fp32 actor log-probs / entropy, reference log-probs, critic values and reward scores on one fixed hand-made
    rollout (rank-specific rows, left-padded prompts of different lengths, an EOS-ended and a truncated row);
  * greedy generation of this rank's prompts batched (left-padded), optionally each prompt alone;
  * two actor and critic optimizer steps, then every role's full state dict against its start;
  * optionally an export of actor and critic, reloaded on rank 0 with plain `from_pretrained` and compared.
The prompts are chosen (identically on every rank, with a plain HF model) so that rank 0's greedy responses all hit
an extra stop token within 3 tokens while rank 1's never do: under ZeRO-3 rank 0 must keep joining rank 1's forwards
(synced_gpus) until rank 1 is done.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

import torch  # noqa: E402

from rlhf_engine.assets import tiny_prompts  # noqa: E402
from rlhf_engine.config import TrainConfig  # noqa: E402
from rlhf_engine.engine import RLHFEngine, init_distributed, load_tokenizer, plan_engine  # noqa: E402
from rlhf_engine.rollout import Rollout, pad_prompts, position_ids_from_mask  # noqa: E402
from spec_runner import settled  # noqa: E402

MAX_NEW = 8  # max_answer_seq_len of every placement
STEPS = 2  # optimizer steps per trained role and placement

PLACEMENTS = {
    # name: {role: (zero_stage, offload, offload_params)}
    "z0": {"actor": (0, False, False), "critic": (0, False, False), "reference": (0, False, False),
           "reward": (0, False, False)},
    "z2": {"actor": (2, False, False), "critic": (2, False, False), "reference": (0, False, False),
           "reward": (0, False, False)},
    "z3": {"actor": (3, False, False), "critic": (3, False, False), "reference": (3, False, False),
           "reward": (3, False, False)},
    "mixed": {"actor": (3, False, False), "critic": (2, False, False), "reference": (None, False, False),
              "reward": (None, False, False)},
    "z2off": {"actor": (2, True, False), "critic": (2, True, False), "reference": (0, False, False),
              "reward": (0, False, False)},
    "z3off": {"actor": (3, True, True), "critic": (3, True, False), "reference": (3, True, False),
              "reward": (3, False, False)},
}


def gather(obj):
    out = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


def rows(t: torch.Tensor) -> list:
    return t.detach().float().cpu().tolist()


# ---- prompts: chosen with a plain HF model, identically on every rank ------------------------------------------
def plan_prompts(actor_dir: str, tok, world: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(actor_dir).eval()
    eos = tok.eos_token_id
    pool = []
    seen = set()
    for i, text in enumerate(tiny_prompts(48, seed=3)):
        ids = tok(text)["input_ids"][: 2 + i % 9]  # 2-10 tokens
        if len(ids) >= 2 and tuple(ids) not in seen:
            seen.add(tuple(ids))
            pool.append(ids)
    conts, kept = [], []
    with torch.no_grad():
        for ids in pool:
            out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=eos,
                                 temperature=None, top_p=None, top_k=None, output_scores=True,
                                 return_dict_in_generate=True)
            # skip prompts with a near-tie between the two best tokens at some step: padding changes the float
            # rounding, which must not be able to flip a greedy choice
            margin = min(float(x[0].topk(2).values[0] - x[0].topk(2).values[1]) for x in out.scores)
            if margin < 1e-3:
                continue
            c = out.sequences[0, len(ids):].tolist()
            if eos in c:
                c = c[: c.index(eos) + 1]
            conts.append(c)
            kept.append(ids)
    pool = kept

    def spread(idx):
        """The shortest and the longest prompt of `idx` (None unless their lengths differ by 3 or more)."""
        idx = sorted(idx, key=lambda i: len(pool[i]))
        return [idx[0], idx[-1]] if idx and len(pool[idx[-1]]) - len(pool[idx[0]]) >= 3 else None

    best = None
    for T in sorted({t for c in conts for t in c[1:3]} - {eos}):
        # rank 0: T is the 2nd or 3rd greedy token (the response has 2-3 tokens); other ranks: T never comes
        early = spread([i for i, c in enumerate(conts) if T in c[1:3] and T not in c[:1]])
        never = [i for i, c in enumerate(conts) if T not in c and len(c) == MAX_NEW]
        others = [spread(never[k::world - 1]) for k in range(world - 1)]
        if early and all(others):
            best = (T, [early] + others)
            break
    if best is None:
        raise RuntimeError("no stop token splits the prompt pool (weights too flat?)")
    T, per_rank = best

    def cut(c):
        return c[: c.index(T) + 1] if T in c else c

    return {"stop_token": T,
            "prompts": [[pool[i] for i in idx] for idx in per_rank],
            "expected": [[cut(conts[i]) for i in idx] for idx in per_rank]}


def fixed_rollout(prompts: list, rank: int, vocab: int, eos: int, pad: int) -> Rollout:
    """This rank's hand-made rollout: row 0 ends with EOS after 3 tokens, row 1 is truncated at R=6 tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    ids, mask = pad_prompts(prompts, pad)
    resp = torch.randint(3, vocab, (len(prompts), 6), generator=g)
    resp[0, 3] = eos
    resp[0, 4:] = pad
    return Rollout.from_generation(ids, mask, resp, [eos], pad)


# ---- plain HF references for the exports ---------------------------------------------------------------------
def hf_logprobs(model, r: Rollout) -> torch.Tensor:
    out = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids)
    P, R = r.prompt_length, r.response_width
    logits = out.logits[:, P - 1: P - 1 + R].float()
    lp = torch.log_softmax(logits, -1).gather(-1, r.sequences[:, P:].unsqueeze(-1)).squeeze(-1)
    return lp * r.action_mask


def hf_values(model, r: Rollout) -> torch.Tensor:
    out = model(input_ids=r.sequences, attention_mask=r.attention_mask, position_ids=r.position_ids,
                output_hidden_states=True)
    head = model.score(out.hidden_states[-1]).squeeze(-1).float()
    P, R = r.prompt_length, r.response_width
    return head[:, P - 1: P - 1 + R] * r.action_mask


def folder_state(path: str, scalar: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if scalar else AutoModelForCausalLM
    m = auto.from_pretrained(path, num_labels=1) if scalar else auto.from_pretrained(path)
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def strip(sd: dict, scalar: bool) -> dict:
    """Engine state dict -> HF key names (ScalarHeadModel keeps the HF model under `model.`; `head.` is an alias)."""
    if not scalar:
        return sd
    return {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}


def compare_to(sd: dict, ref: dict) -> dict:
    """Keys of `ref` missing from `sd`, and keys whose values are not bit-identical."""
    missing = sorted(k for k in ref if k not in sd)
    differ = sorted(k for k in ref if k in sd and not torch.equal(sd[k].float(), ref[k].float()))
    return {"missing": missing, "differ": differ}


# ---- one placement -------------------------------------------------------------------------------------------
def make_cfg(args, placement: dict, stop_token: int) -> TrainConfig:
    cfg = TrainConfig()
    cfg.actor.model_name_or_path = args.actor
    cfg.reward.model_name_or_path = args.reward
    cfg.dtype = "fp32"
    cfg.generation.max_prompt_seq_len = 16
    cfg.generation.max_answer_seq_len = MAX_NEW
    cfg.generation.do_sample = False
    cfg.generation.stop_token_ids = [stop_token]
    cfg.batch.per_device_generation_batch_size = 2
    cfg.batch.per_device_training_batch_size = 2
    cfg.batch.experience_micro_batch_size = 1  # forwards in two micro-batches: exercises the chunking
    for role, (stage, offload, offload_params) in placement.items():
        rc = getattr(cfg, role)
        rc.zero_stage, rc.offload, rc.offload_params = stage, offload, offload_params
        rc.learning_rate = 1e-3
        rc.gradient_clipping = 0.0
    return cfg


def engine_outputs(e: RLHFEngine, r: Rollout) -> dict:
    lp, ent = e.actor_logprobs(r, with_entropy=True)
    return {"actor_logprobs": rows(lp), "entropy": rows(ent), "ref_logprobs": rows(e.ref_logprobs(r)),
            "critic_values": rows(e.critic_values(r)), "reward_scores": rows(e.reward_scores(r))}


def responses(r: Rollout) -> list:
    return [r.responses[b, : int(r.response_lengths[b])].tolist() for b in range(r.batch_size)]


@settled  # spec_runner.py: settle() once the run has returned (nothing of it held any more)
def run_placement(name: str, args, plan: dict, dist, results: dict, start_folders: dict) -> None:
    t0 = time.time()
    rank, world = dist.rank, dist.world_size
    placement = PLACEMENTS[name]
    cfg = make_cfg(args, placement, plan["stop_token"])
    e = RLHFEngine(cfg, dist, plan_engine(cfg, 10))
    res = {"build_s": time.time() - t0, "stages": {k: p.stage for k, p in e.plans.items()}}

    # what was built
    built = {}
    for role, eng in e.engines.items():
        opt = eng.optimizer
        inner = getattr(opt, "optimizer", None) if opt is not None else None
        built[role] = {"wrapper": type(opt).__name__ if opt is not None else None,
                       "optimizer": type(inner).__name__ if inner is not None else (
                           type(opt).__name__ if isinstance(opt, torch.optim.Optimizer) else None),
                       "offload_optimizer": bool(eng.zero_offload_optimizer()),
                       "offload_param": bool(eng.zero_offload_param())}
    res["built"] = built

    # weights right after loading == the folders (rank 0 compares; every rank joins the gathers)
    start = {}
    check_start = {}
    for role in e.engines:
        sd = e.full_state_dict(role)
        if rank == 0:
            scalar = role in ("critic", "reward")
            start[role] = sd
            check_start[role] = compare_to(strip(sd, scalar), start_folders[role])
    res["start_vs_folder"] = check_start

    # fixed rollout forwards
    r = fixed_rollout(plan["prompts"][rank], rank, len(e.tokenizer), int(e.tokenizer.eos_token_id), e.pad_token_id)
    outs = engine_outputs(e, r)
    res["fixed"] = gather(outs)
    res["fixed_layout"] = gather({"prompt_length": r.prompt_length, "response_lengths": r.response_lengths.tolist(),
                                  "ended_with_eos": r.ended_with_eos.tolist()})

    if args.negative_control and name == "z0":
        e.hooks.use_position_ids = False
        wrong = e.actor_logprobs(r)
        e.hooks.use_position_ids = True
        right = torch.tensor(outs["actor_logprobs"])
        pad_rows = (r.attention_mask[:, : r.prompt_length] == 0).any(-1)
        res["no_position_ids_max_diff_padded_rows"] = gather(
            float((wrong - right).abs()[pad_rows].max()) if pad_rows.any() else None)

    # greedy generation, batched (left-padded prompts of different lengths)
    ids, mask = pad_prompts(plan["prompts"][rank], e.pad_token_id)
    t = time.time()
    g = e.generate(ids, mask)
    res["generate_s"] = time.time() - t
    res["generated"] = gather({"responses": responses(g), "width": g.response_width,
                               "ended": g.ended_with_eos.tolist(), "prompt_length": g.prompt_length,
                               "position_ids_ok": bool(torch.equal(g.position_ids,
                                                                   position_ids_from_mask(g.attention_mask)))})
    if name in args.alone:
        alone = []
        for p in plan["prompts"][rank]:
            one = e.generate(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long))
            alone.append(responses(one)[0])
        res["alone"] = gather(alone)

    # training steps on the fixed rollout
    t = time.time()
    tokens = r.action_mask.sum().double()
    torch.distributed.all_reduce(tokens)
    for _ in range(STEPS):
        lp, _ = e.actor_forward(r)
        e.backward("actor", -(lp * r.action_mask).sum() / tokens.float())
        e.step("actor")
        v = e.critic_forward(r)
        e.backward("critic", (((v - 1.0) ** 2) * r.action_mask).sum() / tokens.float())
        e.step("critic")
    res["train_s"] = time.time() - t
    res["optimizer_steps"] = {role: e.optimizer_steps(role) for role in ("actor", "critic")}
    after = {}
    for role in e.engines:
        sd = e.full_state_dict(role)
        if rank == 0:
            trainable = [n for n, p in e.engines[role].module.named_parameters() if p.requires_grad]
            frozen_all = all(not p.requires_grad for p in e.engines[role].module.parameters())
            flags = [p.requires_grad for _, p in e.engines[role].module.named_parameters()]
            after[role] = {"n_params": len(trainable) if role in ("actor", "critic") else None,
                           "frozen": frozen_all, "flags": flags,
                           "unchanged": sorted(n for n in trainable if torch.equal(sd[n], start[role][n])),
                           "changed_buffers_or_params": sorted(k for k in start[role]
                                                               if not torch.equal(sd[k], start[role][k])),
                           "keys_equal": sorted(sd) == sorted(start[role])}
    res["after_training"] = after
    post = engine_outputs(e, r)
    res["post_training"] = gather({"actor_logprobs": post["actor_logprobs"], "critic_values": post["critic_values"]})

    # export and reload with plain from_pretrained on rank 0
    if name in args.export:
        out_dir = os.path.join(args.workdir, f"export_{name}")
        e.export("actor", os.path.join(out_dir, "actor"))
        e.export("critic", os.path.join(out_dir, "critic"))
        if rank == 0:
            try:  # rank 0 alone (no collectives): a failure is recorded for the test instead of killing the launch
                res["export"] = reload_export(out_dir, r, post)
            except Exception:  # noqa: BLE001
                res["export"] = {"dir": out_dir, "error": traceback.format_exc()}
        torch.distributed.barrier()

    res["total_s"] = time.time() - t0
    results["placements"][name] = res


def reload_export(out_dir: str, r: Rollout, post: dict) -> dict:
    """Reload the exported actor/critic with plain `from_pretrained` and compare with the engine's outputs."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    actor = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "actor")).eval()
    critic = AutoModelForSequenceClassification.from_pretrained(os.path.join(out_dir, "critic")).eval()
    tok = AutoTokenizer.from_pretrained(os.path.join(out_dir, "actor"))
    with torch.no_grad():
        lp = hf_logprobs(actor, r)
        v = hf_values(critic, r)
    return {
        "dir": out_dir,
        "files": {k: sorted(os.listdir(os.path.join(out_dir, k))) for k in ("actor", "critic")},
        "actor_max_diff": float((lp - torch.tensor(post["actor_logprobs"])).abs().max()),
        "critic_max_diff": float((v - torch.tensor(post["critic_values"])).abs().max()),
        "actor_logprobs_nonzero": bool(lp.abs().sum() > 0),
        "critic_num_labels": critic.config.num_labels,
        "tokenizer_len": len(tok), "tokenizer_pad": tok.pad_token_id,
        "n_params": {"actor": sum(p.numel() for p in actor.parameters()),
                     "critic": sum(p.numel() for p in critic.parameters())},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--actor", required=True)
    ap.add_argument("--reward", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--placements", default="z0,z3")
    ap.add_argument("--export", default="")
    ap.add_argument("--alone", default="z0")
    ap.add_argument("--negative_control", action="store_true")
    args = ap.parse_args()
    args.export = [x for x in args.export.split(",") if x]
    args.alone = [x for x in args.alone.split(",") if x]
    t0 = time.time()
    ext_dir = os.environ.get("TORCH_EXTENSIONS_DIR")
    ext_before = sorted(os.listdir(ext_dir)) if ext_dir and os.path.isdir(ext_dir) else None

    dist = init_distributed()
    tok = load_tokenizer(args.actor)
    plan = plan_prompts(args.actor, tok, dist.world_size)
    start_folders = {}
    if dist.rank == 0:
        start_folders = {"actor": folder_state(args.actor, False), "reference": folder_state(args.actor, False),
                         "critic": folder_state(args.reward, True), "reward": folder_state(args.reward, True)}
    results = {"world_size": dist.world_size, "plan": plan, "placements": {}, "errors": {},
               "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    for name in args.placements.split(","):
        run_placement(name, args, plan, dist, results, start_folders)
    results["ext_dir"] = ext_dir
    results["ext_before"] = ext_before
    results["ext_after"] = sorted(os.listdir(ext_dir)) if ext_dir and os.path.isdir(ext_dir) else None
    results["total_s"] = time.time() - t0
    if dist.rank == 0:
        with open(args.out + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(args.out + ".tmp", args.out)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
