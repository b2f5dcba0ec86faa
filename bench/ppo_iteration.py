"""K PPO iterations of rlhf_engine for one model/batch setup and one or more engine variants; a JSON result. What
runs and what is measured: bench/README.md, "Machine and method".

    python bench/ppo_iteration.py --preset cpu-tiny --out /tmp/r.json                            (one rank)
    torchrun --nproc_per_node 2 bench/ppo_iteration.py --preset cpu-tiny --global-batch 8 ...    (two ranks)

Variants (`--variant NAME:key=value,...`, repeatable) are built side by side in ONE process and their iterations are
interleaved (round r starts with variant r mod n), so a noisy machine affects them alike: compare them by their
ratios. Keys: zero (actor/critic ZeRO stage; reference/reward follow: 3 if 3, else 0), offload (optimizer offload of
actor and critic), gather_once (engine.generation_gather_once: auto, replica, on, off; 1/0 = on/off), backend
(engine.generation_backend: lean, hf), trim (engine.trim_padding), packing (engine.packing: on, off, auto), tokens
(batch.max_tokens_per_micro_batch), hybrid_engine (engine.enable_hybrid_engine; CUDA only), vllm_sleep
(engine.vllm_sleep_level), vllm_tp (engine.vllm_tensor_parallel_size: one size per process), from_update (ppo.old_logprobs_from_update: 0 = the
actor's and critic's experience forwards always run). Rollout servers are
measured by bench/async_rollouts.py (each run its own launch, beside a server). On a GPU every iteration also records
what the device held (every allocator's share) after the rollouts and at its end.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
import traceback
from typing import Optional

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402  (puts the repository root on sys.path)

T_START = time.perf_counter()
GATHER_ONCE_FLAG = "engine.generation_gather_once"
HYBRID_ENGINE_FLAG = "engine.enable_hybrid_engine"


def _bool(s: str) -> bool:
    return s.lower() in ("1", "true", "yes", "on")


def _gather(s: str) -> str:
    return {"1": "on", "true": "on", "0": "off", "false": "off"}.get(s.lower(), s)


# variant key -> (parser, the config field it sets, or None when build_config handles it)
VARIANT_KEYS = {"zero": (int, None), "offload": (_bool, None), "hybrid_engine": (_bool, None),
                "gather_once": (_gather, GATHER_ONCE_FLAG), "backend": (str, "engine.generation_backend"),
                "trim": (_bool, "engine.trim_padding"), "packing": (str, "engine.packing"),
                "tokens": (int, "batch.max_tokens_per_micro_batch"),
                "vllm_sleep": (int, "engine.vllm_sleep_level"), "vllm_tp": (int, "engine.vllm_tensor_parallel_size"),
                "from_update": (_bool, "ppo.old_logprobs_from_update")}


class Skip(Exception):
    """A variant that cannot run here (recorded with its reason, never silently dropped)."""


def parse_variant(spec: str) -> dict:
    name, _, rest = spec.partition(":")
    v = {"name": name}
    for item in filter(None, rest.split(",")):
        k, sep, val = item.partition("=")
        if not sep or k not in VARIANT_KEYS:
            raise SystemExit(f"--variant {spec!r}: items are key=value with key in {', '.join(VARIANT_KEYS)}")
        v[k] = VARIANT_KEYS[k][0](val)
    return v


def nvcc_available() -> bool:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    return bool(shutil.which("nvcc")) or os.path.isfile(os.path.join(home, "bin", "nvcc"))


def adam_choice(requested: str) -> str:
    """'torch' (torch.optim.AdamW through DeepSpeed's torch_adam: no JIT build) or 'deepspeed' (FusedAdam, JIT-built
    with the CUDA toolkit). On CPU always torch's, as rlhf_engine itself chooses."""
    if not bl.on_gpu() or requested == "torch":
        return "torch"
    return "deepspeed" if requested == "fused" or nvcc_available() else "torch"


def build_config(args, v: dict, world: int, models: dict, out_dir: str):
    from rlhf_engine.config import TrainConfig

    cfg = TrainConfig()
    cfg.actor.model_name_or_path = models["actor"]
    cfg.reward.model_name_or_path = models["critic"]  # the critic starts from the reward model (the default)
    cfg.data.data_path = "synthetic.jsonl"  # never read: the prompts come from benchlib.synthetic_prompt_data
    cfg.dtype = args.dtype
    g = cfg.generation
    g.max_prompt_seq_len, g.max_answer_seq_len = args.prompt_len, args.answer_len
    g.min_answer_seq_len = args.answer_len if args.fixed_length else 0
    g.do_sample, g.temperature, g.top_p, g.top_k = True, 1.0, 1.0, 0
    per_rank, mini = args.global_batch // world, args.global_batch // world // args.mini_batches
    micro = min(args.micro_batch, mini)
    if args.global_batch % world or per_rank % args.mini_batches or not mini or mini % micro:
        raise SystemExit(f"--global-batch {args.global_batch} does not split into {world} ranks x "
                         f"{args.mini_batches} mini-batches of whole --micro-batch {micro}")
    b = cfg.batch
    b.per_device_generation_batch_size, b.generation_batches = per_rank, 1
    b.per_device_training_batch_size, b.gradient_accumulation_steps = micro, mini // micro
    b.experience_micro_batch_size = min(args.experience_micro_batch or per_rank, per_rank)
    cfg.ppo.ppo_epochs = args.ppo_epochs
    cfg.actor.zero_stage = cfg.critic.zero_stage = v.get("zero", 0)
    cfg.actor.offload = cfg.critic.offload = bool(v.get("offload"))
    v["_settings"] = []
    for key, (_, field) in VARIANT_KEYS.items():
        if field and key in v:
            section, attr = field.split(".")
            setattr(getattr(cfg, section), attr, v[key])
            v["_settings"].append(f"{field}={v[key]}")
    if v.get("hybrid_engine"):
        if not bl.on_gpu():
            raise Skip("the Hybrid Engine needs a CUDA GPU (DeepSpeed's inference kernels have no CPU build)")
        if not nvcc_available():
            raise Skip("the Hybrid Engine's inference kernels are JIT-compiled on first use and need the CUDA "
                       "toolkit (nvcc), which this machine lacks")
        cfg.engine.enable_hybrid_engine = True
        v["_settings"].append(f"{HYBRID_ENGINE_FLAG}=true")
    os.makedirs(out_dir, exist_ok=True)
    if bl.on_gpu() and args.adam_impl == "torch":  # keeps DeepSpeed from JIT-building FusedAdam
        for role in ("actor", "critic"):
            path = os.path.join(out_dir, f"bench_ds_{role}.json")
            with open(path, "w") as f:
                json.dump({"optimizer": {"params": {"torch_adam": True}}}, f)
            getattr(cfg, role).ds_config = path
    cfg.run.output_dir, cfg.run.overwrite_output_dir = out_dir, True
    cfg.max_steps, cfg.seed = args.warmup + args.iterations, args.seed
    return cfg


class Built:
    """One variant's trainer, its timers and its iterations."""

    def __init__(self, args, v: dict, world: int, models: dict, prompts: list, run_dir: str):
        from rlhf_engine.trainer import build_trainer

        cfg = build_config(args, v, world, models, os.path.join(run_dir, v["name"]))
        t0 = time.perf_counter()
        self.v, self.trainer = v, build_trainer(cfg, prompt_data=bl.synthetic_prompt_data(prompts))
        bl.sync()
        self.build_s = time.perf_counter() - t0
        self.timer = bl.PhaseTimer(self.trainer.engine)
        self.iterations: list[dict] = []


def run_iteration(b: Built, it: int, warmup: bool, n_params: dict) -> dict:
    from rlhf_engine import comm
    from rlhf_engine.engine.distributed import barrier

    b.timer.reset()
    barrier()
    method = bl.reset_peak_memory()
    bl.sync()
    t0 = time.perf_counter()
    rec = b.trainer.step()
    bl.sync()
    wall = time.perf_counter() - t0
    used = {"after_rollouts": b.timer.used.get("sample"), "at_end": bl.device_used_mib()}
    r = b.trainer.last_experience.rollout
    B, L = r.sequences.shape
    ranks = comm.all_gather_object({
        "wall_s": wall, "phases": b.timer.split(rec), "calls": dict(b.timer.n),
        "flops": bl.iteration_flops(n_params, B, L, b.trainer.cfg.ppo.ppo_epochs), "peak_mem_mib": bl.peak_memory_mib(),
        "batch": B, "width": L, "P": r.prompt_length, "R": r.response_width,
        "real_tokens": int(r.attention_mask.sum()), "generated_tokens": int(r.action_mask.sum()),
        "device_used_mib": used})

    def tflops(phase: str):
        vals = [x["flops"][phase] / x["phases"][phase] / 1e12 for x in ranks if x["phases"][phase] > 0]
        return sum(vals) / len(vals) if vals else None

    entry = {
        "iteration": it, "warmup": warmup, "wall_s": max(x["wall_s"] for x in ranks),
        "samples": sum(x["batch"] for x in ranks), "generated_tokens": sum(x["generated_tokens"] for x in ranks),
        "padding_fraction": 1 - sum(x["real_tokens"] for x in ranks) / sum(x["batch"] * x["width"] for x in ranks),
        "shape": {"B_per_rank": ranks[0]["batch"], "P": ranks[0]["P"], "R": ranks[0]["R"]},
        "phases_s": {k: sum(x["phases"][k] for x in ranks) / len(ranks) for k in ranks[0]["phases"]},
        "calls": ranks[0]["calls"], "flops_per_rank": ranks[0]["flops"],
        "tflops": {**{k: tflops(k) for k in ("generation", "experience", "training")},
                   "overall": sum(sum(x["flops"].values()) / x["wall_s"] for x in ranks) / len(ranks) / 1e12},
        "peak_mem_mib": [x["peak_mem_mib"] for x in ranks], "memory_method": method,
        "device_used_mib": [x["device_used_mib"] for x in ranks],
        "metrics": {k: rec.get(k) for k in ("objective/score", "objective/kl", "rollout/response_length",
                                            "policy/ratio_mean", "throughput/samples_per_s", "time/weight_sync",
                                            "rollout/logprob_diff_max", "memory/peak_device_mib")
                    if k in rec},
    }
    b.iterations.append(entry)
    return entry


def summarize(iterations: list) -> dict:
    """The measured iterations (all when there are only warm-ups) summed up; scaling.py sums launches with it."""
    its = [e for e in iterations if not e["warmup"]] or iterations
    if not its:
        return {}
    wall = sum(e["wall_s"] for e in its)
    ph = {k: sum(e["phases_s"][k] for e in its) for k in its[0]["phases_s"]}
    flops = {k: sum(e["flops_per_rank"][k] for e in its) for k in its[0]["flops_per_rank"]}
    tokens = sum(e["generated_tokens"] for e in its)
    return {
        "measured_iterations": len(its), "iteration_s_median": bl.median([e["wall_s"] for e in its]),
        "iteration_s_mean": wall / len(its), "samples_per_s": sum(e["samples"] for e in its) / wall,
        "generated_tokens_per_s": tokens / wall,
        "generation_tokens_per_s": tokens / ph["generation"] if ph["generation"] else None,
        "share": {k: v / wall for k, v in ph.items()}, "phase_s_mean": {k: v / len(its) for k, v in ph.items()},
        # rank 0's FLOPs over the rank-mean phase time (ranks hold equal batches)
        "tflops_per_rank": {**{k: flops[k] / ph[k] / 1e12 if ph[k] else None for k in flops},
                            "overall": sum(flops.values()) / wall / 1e12},
        "peak_mem_mib_per_rank": [max(e["peak_mem_mib"][r] for e in its) for r in range(len(its[0]["peak_mem_mib"]))],
        "padding_fraction": sum(e["padding_fraction"] for e in its) / len(its), "shape": its[-1]["shape"],
        "device_used_mib_per_rank": device_used_peaks(its),
        "metrics_max": {k: max(e["metrics"][k] for e in its) for k in ("rollout/logprob_diff_max", "time/weight_sync")
                        if all(e.get("metrics", {}).get(k) is not None for e in its)},
    }


def device_used_peaks(its: list) -> Optional[list]:
    """Per rank, the most the GPU held after the rollouts and at the iterations' ends (None on a CPU)."""
    per_it = [e.get("device_used_mib") for e in its]
    if not all(per_it) or per_it[0][0]["at_end"] is None:
        return None
    return [{k: max((it[r][k] or 0.0) for it in per_it) for k in ("after_rollouts", "at_end")}
            for r in range(len(per_it[0]))]


def greedy_check(b: Built, n_prompts: int, new_tokens: int, hybrid: bool) -> dict:
    """Greedy generation through the Hybrid Engine's inference kernels (actor.eval()) against the same weights on the
    native HF path (actor.train() + module.eval()), and the prefill logits of both. With hybrid=False both sides are
    the native path: a check of this harness, which must agree exactly."""
    import torch
    from transformers import GenerationConfig

    from rlhf_engine.data.prompts import collate_prompts
    from rlhf_engine.engine.generation import BACKENDS

    eng = b.trainer.engine
    actor, model = eng.actor, eng.actor.module
    idx = list(range(min(n_prompts, len(b.trainer.dataset))))
    ids, mask = (x.to(eng.device) for x in collate_prompts(b.trainer.dataset, idx, eng.pad_token_id))
    kw = BACKENDS["hf"](eng.generator.ctx).generation_kwargs(eng.sampling)  # the HF backend's own arguments
    kw.pop("synced_gpus")
    kw.update(do_sample=False, temperature=None, top_p=None, top_k=None, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens)
    out = {"prompts": len(idx), "new_tokens": new_tokens, "hybrid": hybrid,
           "inference_containers": len(getattr(actor, "_inference_containers", []) or [])}

    def run(he: bool):
        if he:
            actor.eval()  # the Hybrid Engine's inference containers
        else:
            actor.train()
            model.eval()
        try:
            with torch.no_grad():
                bl.sync()
                t0 = time.perf_counter()
                seq = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(**kw))
                bl.sync()
                dt = time.perf_counter() - t0
                return seq[:, ids.shape[1]:], model(input_ids=ids, attention_mask=mask).logits[:, -1].float(), dt
        finally:
            actor.train()

    try:
        ref_seq, ref_logits, ref_dt = run(False)
        he_seq, he_logits, he_dt = run(hybrid)
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
        # the kernels may round differently, so a hybrid check asks for the same first token and argmax only
        out["passed"] = (out["first_token_agreement"] == 1.0 and out["prefill_argmax_agreement"] == 1.0) if hybrid \
            else out["token_agreement"] == 1.0
    except Exception as e:  # noqa: BLE001  (a failing kernel path is a result to record)
        out.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:], passed=False)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bl.add_common_args(p)
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
    p.add_argument("--time-budget", type=float, default=0,
                   help="seconds from process start; no new round starts once the projected end passes it")
    p.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (see above)")
    p.add_argument("--greedy-check", type=int, default=0, metavar="N",
                   help="before the iterations, compare greedy generation of N prompts through the Hybrid Engine "
                        "with the native path (hybrid_engine variants; without a GPU a harness self-check)")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--adam", choices=("auto", "torch", "fused"), default="auto",
                   help="GPU optimizer: auto = DeepSpeed FusedAdam when nvcc is found (JIT build), else torch AdamW")
    p.add_argument("--prepare-only", action="store_true", help="only build the model folders (cached), then exit")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--label", default="")
    args = p.parse_args(argv)
    for k, val in bl.PRESETS[args.preset].items():
        key = {"actor": "actor_shape", "critic": "critic_shape"}.get(k, k)
        if getattr(args, key) is None:
            setattr(args, key, val)
    args.adam_impl = adam_choice(args.adam)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    models_dir = os.path.join(args.work_dir, "models")
    if args.prepare_only:
        for shape, head, seed in ((args.actor_shape, "causal_lm", 0), (args.critic_shape, "score", 1)):
            print(bl.make_model_folder(models_dir, shape, head, args.dtype, seed=seed), flush=True)
        print(f"[bench] model folders ready in {time.perf_counter() - T_START:.1f}s")
        return 0

    from rlhf_engine.engine import init_distributed

    dist = init_distributed()
    world, is_main = dist.world_size, dist.is_main
    models = bl.model_folders(models_dir, args.actor_shape, args.critic_shape, args.dtype)
    na, nc = bl.matmul_params(args.actor_shape, "causal_lm"), bl.matmul_params(args.critic_shape, "score")
    n_params = {"actor": na, "reference": na, "critic": nc, "reward": nc}
    rounds = args.warmup + args.iterations
    prompts = bl.synthetic_prompts(args.global_batch * rounds, args.prompt_len,
                                   bl.SHAPES[args.actor_shape]["vocab_size"], seed=args.seed, fixed=args.fixed_length)
    # the same folder on every rank of a launch (MASTER_PORT is the launch's)
    run_dir = os.path.join(args.work_dir, "runs", f"{args.label or args.preset}-{world}r-{os.environ['MASTER_PORT']}")
    result = {
        "kind": "ppo_iteration", "label": args.label, "preset": args.preset, "command": bl.script_command(),
        "machine": bl.machine_info(), "world_size": world,
        "setup": {k: getattr(args, k) for k in ("actor_shape", "critic_shape", "prompt_len", "answer_len",
                                                "fixed_length", "global_batch", "micro_batch", "mini_batches",
                                                "ppo_epochs", "dtype", "warmup", "iterations")}
        | {"adam": args.adam_impl, "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "matmul_params": n_params, "flop_formula": bl.FLOP_FORMULA, "gather_once": GATHER_ONCE_FLAG,
        "hybrid_engine_switch": HYBRID_ENGINE_FLAG, "variants": [],
    }
    built: list[Built] = []
    variants = [parse_variant(s) for s in args.variant] or [{"name": "default"}]
    for v in variants:
        entry = {"name": v["name"], "spec": v}
        try:
            b = Built(args, v, world, models, prompts, run_dir)
            actor = b.trainer.engine.actor
            entry.update(build_s=b.build_s, settings=v["_settings"],
                         ds_optimizer=type(actor.optimizer).__name__ if actor.optimizer is not None else None,
                         gather_once_active=bool(b.trainer.engine.generator.gather_once_active()))
            if v.get("hybrid_engine"):
                entry.update(actor_engine_class=type(actor).__name__,
                             hybrid_inference_containers=len(getattr(actor, "_inference_containers", []) or []))
                if entry["actor_engine_class"] != "DeepSpeedHybridEngine":
                    raise Skip(f"the Hybrid Engine was requested ({entry['settings']}) but the actor's engine is a "
                               f"{entry['actor_engine_class']}")
            built.append(b)
            b.entry = entry
        except Skip as e:
            entry["skipped"] = str(e)
        except Exception as e:  # noqa: BLE001  (e.g. the Hybrid Engine failing to build: record it, go on)
            entry.update(error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
            if is_main:
                print(entry["traceback"], file=sys.stderr)
        result["variants"].append(entry)
        gc.collect()

    def save():
        if is_main:
            for b in built:
                b.entry.update(iterations=b.iterations, summary=summarize(b.iterations))
            result.update(elapsed_s=time.perf_counter() - T_START,
                          loadavg_at_end=[round(x, 2) for x in os.getloadavg()])
            bl.write_json(args.out, result)

    if args.greedy_check:
        for b in built:
            if b.v.get("hybrid_engine"):
                b.entry["greedy_check"] = greedy_check(b, args.greedy_check, args.greedy_tokens, hybrid=True)
        if not any(b.v.get("hybrid_engine") for b in built) and not bl.on_gpu():
            # no Hybrid Engine here: check the harness itself on the native path
            b = built[0] if built else Built(args, {"name": "harness"}, world, models, prompts, run_dir)
            result["greedy_harness_check"] = greedy_check(b, args.greedy_check, args.greedy_tokens, hybrid=False)
        save()

    round_s = None
    for it in range(rounds):
        if args.time_budget and round_s is not None and it > args.warmup \
                and time.perf_counter() - T_START + round_s > args.time_budget:
            result["stopped_early"] = f"time budget {args.time_budget:.0f}s: {it - args.warmup} measured rounds"
            break
        t_round, failed = time.perf_counter(), []
        for j in range(len(built)):
            b = built[(it + j) % len(built)]
            try:
                e = run_iteration(b, it, it < args.warmup, n_params)
            except Exception as exc:  # noqa: BLE001  (e.g. the Hybrid Engine's kernels failing: record it)
                if world > 1:  # the other ranks may wait in a collective: stop the launch, keeping what was saved
                    raise
                b.entry.update(error=f"iteration {it}: {type(exc).__name__}: {exc}",
                               traceback=traceback.format_exc()[-4000:])
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
    return 1 if any("error" in v for v in result["variants"]) else 0


if __name__ == "__main__":
    rc = main()
    if "rlhf_engine.comm" in sys.modules:  # a rank of the benchmark (not a --help or --prepare-only process)
        from rlhf_engine.cli import exit_process

        exit_process(rc)
    sys.exit(rc)
