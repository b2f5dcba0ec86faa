"""Merge the steps of bench/gpu.sh into <dir>/gpu.json (environment, every step's exit status, time and
ppo_iteration result) and <dir>/gpu.md (the table, next to DeepSpeed-Chat's reference figure).

    python bench/gpu_summary.py --dir bench/results/gpu --budget 465 --elapsed 431 --tiny 0
"""
from __future__ import annotations

import argparse
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402

STEPS = ("zero2", "zero3", "vllm", "hybrid", "vllm_sleep2", "vllm_sleep1", "vllm_sleep0", "vllm_tp2")
# DeepSpeed-Chat's figure for this setup, as our issue states it: OPT-1.3B actor + OPT-350M reward, one A100-80G
REFERENCE = {"source": "DeepSpeed-Chat (figure quoted in our benchmark issue)", "gpu": "1x A100-80G",
             "setup": "OPT-1.3B actor, OPT-350M critic/reward, 256 prompt + 256 generated tokens, Hybrid Engine",
             "samples_per_s": 6.3}


def _tail(path: str, n: int):
    """The last `n` characters of a log; None when it is missing."""
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return None


def build(d: str, budget: float, elapsed: float, tiny: bool) -> dict:
    steps = bl.read_jsonl(os.path.join(d, "steps.jsonl"))
    rows = []
    for s in steps:
        s["timed_out"] = s.get("rc") in (124, 137)
        s["result"] = bl.read_json(os.path.join(d, f"{s['name']}.json"))
        res = s["result"] or {}
        if s.get("rc") not in (0, None) and not isinstance(s.get("rc"), str):
            s["log_tail"] = _tail(os.path.join(d, f"{s['name']}.log"), 3000)
        if s["name"] not in STEPS:
            continue
        for v in res.get("variants", []):
            summ = v.get("summary") or {}
            row = {"step": s["name"], "variant": v["name"], "zero": v["spec"].get("zero", 0),
                   "hybrid_engine": bool(v["spec"].get("hybrid_engine")),
                   "status": "timed out" if s["timed_out"] else "ok" if s["rc"] == 0 else f"rc {s['rc']}",
                   "skipped": v.get("skipped"), "error": v.get("error")}
            if summ:
                row.update(samples_per_s=summ["samples_per_s"], generated_tokens_per_s=summ["generated_tokens_per_s"],
                           generation_tokens_per_s=summ["generation_tokens_per_s"],
                           iteration_s=summ["iteration_s_median"], iterations=summ["measured_iterations"],
                           share=summ["share"], tflops=summ["tflops_per_rank"],
                           peak_mem_mib=summ["peak_mem_mib_per_rank"], build_s=v.get("build_s"),
                           vs_reference=None if tiny else summ["samples_per_s"] / REFERENCE["samples_per_s"],
                           device_used_mib=summ.get("device_used_mib_per_rank"),
                           metrics_max=summ.get("metrics_max"), world_size=res.get("world_size"),
                           vllm_sleep=v["spec"].get("vllm_sleep"), vllm_tp=v["spec"].get("vllm_tp"))
            if v.get("greedy_check"):
                row["greedy_check"] = v["greedy_check"]
            rows.append(row)
        if res.get("greedy_harness_check"):
            rows.append({"step": s["name"], "variant": "greedy harness check (native vs native)",
                         "status": "ok" if res["greedy_harness_check"].get("passed") else "FAILED",
                         "greedy_check": res["greedy_harness_check"]})
        if not res.get("variants") and isinstance(s.get("rc"), str):
            rows.append({"step": s["name"], "variant": s["name"], "status": s["rc"]})
    machine = next((s["result"]["machine"] for s in steps if (s["result"] or {}).get("machine")), None)
    return {"kind": "gpu_benchmark", "tiny": tiny, "budget_s": budget, "elapsed_s": elapsed,
            "within_budget": elapsed <= budget, "machine": machine, "env": bl.read_json(os.path.join(d, "env.json")),
            "reference": REFERENCE, "hybrid_kernels_prebuild_log": _tail(os.path.join(d, "prebuild.log"), 1500),
            "flop_formula": bl.FLOP_FORMULA, "steps": steps, "table": rows}


def markdown(summary: dict) -> str:
    out = ["| step | ZeRO | Hybrid Engine | status | samples/s | gen. tokens/s (in generation) | iteration s "
           "| generation / experience / actor train / critic train | TFLOP/s per rank | peak memory per rank (MiB) "
           "| vs DeepSpeed-Chat 6.3 samples/s |", "|---" * 11 + "|"]
    for r in summary["table"]:
        if "samples_per_s" not in r:
            if not r["variant"].startswith("greedy"):
                why = bl.cell(r.get("skipped") or r.get("error") or r.get("status"))
                out.append(f"| {r['step']} | {r.get('zero', '–')} | {bl.fmt(r.get('hybrid_engine'))} | {why} "
                           "| – | – | – | – | – | – | – |")
            continue
        vs = "–" if r["vs_reference"] is None else f"{r['vs_reference']:.2f}x"
        shares = " / ".join(f"{100 * r['share'][k]:.0f}%" for k in ("generation", "experience", "training/actor",
                                                                    "training/critic"))
        out.append(f"| {r['step']} | {r['zero']} | {bl.fmt(r['hybrid_engine'])} | {r['status']} "
                   f"({r['iterations']} it.) | {bl.fmt(r['samples_per_s'])} | "
                   f"{bl.fmt(r['generated_tokens_per_s'])} ({bl.fmt(r['generation_tokens_per_s'])}) | "
                   f"{bl.fmt(r['iteration_s'])} | {shares} | {bl.fmt(r['tflops']['overall'])} | "
                   f"{', '.join(bl.fmt(m) for m in r['peak_mem_mib'])} | {vs} |")
    engine_rows = [r for r in summary["table"] if "samples_per_s" in r and r["step"].startswith("vllm")]
    if engine_rows:
        out += ["", "| vLLM step | sleep level | tensor parallel | ranks | iteration s | weight push s (max) "
                "| engine - trainer log-prob (max) | GPU held after the rollouts / at the end, per rank (MiB) |",
                "|---" * 8 + "|"]
        for r in engine_rows:
            m, used = r.get("metrics_max") or {}, r.get("device_used_mib")
            held = "–" if not used else ", ".join(f"{bl.fmt(u['after_rollouts'])} / {bl.fmt(u['at_end'])}"
                                                  for u in used)
            level = 2 if r.get("vllm_sleep") is None else r["vllm_sleep"]
            out.append(f"| {r['step']} | {level} | {r.get('vllm_tp') or 1} | {r.get('world_size') or '–'} "
                       f"| {bl.fmt(r['iteration_s'])} | {bl.fmt(m.get('time/weight_sync'))} "
                       f"| {bl.fmt(m.get('rollout/logprob_diff_max'))} | {held} |")
    servers = next((s["result"] for s in summary["steps"] if s["name"] == "async" and s.get("result")), None)
    if servers:  # bench/async_rollouts.py servers: iteration time over the colocated run's
        out.append(f"\nRollout servers ({servers.get('placement')}): iteration time over the colocated run's "
                   + ", ".join(f"{k.replace('_over_colocated', '')} {bl.fmt(v)}"
                               for k, v in servers.get("ratios", {}).items()))
    for r in summary["table"]:
        g = r.get("greedy_check")
        if g and "error" in g:
            out.append(f"\nGreedy self-check ({r['variant']}): **error** {bl.cell(g['error'])}")
        elif g:
            out.append(f"\nGreedy self-check ({r['variant']}): {'passed' if g['passed'] else '**FAILED**'}; "
                       f"{g['prompts']} prompts x {g['new_tokens']} tokens, token agreement "
                       f"{100 * g['token_agreement']:.1f}%, first-token agreement "
                       f"{100 * g['first_token_agreement']:.0f}%, prefill logits max |diff| "
                       f"{bl.fmt(g['prefill_logits_max_abs_diff'])} (max |logit| "
                       f"{bl.fmt(g['prefill_logits_max_abs'])}), inference containers {g['inference_containers']}, "
                       f"generate {bl.fmt(g['native_generate_s'])}s native vs "
                       f"{bl.fmt(g['checked_generate_s'])}s checked")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True)
    p.add_argument("--budget", type=float, required=True)
    p.add_argument("--elapsed", type=float, required=True)
    p.add_argument("--tiny", type=int, default=0)
    args = p.parse_args(argv)
    summary = build(args.dir, args.budget, args.elapsed, bool(args.tiny))
    bl.write_json(os.path.join(args.dir, "gpu.json"), summary)
    md = markdown(summary)
    with open(os.path.join(args.dir, "gpu.md"), "w") as f:
        f.write(md)
    print(md)
    # a step recorded as skipped (its rc a reason: vLLM not installed, no time left) is not a failure
    return 0 if summary["steps"] and all(s["rc"] == 0 or isinstance(s["rc"], str) for s in summary["steps"]) else 1


if __name__ == "__main__":
    sys.exit(main())
