"""Merge the steps of bench/gpu.sh into one file: <dir>/gpu.json (environment, every step's exit status and time,
every step's ppo_iteration result) and <dir>/gpu.md (the table, next to DeepSpeed-Chat's reference figure).

    python bench/gpu_summary.py --dir bench/results/gpu --budget 465 --elapsed 431 --tiny 0
"""
from __future__ import annotations

import argparse
import json
import os
import sys

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import benchlib as bl  # noqa: E402

STEPS = ("zero2", "zero3", "hybrid")
# DeepSpeed-Chat's figure for this setup, as our issue states it: OPT-1.3B actor + OPT-350M reward, one A100-80G
REFERENCE = {"source": "DeepSpeed-Chat (figure quoted in our benchmark issue)", "gpu": "1x A100-80G",
             "setup": "OPT-1.3B actor, OPT-350M critic/reward, 256 prompt + 256 generated tokens, Hybrid Engine",
             "samples_per_s": 6.3}


def _read(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 3000) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:]
    except OSError:
        return None


def build(d: str, budget: float, elapsed: float, tiny: bool) -> dict:
    steps = []
    try:
        with open(os.path.join(d, "steps.jsonl")) as f:
            steps = [json.loads(line) for line in f if line.strip()]
    except OSError:
        pass
    for s in steps:
        rc = s.get("rc")
        s["timed_out"] = rc in (124, 137)
        s["result"] = _read(os.path.join(d, f"{s['name']}.json"))
        if rc not in (0, None) and not isinstance(rc, str):
            s["log_tail"] = _tail(os.path.join(d, f"{s['name']}.log"))
    rows = []
    for s in steps:
        if s["name"] not in STEPS:
            continue
        res = s.get("result") or {}
        for v in res.get("variants", []):
            summ = v.get("summary") or {}
            row = {"step": s["name"], "variant": v["name"], "zero": v["spec"].get("zero", 0),
                   "hybrid_engine": bool(v["spec"].get("hybrid_engine")),
                   "status": ("timed out" if s["timed_out"] else "ok" if s["rc"] == 0 else f"rc {s['rc']}"),
                   "skipped": v.get("skipped"), "error": v.get("error")}
            if summ:
                row.update(samples_per_s=summ["samples_per_s"], generated_tokens_per_s=summ["generated_tokens_per_s"],
                           generation_tokens_per_s=summ["generation_tokens_per_s"],
                           iteration_s=summ["iteration_s_median"], iterations=summ["measured_iterations"],
                           share=summ["share"], tflops=summ["tflops_per_rank"],
                           peak_mem_mib=summ["peak_mem_mib_per_rank"], build_s=v.get("build_s"),
                           vs_reference=None if tiny else summ["samples_per_s"] / REFERENCE["samples_per_s"])
            if v.get("greedy_check"):
                row["greedy_check"] = v["greedy_check"]
            rows.append(row)
        if res.get("greedy_harness_check"):
            rows.append({"step": s["name"], "variant": "greedy harness check (native vs native)",
                         "status": "ok" if res["greedy_harness_check"].get("passed") else "FAILED",
                         "greedy_check": res["greedy_harness_check"]})
        if not res.get("variants") and isinstance(s.get("rc"), str):
            rows.append({"step": s["name"], "variant": s["name"], "status": s["rc"]})
    env = _read(os.path.join(d, "env.json"))
    prebuild = _tail(os.path.join(d, "prebuild.log"), 1500)
    machine = next((s["result"]["machine"] for s in steps if s.get("result") and s["result"].get("machine")), None)
    return {"kind": "gpu_benchmark", "tiny": tiny, "budget_s": budget, "elapsed_s": elapsed,
            "within_budget": elapsed <= budget, "machine": machine, "env": env, "reference": REFERENCE,
            "hybrid_kernels_prebuild_log": prebuild,
            "flop_formula": bl.FLOP_FORMULA, "steps": steps, "table": rows}


def markdown(summary: dict) -> str:
    out = ["| step | ZeRO | Hybrid Engine | status | samples/s | gen. tokens/s (in generation) | iteration s "
           "| generation / experience / actor train / critic train | TFLOP/s per rank | peak memory per rank (MiB) "
           "| vs DeepSpeed-Chat 6.3 samples/s |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["table"]:
        if "greedy_check" in r and "samples_per_s" not in r and r["variant"].startswith("greedy"):
            continue
        if "samples_per_s" not in r:
            why = bl.cell(r.get("skipped") or r.get("error") or r.get("status"))
            out.append(f"| {r['step']} | {r.get('zero', '–')} | {bl.fmt(r.get('hybrid_engine'))} | {why} "
                       "| – | – | – | – | – | – | – |")
            continue
        sh = r["share"]
        shares = " / ".join(f"{100 * sh[k]:.0f}%" for k in ("generation", "experience", "training/actor",
                                                            "training/critic"))
        vs = "–" if r["vs_reference"] is None else f"{r['vs_reference']:.2f}x"
        out.append(f"| {r['step']} | {r['zero']} | {bl.fmt(r['hybrid_engine'])} | {r['status']} "
                   f"({r['iterations']} it.) | {bl.fmt(r['samples_per_s'])} | "
                   f"{bl.fmt(r['generated_tokens_per_s'])} ({bl.fmt(r['generation_tokens_per_s'])}) | "
                   f"{bl.fmt(r['iteration_s'])} | {shares} | {bl.fmt(r['tflops']['overall'])} | "
                   f"{', '.join(bl.fmt(m) for m in r['peak_mem_mib'])} | {vs} |")
    checks = [r for r in summary["table"] if r.get("greedy_check")]
    for r in checks:
        g = r["greedy_check"]
        if "error" in g:
            out.append(f"\nGreedy self-check ({r['variant']}): **error** {bl.cell(g['error'])}")
        else:
            out.append(f"\nGreedy self-check ({r['variant']}): {'passed' if g['passed'] else '**FAILED**'}; "
                       f"{g['prompts']} prompts x {g['new_tokens']} tokens, token agreement "
                       f"{100 * g['token_agreement']:.1f}%, first-token agreement "
                       f"{100 * g['first_token_agreement']:.0f}%, prefill logits max |diff| "
                       f"{bl.fmt(g['prefill_logits_max_abs_diff'])} (max |logit| {bl.fmt(g['prefill_logits_max_abs'])}),"
                       f" inference containers {g['inference_containers']}, generate "
                       f"{bl.fmt(g['native_generate_s'])}s native vs {bl.fmt(g['checked_generate_s'])}s checked")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
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
    steps = summary["steps"]
    return 0 if steps and all(s["rc"] == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
