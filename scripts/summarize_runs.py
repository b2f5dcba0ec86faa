"""Summarise PPO runs for the README: mean objective/score of the first and last K iterations of each run.

    python scripts/summarize_runs.py runs/seed1 runs/seed2 runs/lr0 [--k 5]
"""
import argparse
import json
import os


def summarize(run_dir: str, k: int) -> dict:
    recs = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    recs = [r for r in recs if "objective/score" in r]
    scores = [r["objective/score"] for r in recs]
    first, last = sum(scores[:k]) / k, sum(scores[-k:]) / k
    secs = sum(r["time/generate"] + r["time/experience"] + r["time/train"] for r in recs)
    return {"run": run_dir, "iterations": len(recs), "first": first, "last": last, "gain": last - first,
            "final_kl": recs[-1]["objective/kl"], "train_seconds": secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--k", type=int, default=5)
    args = ap.parse_args()
    print(f"| run | iterations | mean score, first {args.k} | mean score, last {args.k} | gain | final KL | "
          "seconds in iterations |")
    print("|---|---|---|---|---|---|---|")
    for run in args.runs:
        s = summarize(run, args.k)
        print(f"| {s['run']} | {s['iterations']} | {s['first']:.3f} | {s['last']:.3f} | {s['gain']:+.3f} | "
              f"{s['final_kl']:.3f} | {s['train_seconds']:.0f} |")


if __name__ == "__main__":
    main()
