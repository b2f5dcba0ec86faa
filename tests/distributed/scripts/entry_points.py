"""Run several launch/*.py entry points one after the other in ONE multi-rank launch (saves a launcher start per step).

    deepspeed --num_gpus 2 entry_points.py --spec spec.json      spec: {"runs": [["train_sft.py", [argv...]], ...]}

Each entry point's `main(argv)` is called exactly as its `__main__` block calls it; a non-zero exit code stops here.
A run may carry a third element, options: {"skip_on_resume": [provider names]} (the TEST HOOK
`RLHF_ENGINE_TEST_SKIP_ON_RESUME`, for that run only: a negative control of resume), {"expect_exit": N} (the run must
exit with N, e.g. 2 for a refused resume; the next run follows).
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
    from rlhf_engine.hooks import SKIP_ON_RESUME_ENV

    for run in runs:
        name, argv, opts = run[0], run[1], (run[2] if len(run) > 2 else {})
        os.environ[SKIP_ON_RESUME_ENV] = ",".join(opts.get("skip_on_resume", []))  # read by the launcher's main
        code = entry(name)(argv)
        os.environ.pop(SKIP_ON_RESUME_ENV)
        expected = opts.get("expect_exit", 0)
        if code != expected:
            print(f"{name} exited with {code}, expected {expected}", file=sys.stderr)
            return code or 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    from rlhf_engine.cli import exit_process

    exit_process(main())  # as the launch scripts do
