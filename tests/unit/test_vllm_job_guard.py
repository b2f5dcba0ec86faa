"""The vLLM job fails when its vllm tests did not all run (tests/_vllm_job.py, applied by tests/conftest.py): a job whose every
test skipped, because vLLM no longer imports in its environment, would otherwise pass."""
import os
import subprocess
import sys
import types

from _support import ROOT
from _vllm_job import REQUIRE_VLLM, vllm_job_shortfall


def _report(nodeid, vllm=True, when="call", longrepr=None):
    return types.SimpleNamespace(nodeid=nodeid, keywords={"vllm": 1} if vllm else {}, when=when, longrepr=longrepr)


def test_the_shortfall_names_a_skipped_vllm_test_and_an_empty_job():
    ok = {"passed": [_report("a"), _report("b", vllm=False)]}
    assert vllm_job_shortfall(ok) == ""
    skipped = dict(ok, skipped=[_report("c", when="setup", longrepr=("f.py", 3, "Skipped: vLLM is not installed"))])
    assert "1 vllm test(s) skipped" in vllm_job_shortfall(skipped) and "c: Skipped: vLLM" in vllm_job_shortfall(skipped)
    assert vllm_job_shortfall({"passed": [_report("b", vllm=False)]}) == "the vLLM job ran no vllm test"
    assert vllm_job_shortfall({}) == "the vLLM job ran no vllm test"


def test_a_vllm_job_whose_tests_skip_fails():
    """Here (no vLLM in this environment) the catalogue's vllm test skips: as the vLLM job the session fails naming
    it; without the job's variable the same selection passes (the control)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "vllm",
           "tests/unit/test_bad_input_catalogue.py"]
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_VLLM}
    control = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert control.returncode == 0, control.stdout[-2000:]
    job = subprocess.run(cmd, cwd=ROOT, env={**env, REQUIRE_VLLM: "1"}, capture_output=True, text=True, timeout=120)
    assert job.returncode == 1 and "skipped in the vLLM job" in job.stdout, job.stdout[-2000:]
