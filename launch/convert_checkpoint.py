"""Convert a checkpoint for a resume on another number of ranks, ahead of time (no process group, one process).

    python launch/convert_checkpoint.py runs/ppo/checkpoints/iter_000040     (a checkpoint folder)
    python launch/convert_checkpoint.py runs/ppo                             (a run folder: its newest complete one)

Every role whose optimizer state is partitioned over the ranks (ZeRO 1-3) is converted by DeepSpeed's
`ds_to_universal` into <checkpoint>/universal/<role>/, the folder a resume on another world size loads. A resume
also converts on its own (rank 0, the other ranks waiting on a group with a long timeout); converting first takes
that time off the job's allocation and off the start-up of every rank. Exit code 2 on a folder that is not a complete
checkpoint.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rlhf_engine.errors import ConfigError  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a checkpoint folder (iter_NNNNNN, with its COMPLETE marker) or a run folder")
    args = ap.parse_args(argv)
    from rlhf_engine.engine.checkpointing import convert_checkpoint
    from rlhf_engine.outputs.checkpoint import resolve_resume

    try:
        path, _ = resolve_resume(args.checkpoint, args.checkpoint)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    roles = convert_checkpoint(path)
    print(f"{path}: {', '.join(roles) if roles else 'no role with partitioned optimizer state (nothing to convert)'}"
          f" converted in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
