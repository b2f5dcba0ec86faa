"""The colocated vLLM engine's request exchange over a real group (comm.consecutive_groups,
engine/generation/vllm_tp.TensorParallelGroup) on 2 gloo ranks (forked): a group's merged requests, answered by a
stand-in engine (each answer its prompt reversed, as a real engine's answers depend on their prompts), come back to
each rank as the answers to its own prompts, in its order, whatever each rank's row count (none included). The layout
of larger worlds (groups of consecutive ranks, each rank creating every group): tests/unit/test_comm.py. The real
engine runs it in the vLLM job (test_vllm_training.py, tensor parallel 2)."""
from __future__ import annotations

import json
import textwrap

from _support import check, launch

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from rlhf_engine import comm
    from rlhf_engine.engine.generation.vllm_tp import TensorParallelGroup

    torch.distributed.init_process_group("gloo")
    rank = comm.rank()
    tp = TensorParallelGroup(2)
    seen = comm.all_gather_object(("rank", rank), tp.group)
    # rank r asks r rows (rank 0 none), each prompt naming its rank and row
    prompts = [[100 * rank + i, 7, i] for i in range(rank)]
    merged = tp.merge(prompts, [5] * rank, list(range(rank)))
    answers = [(list(reversed(p)), [0.0] * len(p)) for p in merged[0]]  # the stand-in engine, one call per group
    mine = tp.own(answers)
    out = dict(rank=rank, members=tp.members, index=tp.index, position=tp.position, seen=seen,
               merged=merged[0], own=[a for a, _ in mine], expected=[list(reversed(p)) for p in prompts])
    every = comm.all_gather_object(out)
    if rank == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(every, f)
    torch.distributed.destroy_process_group()
""")


def test_a_group_gathers_its_requests_and_each_member_gets_its_own_answers(tmp_path):
    script, out = tmp_path / "groups.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    check(launch(str(script), [str(out)], nproc=2, launcher="fork", timeout=120))
    ranks = json.loads(out.read_text())
    assert [(r["members"], r["index"], r["position"]) for r in ranks] == [([0, 1], 0, 0), ([0, 1], 0, 1)]
    assert [r["seen"] for r in ranks] == [[["rank", 0], ["rank", 1]]] * 2
    # rank 0 asks nothing, rank 1 one row: the merge holds rank 1's row on both members
    assert ranks[0]["merged"] == ranks[1]["merged"] == [[100, 7, 0]]
    assert [r["own"] for r in ranks] == [[], [[0, 7, 100]]]
    for r in ranks:
        assert r["own"] == r["expected"], r
