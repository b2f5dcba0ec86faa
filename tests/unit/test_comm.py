"""rlhf_engine.comm: tensors reach the collective on the device its backend serves (NCCL refuses CPU tensors:
"No backend type associated with device type cpu"), and the answer comes back where the caller keeps its tensor.

No GPU here: NCCL is mocked by its two observable traits, the backend name and the refusal of CPU tensors; the meta
device stands in for cuda:LOCAL_RANK where a tensor must be moved. The real collectives run in the 2-rank gloo tests.
"""
import pytest
import torch

from rlhf_engine import comm


class _Stop(Exception):
    pass


@pytest.fixture
def fake_nccl(monkeypatch):
    """A 2-rank job whose default group is NCCL: the collective records the device of what it is given and refuses
    a CPU tensor as NCCL does, then stops the call (a meta tensor holds no data to reduce)."""
    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append(t.device)
        if t.device.type == "cpu":
            raise RuntimeError("No backend type associated with device type cpu")
        raise _Stop

    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return seen


def test_nccl_serves_the_local_cuda_device(fake_nccl, monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.backend_device() == torch.device("cuda", 3)


def test_gloo_serves_the_cpu(monkeypatch):
    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    assert comm.backend_device() == torch.device("cpu")


def test_a_cpu_tensor_is_moved_to_the_backends_device_not_passed_on(fake_nccl, monkeypatch):
    monkeypatch.setattr(comm, "backend_device", lambda group=None: torch.device("meta"))
    flags = torch.tensor([1.0, 0.0])  # the preemption poll's flags, built on the CPU
    with pytest.raises(_Stop):
        comm.all_reduce(flags, "max")
    assert fake_nccl == [torch.device("meta")]
    # negative control: the call the preemption poll made before, straight to the collective, is refused
    with pytest.raises(RuntimeError, match="device type cpu"):
        torch.distributed.all_reduce(flags)


def test_a_tensor_already_on_the_backends_device_is_reduced_in_place(monkeypatch):
    """gloo (CPU): no copy is made; the caller's tensor itself goes to the collective and holds the answer."""
    given = []

    def all_reduce(t, op=None, group=None):
        given.append(t)
        t.mul_(2)

    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    x = torch.tensor([1.0, 2.0])
    assert comm.all_reduce(x) is x and given[0] is x and x.tolist() == [2.0, 4.0]


def test_agree_is_one_max_reduction_of_failed_here(monkeypatch):
    calls = []

    def all_reduce(t, op=None, group=None):
        calls.append(op)
        t.fill_(1.0)  # another rank failed

    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert comm.agree(False) is True and calls == [torch.distributed.ReduceOp.MAX]


def test_single_process_needs_no_group():
    x = torch.tensor([3.0])
    assert comm.all_reduce(x) is x and x.item() == 3.0
    assert comm.agree(True) is True and comm.agree(False) is False


def test_run_on_main_returns_rank_0s_value_and_raises_its_error(dist_single):
    """One real rank (gloo): the value comes back, an exception comes out as it is. The waiting ranks' side (a
    conversion slower than the collective timeout) is the 2-rank elastic-resume test's."""
    assert comm.run_on_main(lambda: 41 + 1, "add") == 42

    def fails():
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        comm.run_on_main(fails, "write")


@pytest.mark.parametrize("rank, mine", [(0, [0, 1]), (3, [2, 3]), (5, [4, 5])])
def test_consecutive_groups_every_rank_creates_every_group_and_keeps_its_own(monkeypatch, rank, mine):
    """A world of 6 in groups of 2 (vLLM's tensor-parallel layout under an external launcher): every rank creates
    the three groups in the same order (new_group is collective over the world) and gets its own."""
    created = []
    monkeypatch.setattr(comm, "initialized", lambda: True)
    monkeypatch.setattr(comm, "world_size", lambda: 6)
    monkeypatch.setattr(comm, "rank", lambda: rank)
    monkeypatch.setattr(torch.distributed, "new_group", lambda ranks: created.append(ranks) or f"group{ranks}")
    assert comm.consecutive_groups(2) == (f"group{mine}", mine)
    assert created == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="cannot split a world of 6"):
        comm.consecutive_groups(4)
    assert comm.consecutive_groups(1) == (None, [rank])
