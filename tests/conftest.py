import functools
import os

# Before torch/deepspeed are imported anywhere in the test process.
for key, value in dict(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline", DS_ACCELERATOR="cpu",
                       TOKENIZERS_PARALLELISM="false", DEEPSPEED_TIMEOUT="3").items():
    os.environ.setdefault(key, value)

# The tokenized-data cache of this test session (inherited by every launched rank): never the user's ~/.cache, and
# empty at the start, so a test never reads an entry written by an older checkout.
if "RLHF_ENGINE_DATA_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RLHF_ENGINE_DATA_CACHE"] = tempfile.mkdtemp(prefix="rlhf_test_data_cache-")
    atexit.register(shutil.rmtree, os.environ["RLHF_ENGINE_DATA_CACHE"], True)

import pytest  # noqa: E402

from _support import make_tiny_setup  # noqa: E402
from _running import finished, started  # noqa: E402
from _vllm_job import REQUIRE_VLLM, vllm_job_shortfall  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Tiny GPT-2 actor + reward model, pad == EOS tokenizer, 32 prompts (built once per session)."""
    return make_tiny_setup(str(tmp_path_factory.mktemp("tiny_gpt2")))


@pytest.fixture(scope="session")
def ppo_harness(request, tiny, tmp_path_factory):
    """The shared launches of ppo_checks.py (tests/_support.py: SharedHarness)."""
    from _support import SharedHarness

    return SharedHarness(request.session, tiny, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_setup(str(tmp_path_factory.mktemp("tiny_llama")), arch="llama", pad_is_eos=False)


@pytest.fixture(scope="session")
def dist_single():
    """An in-process one-rank torch.distributed group (gloo on CPU), for engine tests without subprocesses."""
    from rlhf_engine.engine import init_distributed

    return init_distributed()


@pytest.fixture(scope="session")
def tiny_vllm(tmp_path_factory):
    """Tiny Llama actor + reward model with the head size vLLM's CPU attention takes (32), no dropout."""
    return make_tiny_setup(str(tmp_path_factory.mktemp("tiny_vllm")), arch="llama", pad_is_eos=False, n_head=2,
                           dropout=0.0)


@pytest.fixture(scope="session")
def tiny_vllm_tied(tmp_path_factory):
    """As tiny_vllm, the actor's LM head tied to its embedding (SmolLM2's layout; vLLM on CPU packs a tied head once,
    which a push must repack: engine/generation/vllm_engine.repack_tied_head)."""
    return make_tiny_setup(str(tmp_path_factory.mktemp("tiny_vllm_tied")), arch="llama", pad_is_eos=False, n_head=2,
                           dropout=0.0, tie_embeddings=True)


@functools.lru_cache(maxsize=None)  # the scheduler and the collection hook both ask, in the same process
def _shared_launch_files() -> frozenset:
    """The test files that take part in the shared PPO launches (they define `harness_runs`: SharedHarness)."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = set()
    for path in glob.glob(os.path.join(root, "tests", "**", "test_*.py"), recursive=True):
        with open(path) as f:
            if "\ndef harness_runs(" in f.read():
                found.add(os.path.relpath(path, root).replace(os.sep, "/"))
    return frozenset(found)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist with `--dist loadfile` (scripts/test.sh): a file's tests run in one process, so its module
    fixtures (a launch, a model) are built once, and the files of the shared PPO launches run in the same process,
    so those launches start once (a process of its own would launch every module's runs)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    shared = _shared_launch_files()

    class SharedLaunchScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "shared PPO launches" if path in shared else path

    return SharedLaunchScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Under `--dist loadfile`: the shared launches' files first (the longest scope of work), then the other multi-rank
    files, then the rest, each in collection order (every xdist process sorts alike: their collections must agree)."""
    if config.pluginmanager.hasplugin("xdist") and config.getvalue("dist") == "loadfile":
        shared = _shared_launch_files()

        def rank(item):
            path = item.nodeid.split("::", 1)[0]
            return 0 if path in shared else 1 if path.startswith("tests/distributed/") else 2

        items.sort(key=rank)


def pytest_runtest_logstart(nodeid, location):
    started(nodeid)  # tests/_running.py: what .ci/run names when it stops at its time limit


def pytest_runtest_logfinish(nodeid, location):
    finished(nodeid)


def pytest_sessionfinish(session, exitstatus):
    """In the vLLM job (REQUIRE_VLLM set), fail the session when its vllm tests did not all run (vllm_job_shortfall).
    Under pytest-xdist this runs in the controller too, which holds every process's reports."""
    if not os.environ.get(REQUIRE_VLLM) or hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    why = vllm_job_shortfall(reporter.stats if reporter is not None else {})
    if why:
        if reporter is not None:
            reporter.write_line(f"vLLM job: {why}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
