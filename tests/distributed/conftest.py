"""The fixtures of the multi-rank tests that share their launches (tests/_support.py: SharedHarness): a module
that defines `harness_runs(tiny, tmp) -> {"two_rank": runs, "one_rank": runs}` gets its runs' results here."""
import pytest


@pytest.fixture(scope="module")
def two_rank(ppo_harness, request):
    """The requesting module's runs of the shared 2-rank launch, by name."""
    return ppo_harness.runs(request.module.__name__, "two_rank")


@pytest.fixture(scope="module")
def one_rank(ppo_harness, request):
    """The requesting module's runs of the shared 1-rank launch, by name."""
    return ppo_harness.runs(request.module.__name__, "one_rank")
