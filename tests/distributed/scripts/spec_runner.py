"""The shared `main()` of the harness scripts: read a spec of runs, run each, record each run's outcome as it ends,
shut down.

    python <harness>.py --spec spec.json --out result.json [--run_records runs.jsonl]

spec.json: {"runs": [{"name": ..., "timeout_s": ..., ...}, ...], "run_timeout_s": ...} (both timeouts optional).

Each run's outcome is appended to --run_records (default: --out with the suffix .jsonl) as it ends, one JSON line per run:

  {"name", "status": "ok", "result"}                 from rank 0: what `run_one` returned there
  {"name", "status": "failed", "rank", "error"}      from every rank the run failed on: the exception and its
                                                     innermost frames, or "timed out after N s" and where it was

The ranks pass a barrier after rank 0 recorded a run, so no rank starts the next run (and fails in it, ending the
launch) before the run is recorded. A failed run ends the launch: the failing rank exits non-zero and the launcher
ends the others (its peers may be stuck in a collective with it, and a run after it would not start from the state
it would have had). The reader, tests/_support.py (`read_runs`), names the run that failed and the runs it kept from
running. --out gets {"runs": [results]} once every run is done, as before this log existed
(tests/distributed/test_resume.py reads it).

A run that outlives its timeout ("timeout_s", else the spec's "run_timeout_s", else RUN_TIMEOUT_S; shorter than a
launch's) is a hung run: the rank's watchdog thread records it, writes every thread's stack to stderr
(faulthandler) and exits with TIMEOUT_EXIT. A thread, not a signal: a rank blocked in a collective sits in C++ code
(the GIL released), where a Python signal handler would not run until the collective returns.

Test-only faults (tests/distributed/test_shared_launch.py; a spec's "fault" key, handled here and never in the
library): {"fault": {"raise_on_rank": r}} or {"fault": {"hang_on_rank": r}}: rank r raises `InjectedFault` or sleeps,
while the others wait for it in a collective, as the peers of a real failure do; {"fault": {}} gathers the ranks.
"""
from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import sys
import threading
import time
import traceback
from typing import Callable, Optional

import torch

# Per run: half the launch's own limit (600 s, tests/_support.py: launch), so that a hung run is named and ends the
# launch before that limit would. The shared launches' longest run took 36 s on a 2-core machine of the project's
# kind loaded 3 times over (load average 6), 81 s loaded 6-8 times over (load average 12-17).
RUN_TIMEOUT_S = 300.0
TIMEOUT_EXIT = 124  # a rank ended by its watchdog (as timeout(1))
BACKSTOP_S = 30.0  # faulthandler's own timer ends the rank this long after the watchdog should have
EXIT_GRACE_S = 30.0  # a rank whose run failed has this long to leave (its exception's traceback, atexit)
HEAD_FRAMES, HEAD_CHARS = 8, 3000  # the traceback head recorded for a failed run


class InjectedFault(RuntimeError):
    """The failure a spec's test-only "fault" asks for."""


def settle() -> int:
    """The end of a harness run, once nothing of it is referenced any more (`settled`: after its function returned):
    collect its cycles, then freeze what survives, as the launch scripts do at start-up (`cli.freeze_startup`).
    Frozen, those objects are out of every later collection's scan, and the runs and DeepSpeed's ZeRO-3 set-up
    collect often (the shared 2-rank PPO launch: 90 -> 75 s). Returns how many DeepSpeed engines it froze.

    What the freeze keeps, and why that is harmless. It changes no object, only the collector, which never frees a
    frozen object: what it freezes stays in memory, its finalizers unrun, until the process ends. It freezes what
    is still referenced after the run, nothing a later run could not reach anyway:
    * the state the run added to modules (modules imported on first use, their registries and caches; measured on
      tiny PPO runs: 30-78k objects after a launch's first run, 27-200 after a later one: lists, dicts, locks,
      compiled patterns), which lives to the end of the process anyway;
    * what the library or DeepSpeed still holds of the run, kept to the end of the process frozen or not (measured
      in the shared launches): a ZeRO-3 run's models, hooks and engines (DeepSpeed appends every ZeRO-3 model to
      `deepspeed.runtime.zero.parameter_offload.FWD_MODULE_STACK` and never removes it: 3-4 engines per run), a
      ZeRO-2 actor (its optimizer's grad-accumulation hook, `DeepSpeedEngine._backward_post_hook`, stays
      reachable), and what `comm.at_shutdown` callbacks hold until the launch's shutdown (a run's vLLM engine, its
      servers' client).
    Nothing else of a run may be among them. Two holders were fixed: called inside a run's function, settle() froze
    the run's trainer and engines that its locals still held (until `settled`), and an environment run's idle
    `EnvCalls` threads kept their last call's frame, with its 3 engines (until `EnvCalls._work_one`). The returned
    count is in each harness result ("engines_frozen"); test_shared_launch.py checks it is 0 for every run of
    test_ppo_trainer.py and test_environments.py that DeepSpeed does not keep, and that a run alone equals the same
    run in the shared launch."""
    import gc

    gc.collect()
    frozen = live_engines()
    gc.freeze()
    return frozen


def live_engines() -> int:
    """How many DeepSpeed engines are alive outside the collector's frozen generation."""
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine

    return sum(1 for o in gc.get_objects() if isinstance(o, DeepSpeedEngine))


def settled(run_one: Callable[..., Optional[dict]]) -> Callable[..., Optional[dict]]:
    """`run_one`, then `settle()` once it has returned: its frame, and what its locals held, are gone by then. A
    result (a dict) gets "engines_frozen", settle's count."""

    @functools.wraps(run_one)
    def run_then_settle(*args, **kwargs) -> Optional[dict]:
        result = run_one(*args, **kwargs)
        frozen = settle()
        if isinstance(result, dict):
            result["engines_frozen"] = frozen
        return result

    return run_then_settle


def rank() -> int:
    """This process's rank (RANK before the process group exists: a fault-only spec, a failure in the first run)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))


def record(log: str, entry: dict) -> None:
    """Append one JSON line to `log` in a single write on an O_APPEND descriptor: the lines of several ranks never
    interleave, and a line is complete once a reader sees it."""
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def error_head(exc: BaseException) -> str:
    """What a reader needs first of a failure: the exception (its type and message), then its innermost frames."""
    te = traceback.TracebackException.from_exception(exc)
    what = "".join(te.format_exception_only()).strip()
    frames = "".join(traceback.format_list(te.stack[-HEAD_FRAMES:]))
    return f"{what}\n{frames}"[:HEAD_CHARS]


class Watchdog:
    """One thread per rank that ends the rank when the armed run outlives its timeout: it records the run as
    failed ("timed out after N s on rank r" and where the main thread was), dumps every thread's stack to stderr
    and exits with TIMEOUT_EXIT, which ends the launch. faulthandler's C timer backs it up BACKSTOP_S later, for a
    main thread that holds the GIL (no Python thread runs then; the log then has no line for the run, and the reader
    says the launch ended during it)."""

    def __init__(self, log: str, tag: str):
        self.log, self.tag = log, tag
        self.main = threading.get_ident()
        self.armed: Optional[tuple] = None  # (run name, timeout_s, deadline)
        self.cond = threading.Condition()
        threading.Thread(target=self._watch, name="spec_runner watchdog", daemon=True).start()

    def arm(self, name: str, timeout_s: float) -> None:
        with self.cond:
            self.armed = (name, timeout_s, time.monotonic() + timeout_s)
            self.cond.notify()
        faulthandler.dump_traceback_later(timeout_s + BACKSTOP_S, exit=True)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        with self.cond:
            self.armed = None
            self.cond.notify()

    def _watch(self) -> None:
        with self.cond:
            while True:
                if self.armed is None:
                    self.cond.wait()
                    continue
                left = self.armed[2] - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                self._expire(*self.armed[:2])  # holding the lock: a late disarm cannot race the exit

    def _expire(self, name: str, timeout_s: float) -> None:
        frame = sys._current_frames().get(self.main)
        where = "".join(traceback.format_stack(frame)[-HEAD_FRAMES:]) if frame is not None else "(no main thread)\n"
        r = rank()
        record(self.log, {"name": name, "status": "failed", "rank": r,
                          "error": f"timed out after {timeout_s:g} s on rank {r}; its main thread was at:\n{where}"})
        print(f"[{self.tag}] run {name} timed out after {timeout_s:g} s on rank {r}; every thread's stack:",
              file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(TIMEOUT_EXIT)  # the main thread is stuck: only a process exit ends it


def fault_run(run: dict) -> Optional[dict]:
    """A test-only run (its spec's "fault"): rank `raise_on_rank` raises InjectedFault, rank `hang_on_rank` sleeps
    until its watchdog ends it, and the other ranks wait for them in a collective. With no fault, its result on rank
    0 is every rank's rank, gathered. It starts the process group if no run before it did."""
    from rlhf_engine.engine import init_distributed

    init_distributed()
    fault, me = run["fault"], torch.distributed.get_rank()
    if me == fault.get("raise_on_rank"):
        raise InjectedFault(f"the fault that the spec of run {run['name']!r} asks for")
    if me == fault.get("hang_on_rank"):
        time.sleep(10 ** 6)
    if fault:  # the faulty rank's peers wait for it in a collective
        torch.distributed.barrier()
        return None
    ranks = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(ranks, me)
    return {"name": run["name"], "ranks": ranks} if me == 0 else None


def without_plot(run: dict) -> dict:
    """The run with `--plot false` added to its flags unless they set it: a run's metrics.png is about half a second
    of rank 0's time with the other ranks waiting, over a hundred short runs; the tests that launch the entry points
    check the plot (tests/distributed/test_sft_reward.py, tests/unit/trainer/test_run_setup.py)."""
    args = run.get("args")
    if not isinstance(args, list) or "--plot" in args:
        return run
    return {**run, "args": [*args, "--plot", "false"]}


def run_specs(run_one: Callable[[dict], Optional[dict]], tag: str) -> int:
    """Run the spec's runs in order under the watchdog, recording each as it ends (module docstring); a run that
    raises is recorded and its exception ends this rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    # not --log: torchrun refuses an argument that abbreviates two of its own options, even after the script
    parser.add_argument("--run_records", default=None)
    parser.add_argument("--local_rank", type=int, default=None)  # passed by the deepspeed launcher
    args = parser.parse_args()
    with open(args.spec) as f:
        spec = json.load(f)
    log = args.run_records or os.path.splitext(args.out)[0] + ".jsonl"
    default_timeout = float(spec.get("run_timeout_s", RUN_TIMEOUT_S))
    watchdog = Watchdog(log, tag)
    results = []
    for run in spec["runs"]:
        run = without_plot(run)
        t0 = time.perf_counter()
        watchdog.arm(run["name"], float(run.get("timeout_s", default_timeout)))
        try:
            res = fault_run(run) if "fault" in run else run_one(run)
            if rank() == 0:
                record(log, {"name": run["name"], "status": "ok", "result": res})
            if torch.distributed.is_initialized():  # no rank starts (and fails) the next run before this is recorded
                torch.distributed.barrier()
        except BaseException as e:  # SystemExit too: nothing inside a run may end the launch unrecorded
            watchdog.disarm()
            record(log, {"name": run["name"], "status": "failed", "rank": rank(), "error": error_head(e)})
            faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True)  # bounds the exit that follows
            raise
        watchdog.disarm()
        if res is not None:
            results.append(res)
        if rank() == 0:  # the time of each run: where a shared launch's minutes go
            print(f"[{tag}] run {run['name']} done in {time.perf_counter() - t0:.1f} s", flush=True)
    watchdog.arm("(the shutdown after the last run)", default_timeout)
    if rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"runs": results}, f)
    from rlhf_engine.comm import shutdown

    shutdown(ok=True)  # as launch/train_ppo.py ends: a barrier (no gloo abort at exit), a vLLM engine closed first
    watchdog.disarm()
    return 0
