"""What makes a vLLM job count (tests/conftest.py fails the session otherwise): every vllm test ran."""


REQUIRE_VLLM = "RLHF_ENGINE_TEST_REQUIRE_VLLM"  # scripts/test.sh --vllm sets it: the vLLM job


def vllm_job_shortfall(stats: dict) -> str:
    """Why a vLLM job's results (the terminal reporter's `stats`: outcome -> reports) do not count as one ('': they
    do): no vllm-marked test passed, or one was skipped (a job whose every test skips would otherwise pass)."""
    def vllm(reports):
        return [r for r in reports if "vllm" in getattr(r, "keywords", {}) and getattr(r, "when", "call") != "teardown"]

    passed, skipped = vllm(stats.get("passed", [])), vllm(stats.get("skipped", []))
    if skipped:
        first = skipped[0]
        reason = first.longrepr[-1] if isinstance(first.longrepr, tuple) else str(first.longrepr)
        return f"{len(skipped)} vllm test(s) skipped in the vLLM job, e.g. {first.nodeid}: {reason}"
    if not passed:
        return "the vLLM job ran no vllm test"
    return ""
