"""Run several launch/*.py entry points one after the other in ONE multi-rank launch (saves a launcher start per step).

    deepspeed --num_gpus 2 entry_points.py --spec spec.json      spec: {"runs": [["train_sft.py", [argv...]], ...]}

Each entry point's `main(argv)` is called exactly as its `__main__` block calls it; a non-zero exit code stops here.
"""
import argparse
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def entry(name):
    spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(ROOT, "launch", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--local_rank", type=int, default=None)
    args = parser.parse_args()
    with open(args.spec) as f:
        runs = json.load(f)["runs"]
    for name, argv in runs:
        code = entry(name)(argv)
        if code:
            print(f"{name} exited with {code}", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from rlhf_engine.trainer.run import shutdown_distributed

    rc = main()
    shutdown_distributed(ok=rc == 0)  # as the launch scripts do: no gloo abort at exit
    sys.exit(rc)
