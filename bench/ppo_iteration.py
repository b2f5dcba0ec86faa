"""K PPO iterations of rlhf_engine for one model/batch setup and one or more engine variants; JSON + a markdown table.

    python bench/ppo_iteration.py --preset cpu-tiny --out /tmp/r.json                       (one rank)
    torchrun --nproc_per_node 2 bench/ppo_iteration.py --preset cpu-tiny --global-batch 8 ...   (two ranks)
    python bench/ppo_iteration.py --preset opt-1.3b --variant z2:zero=2 --out z2.json          (GPU)

What runs: `rlhf_engine.trainer.build_trainer(cfg)` (the data layer replaced by pre-tokenized random prompts, see
`benchlib.synthetic_prompt_data`), then `trainer.step()` W (warm-up) + K times. Random-weight OPT models are built
from configs (`benchlib.SHAPES`). `--fixed-length` (the default) sets min_answer_seq_len = max_answer_seq_len, so every
response has exactly R tokens (DeepSpeed-Chat's benchmark setting) and the prompts are exactly P tokens.

Variants (`--variant NAME:key=value,...`, repeatable) are built side by side in ONE process and their iterations are
interleaved (round r starts with variant r mod n), so a noisy machine affects them alike; compare them by their
ratios. Keys: zero (actor/critic ZeRO stage; reference/reward follow: 3 if 3, else 0), offload (optimizer offload of
actor and critic), gather_once (on/off), gather (any generation_gather_once mode: auto, replica, on, off), backend
(generation backend: lean, hf), trim (engine.trim_padding), packing (engine.packing: on, off), tokens
(batch.max_tokens_per_micro_batch), hybrid_engine (DeepSpeed Hybrid Engine on
the actor; CUDA only), patch (patches.py, '+'-separated: candidate fixes, or 'before' patches that restore the
code before a fix the library has applied).

Per iteration: wall time; the trainer's phases (time/generate, time/experience, time/train) and finer splits from
timers wrapped around the engine INSTANCE's methods (reference/reward/critic/actor experience forwards; actor and
critic forward+backward+step); samples and generated tokens; peak memory per rank (CUDA max allocated, or the
process's peak RSS over the iteration on CPU); FLOPs by `benchlib.FLOP_FORMULA`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402  (puts the repo root on sys.path)

T_START = time.perf_counter()

PRESETS = {
    # name: (actor shape, critic/reward shape, prompt len, answer len, global batch, micro-batch, dtype)
    "cpu-tiny": dict(actor="opt-tiny", critic="opt-tiny-critic", prompt_len=16, answer_len=16, global_batch=8,
                     micro_batch=4, dtype="fp32"),
    "cpu-small": dict(actor="opt-small", critic="opt-small-critic", prompt_len=64, answer_len=64, global_batch=8,
                      micro_batch=4, dtype="fp32"),
    # DeepSpeed-Chat's single-GPU OPT example: 1.3B actor, 350M critic/reward, 256 + 256 tokens, batch 16
    "opt-1.3b": dict(actor="opt-1.3b", critic="opt-350m", prompt_len=256, answer_len=256, global_batch=16,
                     micro_batch=8, dtype="bf16"),
}
VARIANT_KEYS = {"zero": int, "offload": bool, "gather_once": bool, "gather": str, "backend": str, "trim": bool,
                "packing": str, "tokens": int, "hybrid_engine": bool, "patch": str}


class Skip(Exception):
    """A variant that cannot run here (recorded with its reason, never silently dropped)."""


def parse_variant(spec: str) -> dict:
    name, _, rest = spec.partition(":")
    v = {"name": name}
    for item in filter(None, rest.split(",")):
        k, sep, val = item.partition("=")
        if not sep or k not in VARIANT_KEYS:
            raise SystemExit(f"--variant {spec!r}: items are key=value with key in {', '.join(VARIANT_KEYS)}")
        t = VARIANT_KEYS[k]
        v[k] = (val.lower() in ("1", "true", "yes", "on")) if t is bool else t(val)
    return v


# the config switches the variants set (rlhf_engine's own flags; recorded in the result JSON)
GATHER_ONCE_FLAG = "engine.generation_gather_once"
HYBRID_ENGINE_FLAG = "engine.enable_hybrid_engine"


def nvcc_available() -> bool:
    import shutil

    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return bool(shutil.which("nvcc")) or os.path.isfile(os.path.join(home, "bin", "nvcc"))


def adam_choice(requested: str) -> str:
    """'torch' (torch.optim.AdamW through DeepSpeed's torch_adam: no JIT) or 'deepspeed' (FusedAdam on GPU, JIT-built
    with the CUDA toolkit). CPU always uses torch's (rlhf_engine's own choice)."""
    if not bl.on_gpu():
        return "torch"
    if requested == "auto":
        return "deepspeed" if nvcc_available() else "torch"
    return {"fused": "deepspeed", "torch": "torch"}[requested]


def build_config(args, v: dict, world: int, models: dict, out_dir: str):
    from rlhf_engine.config import TrainConfig

    cfg = TrainConfig()
    cfg.actor.model_name_or_path = models["actor"]
    cfg.reward.model_name_or_path = models["critic"]  # the critic starts from the reward model (the default)
    cfg.data.data_path = "synthetic.jsonl"  # never read: see benchlib.synthetic_prompt_data
    cfg.dtype = args.dtype
    g = cfg.generation
    g.max_prompt_seq_len, g.max_answer_seq_len = args.prompt_len, args.answer_len
    g.min_answer_seq_len = args.answer_len if args.fixed_length else 0
    g.do_sample, g.temperature, g.top_p, g.top_k = True, 1.0, 1.0, 0
    b = cfg.batch
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} is not a multiple of the {world} ranks")
    per_rank = args.global_batch // world
    mini = per_rank // args.mini_batches
    if per_rank % args.mini_batches or mini == 0:
        raise SystemExit(f"{per_rank} rollouts per rank do not split into {args.mini_batches} mini-batches")
    micro = min(args.micro_batch, mini)
    if mini % micro:
        raise SystemExit(f"mini-batch {mini} per rank is not a multiple of --micro-batch {micro}")
    b.per_device_generation_batch_size, b.generation_batches = per_rank, 1
    b.per_device_training_batch_size, b.gradient_accumulation_steps = micro, mini // micro
    b.experience_micro_batch_size = min(args.experience_micro_batch or per_rank, per_rank)
    cfg.ppo.ppo_epochs = args.ppo_epochs
    zero = v.get("zero", 0)
    cfg.actor.zero_stage = cfg.critic.zero_stage = zero
    if v.get("offload"):
        cfg.actor.offload = cfg.critic.offload = True
    v["_settings"] = []
    if "gather_once" in v:
        cfg.engine.generation_gather_once = "on" if v["gather_once"] else "off"
        v["_settings"].append(f"{GATHER_ONCE_FLAG}={cfg.engine.generation_gather_once}")
    if "gather" in v:  # any generation_gather_once mode (auto, replica, on, off)
        cfg.engine.generation_gather_once = v["gather"]
        v["_settings"].append(f"{GATHER_ONCE_FLAG}={v['gather']}")
    if "trim" in v:
        cfg.engine.trim_padding = v["trim"]
        v["_settings"].append(f"engine.trim_padding={v['trim']}")
    if "packing" in v:
        cfg.engine.packing = v["packing"]
        v["_settings"].append(f"engine.packing={v['packing']}")
    if "tokens" in v:
        cfg.batch.max_tokens_per_micro_batch = v["tokens"]
        v["_settings"].append(f"batch.max_tokens_per_micro_batch={v['tokens']}")
    if "backend" in v:
        cfg.engine.generation_backend = v["backend"]
        v["_settings"].append(f"engine.generation_backend={v['backend']}")
    overrides = {"actor": {}, "critic": {}}
    if bl.on_gpu() and args.adam_impl == "torch":  # keep DeepSpeed from JIT-building FusedAdam
        for role in overrides:
            overrides[role]["optimizer"] = {"params": {"torch_adam": True}}
    if v.get("hybrid_engine"):
        if not bl.on_gpu():
            raise Skip("the Hybrid Engine needs a CUDA GPU (DeepSpeed's inference kernels have no CPU build)")
        if not nvcc_available():
            raise Skip("the Hybrid Engine's inference kernels are JIT-compiled on first use and need the CUDA "
                       "toolkit (nvcc), which this machine lacks")
        cfg.engine.enable_hybrid_engine = True  # rlhf_engine's own support (its generate switches eval/train itself)
        v["_settings"].append(f"{HYBRID_ENGINE_FLAG}=true")
    os.makedirs(out_dir, exist_ok=True)
    for role, over in overrides.items():
        if over:
            path = os.path.join(out_dir, f"bench_ds_{role}.json")
            with open(path, "w") as f:
                json.dump(over, f)
            getattr(cfg, role).ds_config = path
    cfg.run.output_dir = out_dir
    cfg.run.overwrite_output_dir = True
    cfg.max_steps = args.warmup + args.iterations
    cfg.seed = args.seed
    return cfg


class Built:
    def __init__(self, v, trainer, contexts, build_s):
        self.v, self.trainer, self.contexts, self.build_s = v, trainer, contexts, build_s
        self.timer = bl.PhaseTimer()
        self.timer.instrument(trainer.engine)
        self.iterations: list[dict] = []


def build_variant(args, v: dict, world: int, models: dict, prompts: list, run_dir: str) -> Built:
    from patches import apply_patches
    from rlhf_engine.trainer import build_trainer

    cfg = build_config(args, v, world, models, os.path.join(run_dir, v["name"]))
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, prompt_data=bl.synthetic_prompt_data(prompts))
    contexts = apply_patches(trainer, [p for p in v.get("patch", "").split("+") if p])
    bl.sync()
    return Built(v, trainer, contexts, time.perf_counter() - t0)


def gather(obj):
    from rlhf_engine import comm

    return comm.all_gather_object(obj)


def run_iteration(b: Built, it: int, warmup: bool, count_syncs: bool) -> dict:
    import contextlib

    from patches import SyncCounter, summarize_syncs
    from rlhf_engine.engine.distributed import barrier

    trainer = b.trainer
    b.timer.reset()
    barrier()
    method = bl.reset_peak_memory()
    counter = SyncCounter() if count_syncs else None
    with contextlib.ExitStack() as stack:
        for ctx in b.contexts:
            stack.enter_context(ctx())
        if counter is not None:
            stack.enter_context(counter)
        bl.sync()
        t0 = time.perf_counter()
        rec = trainer.step()
        bl.sync()
        wall = time.perf_counter() - t0
    r = trainer.last_experience.rollout
    B, L = r.sequences.shape
    local = {
        "wall_s": wall, "phases": bl.split_phases(rec, b.timer), "calls": dict(b.timer.n),
        "flops": bl.iteration_flops(N_PARAMS, B, L, trainer.cfg.ppo.ppo_epochs),
        "peak_mem_mib": bl.peak_memory_mib(), "batch": B, "width": L, "P": r.prompt_length, "R": r.response_width,
        "real_tokens": int(r.attention_mask.sum()), "generated_tokens": int(r.action_mask.sum()),
    }
    if counter is not None:
        local["host_syncs"] = summarize_syncs(counter.counts)
    ranks = gather(local)
    phases = {k: sum(x["phases"][k] for x in ranks) / len(ranks) for k in ranks[0]["phases"]}

    def tflops(phase_flops_key: str, time_key: str) -> float | None:
        vals = [x["flops"][phase_flops_key] / x["phases"][time_key] / 1e12 for x in ranks if x["phases"][time_key] > 0]
        return sum(vals) / len(vals) if vals else None

    total_flops = [sum(x["flops"].values()) for x in ranks]
    entry = {
        "iteration": it, "warmup": warmup,
        "wall_s": max(x["wall_s"] for x in ranks),
        "samples": sum(x["batch"] for x in ranks),
        "generated_tokens": sum(x["generated_tokens"] for x in ranks),
        "padding_fraction": 1 - sum(x["real_tokens"] for x in ranks) / sum(x["batch"] * x["width"] for x in ranks),
        "shape": {"B_per_rank": ranks[0]["batch"], "P": ranks[0]["P"], "R": ranks[0]["R"]},
        "phases_s": phases,
        "calls": ranks[0]["calls"],
        "flops_per_rank": ranks[0]["flops"],
        "tflops": {"generation": tflops("generation", "generation"), "experience": tflops("experience", "experience"),
                   "training": tflops("training", "training"),
                   "overall": sum(f / x["wall_s"] for f, x in zip(total_flops, ranks)) / len(ranks) / 1e12},
        "peak_mem_mib": [x["peak_mem_mib"] for x in ranks],
        "memory_method": method,
        "metrics": {k: rec.get(k) for k in ("objective/score", "objective/kl", "rollout/response_length",
                                            "policy/ratio_mean", "throughput/samples_per_s")},
    }
    if count_syncs:
        entry["host_syncs"] = [x["host_syncs"] for x in ranks]
    b.iterations.append(entry)
    return entry


def summarize(b: Built) -> dict:
    its = [e for e in b.iterations if not e["warmup"]] or b.iterations
    if not its:
        return {}
    wall = sum(e["wall_s"] for e in its)
    ph = {k: sum(e["phases_s"][k] for e in its) for k in its[0]["phases_s"]}
    flops = {k: sum(e["flops_per_rank"][k] for e in its) for k in its[0]["flops_per_rank"]}
    samples, tokens = sum(e["samples"] for e in its), sum(e["generated_tokens"] for e in its)
    n_ranks = len(its[0]["peak_mem_mib"])
    return {
        "measured_iterations": len(its),
        "iteration_s_median": bl.median([e["wall_s"] for e in its]),
        "iteration_s_mean": wall / len(its),
        "samples_per_s": samples / wall,
        "generated_tokens_per_s": tokens / wall,
        "generation_tokens_per_s": tokens / ph["generation"] if ph["generation"] else None,
        "share": {k: v / wall for k, v in ph.items()},
        "phase_s_mean": {k: v / len(its) for k, v in ph.items()},
        # rank 0's FLOPs over the phase's rank-mean time (ranks hold equal batches)
        "tflops_per_rank": {"generation": flops["generation"] / ph["generation"] / 1e12 if ph["generation"] else None,
                            "experience": flops["experience"] / ph["experience"] / 1e12 if ph["experience"] else None,
                            "training": flops["training"] / ph["training"] / 1e12 if ph["training"] else None,
                            "overall": sum(flops.values()) / wall / 1e12},
        "peak_mem_mib_per_rank": [max(e["peak_mem_mib"][r] for e in its) for r in range(n_ranks)],
        "padding_fraction": sum(e["padding_fraction"] for e in its) / len(its),
        "shape": its[-1]["shape"],
    }


def greedy_check(b: Built, n_prompts: int, new_tokens: int, hybrid: bool) -> dict:
    """Greedy generation through the Hybrid Engine's inference kernels (actor.eval()) against the same weights on the
    native HF path (actor.train() + module.eval()); plus the prefill logits of both. With hybrid=False both sides
    are the native path: a check of this harness, which must agree exactly."""
    import torch

    from rlhf_engine.data.prompts import collate_prompts

    eng = b.trainer.engine
    actor, model = eng.actor, eng.actor.module
    idx = list(range(min(n_prompts, len(b.trainer.dataset))))
    ids, mask = collate_prompts(b.trainer.dataset, idx, eng.pad_token_id)
    ids, mask = ids.to(eng.device), mask.to(eng.device)
    from rlhf_engine.engine.generation import BACKENDS

    kw = BACKENDS["hf"](eng.generator.ctx).generation_kwargs(eng.sampling)  # the HF backend's arguments
    kw.pop("synced_gpus")
    kw.update(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens)
    from transformers import GenerationConfig

    gen_config = GenerationConfig(**kw)  # the sampling parameters alone, as the HF backend builds it
    out = {"prompts": len(idx), "new_tokens": new_tokens, "hybrid": hybrid,
           "inference_containers": len(getattr(actor, "_inference_containers", []) or [])}

    def run(mode: str):
        if mode == "hybrid":
            actor.eval()
        else:
            actor.train()
            model.eval()
        try:
            with torch.no_grad():
                bl.sync()
                t0 = time.perf_counter()
                seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_config)
                bl.sync()
                dt = time.perf_counter() - t0
                logits = model(input_ids=ids, attention_mask=mask).logits[:, -1].float()
            return seq[:, ids.shape[1]:], logits, dt
        finally:
            actor.train()

    try:
        ref_seq, ref_logits, ref_dt = run("native")
        he_seq, he_logits, he_dt = run("hybrid" if hybrid else "native")
        n = min(ref_seq.shape[1], he_seq.shape[1])
        same = ref_seq[:, :n] == he_seq[:, :n]
        first_diff = [int((~row).nonzero()[0]) if not bool(row.all()) else n for row in same]
        out.update(
            native_generate_s=ref_dt, checked_generate_s=he_dt, speedup=ref_dt / he_dt if he_dt else None,
            token_agreement=float(same.float().mean()), identical_rows=int(same.all(-1).sum()),
            first_token_agreement=float(same[:, 0].float().mean()),
            mean_first_divergence=sum(first_diff) / len(first_diff),
            prefill_logits_max_abs_diff=float((he_logits - ref_logits).abs().max()),
            prefill_logits_max_abs=float(ref_logits.abs().max()),
            prefill_argmax_agreement=float((he_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()))
        out["passed"] = (out["first_token_agreement"] == 1.0 and out["prefill_argmax_agreement"] == 1.0) if hybrid \
            else out["token_agreement"] == 1.0
    except Exception as e:  # noqa: BLE001  (a failing kernel path is a result to record)
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:], passed=False)
    return out


def equivalence_check(built: list) -> list:
    """Every variant's experience and training forward on ONE rollout (generated by the first variant), against the
    first variant's: max |difference| per quantity. A fix must leave these at rounding level."""
    import contextlib

    import torch

    from rlhf_engine.data.prompts import collate_prompts
    from rlhf_engine.trainer.experience import build_experience, experience_forwards, global_mean_var, group_ids_of

    t0 = built[0].trainer
    ids, mask = collate_prompts(t0.dataset, t0.sampler.indices(0, 0), t0.engine.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        rollout = t0.engine.generate(ids, mask)
    ref, out = None, []
    for b in built:
        t = b.trainer
        with contextlib.ExitStack() as stack:
            for ctx in b.contexts:
                stack.enter_context(ctx())
            with torch.random.fork_rng(devices=[]):  # the same seed: the same tokens if the logits are the same
                torch.manual_seed(0)
                own = t.engine.generate(ids, mask)
            fw = experience_forwards(t.engine, rollout)
            exp = build_experience(rollout, fw, fw.scores, t.cfg.ppo, t.kl_ctl.value, moments=global_mean_var,
                                   group_ids=group_ids_of(rollout.batch_size, 1, rollout.sequences.device))
            entropy = fw.entropy
            with torch.no_grad():
                train_lp, _ = t.engine.actor_forward(rollout)
                train_values = t.engine.critic_forward(rollout)
        got = {"old_logprobs": exp.old_logprobs, "ref_logprobs": exp.ref_logprobs, "values": exp.values,
               "scores": exp.scores, "entropy": entropy, "train_logprobs": train_lp, "train_values": train_values}
        got = {k: v.detach().float().cpu() for k, v in got.items()}
        if ref is None:
            ref = got
        same_shape = own.sequences.shape == rollout.sequences.shape
        out.append({"variant": b.v["name"],
                    "max_abs_diff": {k: float((got[k] - ref[k]).abs().max()) for k in got},
                    "sampled_tokens_equal": float((own.sequences == rollout.sequences).float().mean())
                    if same_shape else 0.0})
    return out


def markdown(result: dict) -> str:
    rows = ["| variant | samples/s | gen. tokens/s | iteration s | generation | experience (actor/ref/reward/critic) "
            "| actor train | critic train | TFLOP/s per rank | peak mem per rank (MiB) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for v in result["variants"]:
        s = v.get("summary")
        if not s:
            rows.append(f"| {v['name']} | skipped: {v.get('skipped') or v.get('error', '?')} |||||||||")
            continue
        sh = s["share"]
        pct = lambda k: f"{100 * sh[k]:.0f}%"  # noqa: E731
        exp = (f"{pct('experience')} ({pct('experience/actor_logprobs')}/{pct('experience/reference')}/"
               f"{pct('experience/reward')}/{pct('experience/critic')})")
        rows.append(f"| {v['name']} | {bl.fmt(s['samples_per_s'])} | {bl.fmt(s['generated_tokens_per_s'])} | "
                    f"{bl.fmt(s['iteration_s_median'])} | {pct('generation')} | {exp} | {pct('training/actor')} | "
                    f"{pct('training/critic')} | {bl.fmt(s['tflops_per_rank']['overall'])} | "
                    f"{', '.join(bl.fmt(m) for m in s['peak_mem_mib_per_rank'])} |")
    return "\n".join(rows) + "\n"


N_PARAMS: dict = {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu-tiny")
    p.add_argument("--actor-shape", choices=sorted(bl.SHAPES))
    p.add_argument("--critic-shape", choices=sorted(bl.SHAPES))
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--answer-len", type=int)
    p.add_argument("--variable-length", dest="fixed_length", action="store_false",
                   help="prompts of random length in [P/4, P] and responses that may stop at EOS (default: fixed)")
    p.add_argument("--global-batch", type=int, help="rollouts per iteration over all ranks")
    p.add_argument("--micro-batch", type=int, help="training micro-batch per rank")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per PPO epoch")
    p.add_argument("--experience-micro-batch", type=int, default=0)
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--iterations", type=int, default=3, help="measured iterations (K)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up iterations, reported but not summarized")
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds from process start; no new round starts once the projected end passes it")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (see module docstring)")
    p.add_argument("--greedy-check", type=int, default=0, metavar="N",
                   help="before the iterations, compare greedy generation of N prompts through the Hybrid Engine "
                        "with the native path (hybrid_engine variants; without a GPU a harness self-check)")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--check-equivalence", action="store_true",
                   help="before the iterations, compare every variant's experience/training forwards on one rollout")
    p.add_argument("--count-syncs", action="store_true", help="count host syncs per iteration (perturbs timing)")
    p.add_argument("--adam", choices=("auto", "torch", "fused"), default="auto",
                   help="GPU optimizer: auto = DeepSpeed FusedAdam when nvcc is found (JIT build), else torch AdamW")
    p.add_argument("--prepare-only", action="store_true", help="only build the model folders (cached), then exit")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--work-dir", default=os.environ.get("BENCH_WORK_DIR", os.path.join(
        os.environ.get("TMPDIR", "/tmp"), "rlhf_bench")))
    p.add_argument("--label", default="")
    p.add_argument("--out", required=True, help="JSON result file")
    p.add_argument("--md", help="also write the markdown table here")
    args = p.parse_args(argv)
    for k, val in PRESETS[args.preset].items():
        key = {"actor": "actor_shape", "critic": "critic_shape"}.get(k, k)
        if getattr(args, key, None) is None:
            setattr(args, key, val)
    args.adam_impl = adam_choice(args.adam)

    models_dir = os.path.join(args.work_dir, "models")
    if args.prepare_only:
        t0 = time.perf_counter()
        for shape, head, seed in ((args.actor_shape, "causal_lm", 0), (args.critic_shape, "score", 1)):
            print(bl.make_model_folder(models_dir, shape, head, args.dtype, seed=seed), flush=True)
        print(f"[bench] model folders ready in {time.perf_counter() - t0:.1f}s")
        return 0

    from rlhf_engine.engine import init_distributed
    from rlhf_engine.engine.distributed import barrier

    dist = init_distributed()
    world, is_main = dist.world_size, dist.is_main
    if dist.local_rank == 0:
        models = {"actor": bl.make_model_folder(models_dir, args.actor_shape, "causal_lm", args.dtype, seed=0),
                  "critic": bl.make_model_folder(models_dir, args.critic_shape, "score", args.dtype, seed=1)}
    barrier()
    models = {"actor": bl.make_model_folder(models_dir, args.actor_shape, "causal_lm", args.dtype, seed=0),
              "critic": bl.make_model_folder(models_dir, args.critic_shape, "score", args.dtype, seed=1)}
    N_PARAMS.update(actor=bl.matmul_params(args.actor_shape, "causal_lm"),
                    reference=bl.matmul_params(args.actor_shape, "causal_lm"),
                    critic=bl.matmul_params(args.critic_shape, "score"),
                    reward=bl.matmul_params(args.critic_shape, "score"))
    rounds = args.warmup + args.iterations
    prompts = bl.synthetic_prompts(args.global_batch * rounds, args.prompt_len, bl.SHAPES[args.actor_shape]
                                   ["vocab_size"], seed=args.seed, fixed=args.fixed_length)
    variants = [parse_variant(s) for s in args.variant] or [{"name": "default"}]
    # the same folder on every rank (MASTER_PORT is the launch's); a reused one is overwritten (old files kept as .bak)
    run_dir = os.path.join(args.work_dir, "runs", f"{args.label or args.preset}-{world}r-{os.environ['MASTER_PORT']}")
    result = {
        "kind": "ppo_iteration", "label": args.label, "preset": args.preset,
        "command": bl.command_line([os.path.relpath(sys.argv[0], bl.ROOT)] + sys.argv[1:]),
        "machine": bl.machine_info(), "world_size": world,
        "setup": {"actor_shape": args.actor_shape, "critic_shape": args.critic_shape, "prompt_len": args.prompt_len,
                  "answer_len": args.answer_len, "fixed_length": args.fixed_length,
                  "global_batch": args.global_batch, "micro_batch": args.micro_batch,
                  "mini_batches": args.mini_batches, "ppo_epochs": args.ppo_epochs, "dtype": args.dtype,
                  "warmup": args.warmup, "iterations": args.iterations, "adam": args.adam_impl,
                  "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "matmul_params": dict(N_PARAMS), "flop_formula": bl.FLOP_FORMULA,
        "gather_once": GATHER_ONCE_FLAG,
        "hybrid_engine_switch": HYBRID_ENGINE_FLAG,
        "variants": [],
    }
    built: list[Built] = []
    for v in variants:
        entry = {"name": v["name"], "spec": v}
        try:
            b = build_variant(args, v, world, models, prompts, run_dir)
            entry["build_s"] = b.build_s
            entry["ds_optimizer"] = type(b.trainer.engine.actor.optimizer).__name__ if \
                b.trainer.engine.actor.optimizer is not None else None
            entry["settings"] = v.get("_settings", [])
            entry["gather_once_active"] = bool(b.trainer.engine.generator.gather_once_active())
            if v.get("hybrid_engine"):
                actor = b.trainer.engine.actor
                entry["actor_engine_class"] = type(actor).__name__
                entry["hybrid_inference_containers"] = len(getattr(actor, "_inference_containers", []) or [])
                if entry["actor_engine_class"] != "DeepSpeedHybridEngine":
                    raise Skip(f"the Hybrid Engine was requested ({entry['settings']}) but the actor's engine is a "
                               f"{entry['actor_engine_class']}")
            built.append(b)
            b.entry = entry
        except Skip as e:
            entry["skipped"] = str(e)
        except Exception as e:  # noqa: BLE001  (e.g. the Hybrid Engine failing to build: record, go on)
            entry["error"] = f"{type(e).__name__}: {e}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            if is_main:
                print(entry["traceback"], file=sys.stderr)
        result["variants"].append(entry)
        gc.collect()

    def save():
        if is_main:
            for b in built:
                b.entry["iterations"] = b.iterations
                b.entry["summary"] = summarize(b)
            result["elapsed_s"] = time.perf_counter() - T_START
            result["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
            bl.write_json(args.out, result)
            if args.md:
                with open(args.md, "w") as f:
                    f.write(markdown(result))

    if args.greedy_check:
        checks = []
        for b in built:
            if b.v.get("hybrid_engine"):
                b.entry["greedy_check"] = greedy_check(b, args.greedy_check, args.greedy_tokens, hybrid=True)
                checks.append(b.entry["greedy_check"])
        if not checks and not bl.on_gpu():
            # no Hybrid Engine here: check this harness on the native path, with a plain variant
            b = built[0] if built else build_variant(args, {"name": "harness"}, world, models, prompts, run_dir)
            result["greedy_harness_check"] = greedy_check(b, args.greedy_check, args.greedy_tokens, hybrid=False)
        save()

    if args.check_equivalence and built:
        result["equivalence"] = equivalence_check(built)
        save()

    round_s = None
    for it in range(rounds):
        if args.time_budget and round_s is not None and it > args.warmup:
            if time.perf_counter() - T_START + round_s > args.time_budget:
                result["stopped_early"] = f"time budget {args.time_budget:.0f}s: {it - args.warmup} measured rounds"
                break
        t_round = time.perf_counter()
        n = len(built)
        failed = []
        for j in range(n):
            b = built[(it + j) % n]
            try:
                e = run_iteration(b, it, warmup=it < args.warmup, count_syncs=args.count_syncs)
            except Exception as exc:  # noqa: BLE001  (e.g. the Hybrid Engine's kernels failing: record it)
                if world > 1:  # the other ranks may wait in a collective: stop the launch, keeping what was saved
                    raise
                b.entry["error"] = f"iteration {it}: {type(exc).__name__}: {exc}"
                b.entry["traceback"] = traceback.format_exc()[-4000:]
                print(b.entry["traceback"], file=sys.stderr)
                failed.append(b)
                continue
            if is_main:
                print(f"[bench] {b.v['name']} iteration {it}{' (warm-up)' if e['warmup'] else ''}: "
                      f"{e['wall_s']:.2f}s, {e['samples'] / e['wall_s']:.2f} samples/s", flush=True)
        round_s = time.perf_counter() - t_round
        save()
        built = [b for b in built if b not in failed]
    for b in built:
        b.trainer.metrics.close()
    save()
    if is_main and args.md:
        print(markdown(result))
    return 1 if any("error" in v for v in result["variants"]) else 0


if __name__ == "__main__":
    rc = main()
    if "rlhf_engine.comm" in sys.modules:  # a rank of the benchmark (not the parent that launches them)
        from rlhf_engine.cli import exit_process

        exit_process(rc)
    sys.exit(rc)
