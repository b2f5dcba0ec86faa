"""Memory a critic-free run saves: GAE (actor + critic trained, reference, reward) against GRPO (no critic) on the
same models and prompts, CPU, one rank; GRPO samples 2 responses from half the prompts, so both train on the same
rollouts per iteration. Each repeat of a variant is a child process of its own (the variants alternate), so one's
memory never counts for the other: it runs 2 iterations and reports its peak RSS and its engines' bytes.

    .venv/bin/python bench/critic_free_memory.py --out bench/results/cpu/critic_free_memory.json --md
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib as bl  # noqa: E402

VARIANTS = {"gae": ["--advantage_estimator", "gae", "--per_device_generation_batch_size", "8"],
            "grpo": ["--advantage_estimator", "grpo", "--n_samples_per_prompt", "2",
                     "--per_device_generation_batch_size", "4"]}


def engine_bytes(trainer) -> dict:
    """Parameter and optimizer-state bytes per engine of this rank."""
    import torch

    from rlhf_engine.trainer.guards import base_optimizer

    def size(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    return {role: {"params": size(ds.module.parameters()),
                   "optimizer_state": sum(size(st.values()) for st in base_optimizer(ds.optimizer).state.values())
                   if ds.optimizer is not None else 0}
            for role, ds in trainer.engine.engines.items()}


def child(args) -> None:
    from rlhf_engine.assets import build_tiny_model, tiny_prompts, train_tiny_tokenizer
    from rlhf_engine.cli import parse_args
    from rlhf_engine.trainer import build_trainer

    tok, actor, reward = (os.path.join(args.work, n) for n in ("tok", "actor", "reward"))
    if not os.path.isdir(actor):
        train_tiny_tokenizer(tok, vocab_size=2000, pad_is_eos=True)
        for path, head, seed in ((actor, "causal_lm", 1), (reward, "score", 2)):
            build_tiny_model(path, tok, head=head, n_layer=args.layers, hidden=args.hidden, n_head=8, dropout=0.0,
                             seed=seed)
        with open(os.path.join(args.work, "prompts.jsonl"), "w") as f:
            f.writelines(json.dumps({"prompt": p}) + "\n" for p in tiny_prompts(64, seed=0))
    trainer = build_trainer(parse_args([
        "--actor_model_name_or_path", actor, "--reward_model_name_or_path", reward, "--data_path",
        os.path.join(args.work, "prompts.jsonl"), "--max_prompt_seq_len", "64", "--max_answer_seq_len", "32",
        "--per_device_training_batch_size", "4", "--max_steps", "2", "--export_final", "false",
        "--output_dir", os.path.join(args.work, f"run_{args.variant}_{os.getpid()}")] + VARIANTS[args.variant]))
    trainer.train()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print(json.dumps({"variant": args.variant, "peak_rss": peak, "engines": engine_bytes(trainer)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default="")
    p.add_argument("--md", action="store_true", help="also print the table as markdown")
    p.add_argument("--variant", default="", help=argparse.SUPPRESS)  # a child process
    p.add_argument("--work", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        child(args)
        return 0
    work = tempfile.mkdtemp(prefix="critic_free_mem-")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
           "DS_ACCELERATOR": "cpu", "PYTHONPATH": bl.ROOT}
    runs = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for v in VARIANTS:
            out = subprocess.run([sys.executable, __file__, "--variant", v, "--work", work, "--hidden",
                                  str(args.hidden), "--layers", str(args.layers)], env=env, capture_output=True,
                                 text=True, check=True).stdout
            runs[v].append(json.loads(out.strip().splitlines()[-1]))
    summary = {v: {"peak_rss_mib": [round(r["peak_rss"] / 2 ** 20, 1) for r in rs],
                   "engine_mib": round(sum(e["params"] + e["optimizer_state"]
                                           for e in rs[0]["engines"].values()) / 2 ** 20, 2),
                   "roles": sorted(rs[0]["engines"])} for v, rs in runs.items()}
    ratio = statistics.median(summary["grpo"]["peak_rss_mib"]) / statistics.median(summary["gae"]["peak_rss_mib"])
    if args.out:
        bl.write_json(args.out, {"command": bl.script_command(), "machine": bl.machine_info(),
                                 "setup": {"hidden": args.hidden, "layers": args.layers, "repeats": args.repeats},
                                 "variants": summary, "peak_rss_ratio_grpo_over_gae": round(ratio, 3)})
    if args.md:
        print("| variant | engines | engine bytes (params + Adam state, MiB) | peak RSS per rank (MiB, per repeat) |\n"
              "|---|---|---|---|")
        for v, s in summary.items():
            print(f"| {v} | {', '.join(s['roles'])} | {s['engine_mib']} | {s['peak_rss_mib']} |")
        print(f"\nPeak RSS, GRPO / GAE (medians): x{ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
