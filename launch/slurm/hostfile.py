"""Write a DeepSpeed hostfile for the current SLURM allocation and print the first host (the rendezvous address).

    python launch/slurm/hostfile.py --out hostfile [--slots N] [--nodelist 'node[01-02]']

One line `<host> slots=<N>` per node of SLURM_JOB_NODELIST (the compressed list is expanded by
`rlhf_engine.engine.distributed.expand_nodelist`; no `scontrol` needed). N: --slots, else SLURM_GPUS_ON_NODE, else
SLURM_GPUS_PER_NODE ("h100:8" -> 8), else 1.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from rlhf_engine.engine.distributed import expand_nodelist  # noqa: E402


def slots_from_env(environ) -> int:
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = environ.get(key, "").strip()
        if value:
            return int(value.split(":")[-1].split("(")[0])
    return 1


def hostfile_text(nodelist: str, slots: int) -> str:
    return "".join(f"{host} slots={slots}\n" for host in expand_nodelist(nodelist))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="hostfile to write")
    parser.add_argument("--slots", type=int, default=None, help="ranks (GPUs) per node")
    parser.add_argument("--nodelist", default=None, help="default: SLURM_JOB_NODELIST (else SLURM_NODELIST)")
    args = parser.parse_args(argv)
    nodelist = args.nodelist or os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        parser.error("no node list: run inside a SLURM allocation or pass --nodelist")
    text = hostfile_text(nodelist, args.slots or slots_from_env(os.environ))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text)
    print(text.split()[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
