"""A harness launch reports per run (tests/distributed/scripts/spec_runner.py, tests/_support.py: run_harness), and a
run's metrics do not depend on the runs before it in its launch.

* Two small launches of ppo_checks.py on 2 forked ranks, of the spec's test-only "fault" runs: a run that finishes
  (it gathers the ranks), then one whose rank 1 raises while rank 0 waits for it in a barrier, then one never
  reached; and a run that finishes, then one whose rank 1 hangs, under a 1 s timeout of its own.
* In the shared 2-rank launch (SharedHarness), test_ppo_trainer.py's `SAME` run twice: this module's copy first in
  the launch (nothing ran before it in its processes: the state of a run launched alone), and test_ppo_trainer.py's
  own after the runs before it there. Running first costs nothing extra: the launch's first run pays the start-up
  (lazy imports) whichever it is.
"""
import os
import re
import time

import pytest
import torch

from _support import VOLATILE, HarnessRunError, RunMissing, run_harness

pytestmark = pytest.mark.distributed

# test_ppo_trainer.py's run: 1 iteration, 2 epochs x 2 mini-batches at lr > 0 on 2 ranks, so the later mini-batches'
# metrics see the earlier updates; one of that launch's cheapest runs
SAME = "cf_grpo_lr"
CONTROL = "cf_grpo"  # the same flags at lr 0
HANG_TIMEOUT_S = 1


def harness_runs(tiny, tmp):
    """SAME, with test_ppo_trainer.py's flags (its own output folder), first in the shared 2-rank launch."""
    import test_ppo_trainer  # tests/distributed

    run = next(r for r in test_ppo_trainer.two_rank_runs(tiny, tmp) if r["name"] == SAME)
    return {"two_rank": [{**run, "name": "alone", "first": True}]}


def stable_metrics(run: dict) -> list:
    """Every metrics record of a harness run without its wall-clock and memory keys (VOLATILE)."""
    return [{k: v for k, v in rec.items() if not k.startswith(VOLATILE)} for rec in run["records"]]


@pytest.fixture(scope="module")
def fault_launch(tmp_path_factory):
    """The launch in which a run raises (module docstring); its results by run name."""
    spec = [{"name": "first", "fault": {}}, {"name": "raises", "fault": {"raise_on_rank": 1}},
            {"name": "after", "fault": {}}]
    return run_harness(str(tmp_path_factory.mktemp("per_run")), "per_run", spec, 2, "fork")


@pytest.mark.distributed
def test_run_before_a_failure_keeps_its_result(fault_launch):
    assert fault_launch["first"] == {"name": "first", "ranks": [0, 1]}


@pytest.mark.distributed
def test_failed_run_is_named_with_its_error(fault_launch):
    with pytest.raises(HarnessRunError) as failed:
        fault_launch["raises"]
    msg = str(failed.value)
    # the failing rank's own record: not rank 0's (it waited in the barrier and was ended by the launcher)
    assert msg.startswith("run raises failed on rank 1: spec_runner.InjectedFault: the fault that the spec of run "
                          "'raises' asks for"), msg
    assert "fault_run" in msg  # the traceback's head: the frame that raised
    # a copy of the results (as `{**two_rank, **one_rank}` in test_packed_training.py) fails where the run is used
    copied = {**fault_launch}
    with pytest.raises(HarnessRunError, match="^run raises failed on rank 1"):
        copied["raises"]["ranks"]
    assert copied["first"]["ranks"] == [0, 1]


@pytest.mark.distributed
def test_run_after_a_failure_is_not_reached(fault_launch):
    with pytest.raises(HarnessRunError, match=r"^run after not reached \(the launch ended at run raises\)$"):
        fault_launch["after"]


@pytest.mark.distributed
def test_hung_run_is_named_by_its_own_timeout(tmp_path):
    """Rank 1 sleeps and rank 0 waits in a barrier (a rank stuck in a collective): each rank's watchdog names the run
    after its 1 s, and the launch ends long before its own timeout (60 s here; gloo's own is 3 minutes)."""
    spec = [{"name": "first", "fault": {}},  # starts the process group, outside the 1 s
            {"name": "hangs", "fault": {"hang_on_rank": 1}, "timeout_s": HANG_TIMEOUT_S}]
    t0 = time.monotonic()
    results = run_harness(str(tmp_path), "hang", spec, 2, "fork", timeout=60)
    took = time.monotonic() - t0
    assert results["first"]["ranks"] == [0, 1]
    with pytest.raises(HarnessRunError) as hung:
        results["hangs"]
    msg = str(hung.value)
    assert "run hangs failed on rank" in msg and f"timed out after {HANG_TIMEOUT_S} s" in msg, msg
    assert "fault_run" in msg  # where the rank's main thread was
    assert took < 30, took
    with open(tmp_path / "hang_stderr.txt") as f:
        assert "most recent call first" in f.read()  # faulthandler's dump of every thread


def _ppo_trainer_module(ppo_harness) -> str:
    """test_ppo_trainer.py's module name in the shared 2-rank launch; the test skips where it is not selected."""
    owner = [m for m in ppo_harness.modules("two_rank") if m.rsplit(".", 1)[-1] == "test_ppo_trainer"]
    if not owner:
        pytest.skip("test_ppo_trainer.py is not selected: no shared launch holds its runs")
    return owner[0]


@pytest.mark.distributed
def test_alone_equals_shared(two_rank, ppo_harness):
    """SAME first in the shared launch (as if alone) equals SAME after the runs before it there (other modules',
    of other flags; spec_runner.settle froze what each left): every metric but the clocks and memory, and the final
    weights, exactly."""
    owner = _ppo_trainer_module(ppo_harness)
    order = ppo_harness.launch_order("two_rank")
    assert order.index((__name__, "alone")) == 0 and order.index((owner, SAME)) > 0
    shared_runs = ppo_harness.runs(owner, "two_rank")
    alone, shared = two_rank["alone"], shared_runs[SAME]
    assert stable_metrics(alone) == stable_metrics(shared)
    for role in shared["max_param_change"]:
        a, b = (torch.load(os.path.join(r["output_dir"], f"final_{role}.pt")) for r in (alone, shared))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), role
    # a control: the comparison sees what the learning rate changed (the lr-0 run of the same flags)
    assert stable_metrics(shared_runs[CONTROL]) != stable_metrics(shared)


# runs at ZeRO-2 or 3 (named *_z2 / *_z3 in test_environments.py): DeepSpeed itself keeps their engines (every ZeRO-3
# model in deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK; a ZeRO-2 actor through its optimizer's
# grad-accumulation hook, DeepSpeedEngine._backward_post_hook), frozen or not
KEPT_BY_DEEPSPEED = re.compile(r"_z[23](_|$)")


@pytest.mark.distributed
def test_no_run_is_kept_to_the_end_of_its_launch(two_rank, ppo_harness):
    """spec_runner.settle, after each run, froze none of its DeepSpeed engines: the run's trainer and engines were
    collected (frozen, they would stay in memory to the end of the launch). Measured before the fixes: settle()
    inside the run's function froze the 3 engines of every tiny PPO run, and an environment run's idle EnvCalls
    threads kept its 3 engines through their last call's frame. test_ppo_trainer.py's and test_environments.py's
    runs, but those DeepSpeed keeps (KEPT_BY_DEEPSPEED)."""
    runs = [two_rank["alone"]] + [run for group in ("two_rank", "one_rank") for m in ppo_harness.modules(group)
                                  if m.rsplit(".", 1)[-1] in ("test_ppo_trainer", "test_environments")
                                  for run in dict.values(ppo_harness.runs(m, group))
                                  if not isinstance(run, RunMissing)]  # a run that failed fails its own tests
    kept = [(r["name"], r["engines_frozen"]) for r in runs if r["engines_frozen"]]
    assert all(KEPT_BY_DEEPSPEED.search(name) for name, _ in kept), kept
    assert len(runs) - len(kept) >= 20  # most runs are checked
