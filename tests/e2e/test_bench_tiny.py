"""CI smoke test of the prepared GPU benchmark: `bash bench/gpu.sh --tiny` runs the same script and code path on CPU
with tiny OPT shapes (environment check, model folders, ZeRO-2 and ZeRO-3 PPO iterations, the Hybrid Engine step
skipped with its reason plus the greedy self-check of the harness), and bench/make_readme.py renders its JSON."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # a release check of bench/gpu.sh (70 s on 2 cores)
def test_gpu_script_tiny_mode_writes_the_benchmark_json(tmp_path):
    out, work = tmp_path / "results" / "cpu" / "gpu-tiny", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, BENCH_WORK_DIR=str(work), WHEELS=str(tmp_path / "no_wheels"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)  # the script's processes are single-rank launches of their own
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--tiny", "--out", str(out), "--budget", "300"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    g = json.loads((out / "gpu.json").read_text())
    assert g["tiny"] is True and g["within_budget"] and g["env"]["ok"]
    assert g["env"]["import_check"]["deepspeed"]
    steps = {s["name"]: s for s in g["steps"]}
    assert set(steps) == {"env", "models", "zero2", "zero3", "hybrid"}
    assert all(s["rc"] == 0 for s in steps.values())
    rows = {r["step"]: r for r in g["table"] if not r["variant"].startswith("greedy")}
    for step, zero in (("zero2", 2), ("zero3", 3)):
        r = rows[step]
        assert r["zero"] == zero and r["iterations"] >= 1 and r["samples_per_s"] > 0
        assert r["generated_tokens_per_s"] > 0 and r["tflops"]["overall"] > 0 and r["peak_mem_mib"][0] > 0
        sh = r["share"]
        parts = sh["generation"] + sh["experience"] + sh["training"]
        assert 0.9 < parts <= 1.0 + 1e-6, sh  # the three phases are (almost) the whole iteration
        assert abs(sh["training/actor"] + sh["training/critic"] + sh["training/other"] - sh["training"]) < 1e-6
        res = steps[step]["result"]
        assert res["setup"]["fixed_length"] and res["gather_once"]  # "not implemented" or the config field
        its = [e for e in res["variants"][0]["iterations"] if not e["warmup"]]
        # fixed length: every response has exactly answer_len tokens, no padding anywhere
        assert all(e["shape"]["R"] == res["setup"]["answer_len"] and e["padding_fraction"] == 0 for e in its)
    hybrid = steps["hybrid"]["result"]
    assert "CUDA" in hybrid["variants"][0]["skipped"]
    check = hybrid["greedy_harness_check"]
    assert check["passed"] and check["token_agreement"] == 1.0 and check["prefill_logits_max_abs_diff"] == 0.0

    # the README generator renders these results (and says what is not measured yet)
    readme = tmp_path / "README.md"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_readme.py"), "--results",
                    str(tmp_path / "results"), "--out", str(readme)], check=True, capture_output=True, timeout=120)
    text = readme.read_text()
    assert "Not measured yet" in text and "--tiny" in text and "| zero2 | 2 | no | ok" in text
