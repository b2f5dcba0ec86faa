"""Shared test support: tiny offline assets and a launcher for multi-rank subprocess runs."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "distributed", "scripts")
_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
              "CROSS_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@dataclass
class TinySetup:
    root: str
    tokenizer: str
    actor: str
    reward: str
    prompts: str


def make_tiny_setup(root: str, arch: str = "gpt2", pad_is_eos: bool = True, n_prompts: int = 32,
                    dropout: float = 0.1, vocab_size: int = 512, n_head: int = 4,
                    tie_embeddings: bool = False) -> TinySetup:
    """A tokenizer, a tiny actor, a tiny reward model (score head) and a prompts.jsonl under `root` (hidden size 64:
    `n_head` 2 gives the head size 32 that vLLM's CPU attention takes; `tie_embeddings`: a llama actor whose LM head
    is its embedding)."""
    from rlhf_engine.assets import build_tiny_model, tiny_prompts, train_tiny_tokenizer

    os.makedirs(root, exist_ok=True)
    tok = train_tiny_tokenizer(os.path.join(root, "tok"), vocab_size=vocab_size, pad_is_eos=pad_is_eos)
    actor = build_tiny_model(os.path.join(root, "actor"), tok, arch=arch, dropout=dropout, seed=0, n_head=n_head,
                             tie_embeddings=tie_embeddings)
    reward = build_tiny_model(os.path.join(root, "reward"), tok, arch=arch, head="score", dropout=dropout, seed=1,
                              n_head=n_head)
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for p in tiny_prompts(n_prompts, seed=0):
            f.write(json.dumps({"prompt": p}) + "\n")
    return TinySetup(root, tok, actor, reward, prompts)


# Stop tokens: a pseudo-random 2/7 of the tiny vocabulary ends a response, so a random tiny model gives uneven
# response lengths (the tiny models rarely sample EOS itself).
STOP_IDS = [t for t in range(3, 512) if (t * 2654435761) % 7 < 2]


Z = 5  # the likely token of `z_logits`


def fixed_model(tiny, path, logits: torch.Tensor, generation: dict):
    """The tiny GPT-2 with its final layer norm's scale at 0 and bias e_0, and column 0 of its (tied) embedding set
    to `logits`: every position's next-token logits are exactly `logits`, whatever the input."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if os.path.isdir(path):
        return path
    model = AutoModelForCausalLM.from_pretrained(tiny.actor)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = logits
    model.generation_config = GenerationConfig(**generation)
    model.save_pretrained(path)
    for f in os.listdir(tiny.actor):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tiny.actor, f), path)
    return path


def z_logits(vocab: int, p: float) -> torch.Tensor:
    """Token Z with probability p, the rest uniform."""
    import torch

    out = torch.zeros(vocab)
    out[Z] = math.log(p) - math.log((1 - p) / (vocab - 1))
    return out


def as_flags(values: dict) -> list[str]:
    """{"max_steps": 2, "stop_token_ids": [3, 4]} -> ["--max_steps", "2", "--stop_token_ids", "3", "4"]."""
    out = []
    for key, value in values.items():
        out.append(f"--{key}")
        out += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return out


def ppo_args(tiny: TinySetup, output_dir: str, **flags) -> list[str]:
    """train_ppo.py flags for the tiny assets with uneven response lengths; `flags` override."""
    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, stop_token_ids=STOP_IDS, output_dir=output_dir)
    base.update(flags)
    return as_flags(base)


def clean_env(**extra: str) -> dict:
    """The environment for a child launch: no inherited rank variables, one thread per rank, offline."""
    # WANDB_SERVICE: set by wandb in this process for its own service, which a child must not share (and a fork
    # server started before it would refuse it)
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS and k != "WANDB_SERVICE"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", DS_ACCELERATOR="cpu",
               TOKENIZERS_PARALLELISM="false", DEEPSPEED_TIMEOUT="3",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))  # tests/: the test environments (_envs)
    env.update(extra)
    return env


def launch(script: str, args: list[str], nproc: int = 2, launcher: str = "deepspeed", timeout: int = 600,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` ranks (deepspeed launcher, torchrun, a plain single process, or "fork": ranks forked
    from a process that imported the stack once, where the launcher is not under test: tests/_forked.py) and capture
    output."""
    from rlhf_engine.engine.distributed import free_port

    if launcher == "fork":
        import _forked

        if _forked.AVAILABLE:
            return _forked.run(script, args, nproc, clean_env(**(env or {})), ROOT, timeout)
        launcher = "torchrun" if nproc > 1 else "python"  # Linux only: the launchers it stands for
    bindir = os.path.dirname(sys.executable)
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [os.path.join(bindir, "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, script]
    elif launcher == "torchrun":
        cmd = [os.path.join(bindir, "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port, script]
    elif launcher == "python":
        assert nproc == 1
        cmd = [sys.executable, script]
    else:
        raise ValueError(launcher)
    return subprocess.run(cmd + list(args), cwd=ROOT, env=clean_env(**(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fail with the tail of the child's output when it did not exit 0."""
    if proc.returncode != 0:
        tail = (proc.stdout[-6000:] + "\n--- stderr ---\n" + proc.stderr[-6000:])
        raise AssertionError(f"launch failed (rc={proc.returncode}):\n{tail}")
    return proc


class HarnessRunError(AssertionError):
    """A harness run that did not finish: it failed, or the launch ended before it (the test that reads it fails
    with this, naming the run)."""


class RunMissing:
    """Stands for the result of a run that did not finish: any use of it (an item, a key test, iteration, an
    attribute) raises HarnessRunError with `why`, in the test that uses it; the other runs' tests are unaffected."""

    def __init__(self, name: str, why: str):
        self.name, self.why = name, why

    def fail(self, *_args, **_kwargs):
        raise HarnessRunError(self.why)

    __getitem__ = __contains__ = __iter__ = __len__ = __eq__ = __bool__ = fail
    __hash__ = None

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self.fail()

    def __repr__(self) -> str:
        return f"<run {self.name}: no result>"


class HarnessResults(dict):
    """A harness launch's results by run name: a finished run's result, or a RunMissing that raises on use;
    looking a missing run up raises at once. Copies (`{**results}`) keep the RunMissing values."""

    def __getitem__(self, name):
        value = super().__getitem__(name)
        if isinstance(value, RunMissing):
            value.fail()
        return value


def read_runs(names: list, log: str, how_it_ended: str, rc: int | None = 0) -> HarnessResults:
    """The results of the runs `names` (in launch order) from a launch's run log (tests/distributed/scripts/
    spec_runner.py), the launch's exit code `rc` (None: it was stopped at its timeout) described by `how_it_ended`.
    The first run without a result is where the launch ended: "run X failed: <its error>" (the first rank's record;
    without one, the launch ended during it), and every later run is "not reached"."""
    entries = []
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                try:
                    entries.append(json.loads(line))
                except ValueError:  # a line cut short by a killed rank
                    pass
    ok = {e["name"]: e["result"] for e in entries if e["status"] == "ok"}
    failures: dict = {}
    for e in entries:  # the first record of a run's failure: later ranks often fail of the first one's exit
        if e["status"] == "failed":
            failures.setdefault(e["name"], e)
    out, ended_at = HarnessResults(), None
    for name in names:
        if name in ok and name not in failures:
            out[name] = ok[name]
        elif ended_at is None:
            ended_at = name
            if name in failures:
                e = failures[name]
                out[name] = RunMissing(name, f"run {name} failed on rank {e['rank']}: {e['error']}")
            else:
                out[name] = RunMissing(name, f"run {name} failed: the launch ended during it ({how_it_ended}), "
                                             "with no record of the run from any rank")
        else:
            out[name] = RunMissing(name, f"run {name} not reached (the launch ended at run {ended_at})")
    if ended_at is None and rc != 0:  # after the last run: shutdown, or a rank's exit
        extra = "".join(f"\n{e['name']} on rank {e['rank']}: {e['error']}" for e in failures.values())
        raise HarnessRunError(f"every run finished, but {how_it_ended}{extra}")
    return out


def run_harness(tmp: str, name: str, runs: list, nproc: int, launcher: str, script: str = "ppo_checks.py",
                timeout: int = 600, run_timeout_s: float | None = None) -> HarnessResults:
    """Launch a harness script (tests/distributed/scripts, one whose main is spec_runner.run_specs) on a spec of
    runs; rank 0's results by run name, each run's own (read_runs: a run that did not finish raises where it is
    used). `run_timeout_s`: each run's limit (spec_runner.RUN_TIMEOUT_S by default); `timeout`: the launch's. The
    launch's output is kept in `tmp` (<name>_stdout.txt, <name>_stderr.txt)."""
    spec, result, log = (os.path.join(tmp, f"{name}_{what}") for what in ("spec.json", "result.json", "runs.jsonl"))
    with open(spec, "w") as f:
        json.dump({"runs": runs, **({"run_timeout_s": run_timeout_s} if run_timeout_s else {})}, f)
    try:
        proc = launch(os.path.join(SCRIPTS, script), ["--spec", spec, "--out", result, "--run_records", log], nproc,
                      launcher, timeout)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, e.stdout, e.stderr
    outputs = []
    for what, text in (("stdout", out), ("stderr", err)):
        outputs.append(os.path.join(tmp, f"{name}_{what}.txt"))
        with open(outputs[-1], "w" if isinstance(text, str) or text is None else "wb") as f:
            f.write(text or "")
    how = (f"stopped at the launch's timeout of {timeout} s" if rc is None else f"the launch exited {rc}") + \
        f"; its output: {outputs[0]}, {outputs[1]}"
    return read_runs([r["name"] for r in runs], log, how, rc)


class SharedHarness:
    """One launch of ppo_checks.py per group (its ranks and launcher) for every test module of the session that
    declares `harness_runs(tiny, tmp) -> {group: runs}`: each launch starts its ranks and imports the stack once
    for several files' runs (CI time). Only the modules with tests selected in this session take part. A module's
    fixture asks for its results with `runs(__name__, group)`: each run's result, or, for a run that failed or was
    not reached, a value that fails the test using it with the reason (run_harness); the launch's runs are named
    `<module>/<run>` there and in its output. A run marked "first": True runs before the others (launch_order)."""

    GROUPS = {"two_rank": (2, "fork"), "one_rank": (1, "fork")}  # tests/_forked.py: the launcher is not under test

    def __init__(self, session, tiny, tmp_path_factory):
        self.session, self.tiny, self.tmp_path_factory = session, tiny, tmp_path_factory
        self.specs: dict = {}  # module name -> {group: runs}
        self.results: dict = {}  # group -> {module name: {run name: result}}
        self.failed: dict = {}  # group -> the launch's error after its runs (raised again for every module)

    def _module_specs(self) -> dict:
        modules = {}
        for item in self.session.items:
            module = getattr(item, "module", None)
            if module is not None and hasattr(module, "harness_runs"):
                modules[module.__name__] = module
        for name, module in modules.items():
            if name not in self.specs:
                tmp = str(self.tmp_path_factory.mktemp(name.rsplit(".", 1)[-1]))
                self.specs[name] = module.harness_runs(self.tiny, tmp)
        return self.specs

    def modules(self, group: str) -> list:
        """The modules with runs in the `group` launch."""
        return [name for name, groups in self._module_specs().items() if groups.get(group)]

    def launch_order(self, group: str) -> list:
        """The `group` launch's runs in the order they run, as (module, run name): module by module, except the runs
        marked "first": True, which run before all others (first in their processes: as if launched alone)."""
        order = [(name, run["name"], bool(run.get("first"))) for name, groups in self._module_specs().items()
                 for run in groups.get(group, [])]
        return [(name, run) for name, run, first in sorted(order, key=lambda o: not o[2])]  # sorted() is stable

    def runs(self, module: str, group: str) -> HarnessResults:
        if group in self.failed:
            raise RuntimeError(f"the shared {group} launch failed (see the first module's error)") from \
                self.failed[group]
        if group not in self.results:
            nproc, launcher = self.GROUPS[group]
            spec, owner = [], {}
            for name, run_name in self.launch_order(group):
                run = next(r for r in self._module_specs()[name][group] if r["name"] == run_name)
                key = f"{name}/{run_name}"
                spec.append({**run, "name": key})
                owner[key] = (name, run_name)
            tmp = str(self.tmp_path_factory.mktemp(f"shared_{group}"))
            out: dict = {}
            try:
                results = run_harness(tmp, group, spec, nproc, launcher)
            except Exception as e:  # noqa: BLE001
                self.failed[group] = e
                raise
            for key, result in dict.items(results):  # RunMissing values kept (HarnessResults[...] would raise)
                name, run_name = owner[key]
                value = result if isinstance(result, RunMissing) else {**result, "name": run_name}
                out.setdefault(name, HarnessResults())[run_name] = value
            self.results[group] = out
        if module not in self.results[group]:
            raise RuntimeError(f"{module}: no {group} runs in the shared launch (is `harness_runs` defined there?)")
        return self.results[group][module]


VOLATILE = ("time/", "throughput/", "memory/")  # wall-clock and memory keys: the only metrics allowed to differ between identical runs
DISCRETE = ("policy/clipfrac", "value/clipfrac")  # counts of tokens at a boundary: 1e-7 noise can flip one token
SPLIT = ("batch/",)  # micro-batch counts and padding: what differs between splits by design


def compare_runs(run: dict, ref: dict) -> tuple[dict, dict]:
    """Largest metric and parameter differences of harness run `run` against `ref` (volatile and discrete keys
    aside; the parameters from the final_<role>.pt files the harness saves)."""
    import torch

    metric = {}
    for a, b in zip(run["records"], ref["records"]):
        for k in b:
            if not k.startswith(VOLATILE + SPLIT) and k not in DISCRETE and b[k] is not None:
                metric[k] = max(metric.get(k, 0.0), abs(a[k] - b[k]))
    params = {}
    for role in ref["max_param_change"]:  # the trained roles (no critic in a critic-free run)
        x = torch.load(os.path.join(run["output_dir"], f"final_{role}.pt"))
        y = torch.load(os.path.join(ref["output_dir"], f"final_{role}.pt"))
        assert x.keys() == y.keys()
        params[role] = max(float((x[k].float() - y[k].float()).abs().max()) for k in x)
    return metric, params


def assert_generated_alike(remote: dict, colocated: dict, atol: float, skip: tuple = ()) -> None:
    """Rollouts made elsewhere (rollout servers) against the colocated run (harness results): every numeric logged metric within `atol`
    (volatile keys and those starting with `skip` aside), the policy moved (later rollouts needed the broadcasts),
    and every rank's rollouts equal token for token."""
    worst = {}
    for a, b in zip(remote["records"], colocated["records"]):
        for k, v in b.items():
            if not k.startswith(VOLATILE + skip) and isinstance(v, (int, float)) and not isinstance(v, bool):
                worst[k] = max(worst.get(k, 0.0), abs(a[k] - v))
    assert max(worst.values()) <= atol, sorted(worst.items(), key=lambda kv: -kv[1])[:5]
    assert remote["max_param_change"]["actor"] > 1e-4
    for ra, rb in zip(remote["ranks"], colocated["ranks"]):
        assert ra["rollouts"] == rb["rollouts"]


def assert_resumed_exactly(straight: dict, resumed: dict, start: int) -> None:
    """A run resumed at iteration `start` (harness results) against the straight run: its first iteration equals
    the straight run's `start` exactly (every logged metric but the clocks, every rank's rollout)."""
    train = [r for r in resumed["records"] if "objective/score" in r]
    assert train and train[0]["iteration"] == start
    want, got = [r for r in straight["records"] if "objective/score" in r][start], train[0]
    keys = [k for k in want if not k.startswith(VOLATILE)]
    assert keys and {k: got[k] for k in keys} == {k: want[k] for k in keys}
    for rs, rr in zip(straight["ranks"], resumed["ranks"]):
        assert rr["rollouts"][0] == rs["rollouts"][start]


def closed_within(sock, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reads until EOF); the socket is closed after."""
    import socket

    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except socket.timeout:
        return False
    finally:
        sock.close()


def run_example(config: str, out: str, *extra: str, timeout: int = 1500) -> list[dict]:
    """`launch/train_ppo.py --config <config> --output_dir <out> <extra>` on every core, offline (the slow
    learning tests); its metrics records. RLHF_ENGINE_TEST_EXAMPLE_THREADS sets the threads instead (.ci/run: 1,
    where the run shares the cores with the vLLM job)."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS}
    threads = os.environ.get("RLHF_ENGINE_TEST_EXAMPLE_THREADS") or str(os.cpu_count() or 1)
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=threads)
    proc = subprocess.run([sys.executable, "launch/train_ppo.py", "--config", config, "--output_dir", out, *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def free_address() -> str:
    """A local HOST:PORT for a rollout server, from 20000-29999: below Linux's ephemeral range, so no port the
    system hands out meanwhile (a launcher's free MASTER_PORT, gloo's connections) can take it before the server
    listens there."""
    import random
    import socket

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"127.0.0.1:{port}"
    raise RuntimeError("no free port in 20000-29999")
