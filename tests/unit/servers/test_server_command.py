"""The rollout server's command (rlhf_engine/servers/command.py) and launch/rollout_server.py's flag checks: what
stock vLLM is started with, and a bad flag refused with its name before vLLM starts."""
import os
import subprocess
import sys

from rlhf_engine.servers.command import ServerSettings, problems, server_command, shell_line
from rlhf_engine.servers.protocol import BACKEND_NAME, EXTENSION, MIDDLEWARE, TOKEN_ENV_POINTER

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def test_a_cpu_server_with_a_token():
    env, argv = server_command(ServerSettings(model="/m", port=8123, auth_token_env="TOK", max_model_len=300,
                                              kv_cache_mb=64), python="/py")
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", TOKEN_ENV_POINTER: "TOK", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert "--tokens-only" in argv and "--enforce-eager" in argv
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--worker-extension-cls") == EXTENSION
    assert _flag(argv, "--weight-transfer-config") == '{"backend": "%s"}' % BACKEND_NAME
    assert _flag(argv, "--middleware") == MIDDLEWARE
    assert _flag(argv, "--host") == "0.0.0.0" and _flag(argv, "--port") == "8123"
    assert _flag(argv, "--dtype") == "float32"  # vLLM's auto would run an fp32 model in bf16 on a CPU
    assert _flag(argv, "--kv-cache-memory-bytes") == str(64 << 20) and _flag(argv, "--max-model-len") == "300"
    assert _flag(argv, "--distributed-executor-backend") == "uni"


def test_without_a_token_the_server_listens_on_this_host_only_and_a_gpu_takes_weights_over_gloo_too():
    """On a GPU as on a CPU the weights come over rlhf_gloo, the only backend this trainer sends over (vLLM's nccl
    needs a trainer side that is not built; the trainer's probe refuses a server that runs it)."""
    env, argv = server_command(ServerSettings(model="/m", device="cuda", extra=("--data-parallel-size", "2")))
    assert _flag(argv, "--host") == "127.0.0.1" and "--middleware" not in argv and TOKEN_ENV_POINTER not in env
    assert _flag(argv, "--weight-transfer-config") == '{"backend": "%s"}' % BACKEND_NAME
    assert _flag(argv, "--dtype") == "auto"
    assert "--kv-cache-memory-bytes" not in argv and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert argv[-2:] == ["--data-parallel-size", "2"]
    line = shell_line(env, argv)
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 ") and "'{\"backend\": \"rlhf_gloo\"}'" in line


def test_the_probe_refuses_a_server_that_receives_weights_another_way():
    """A server started by hand with vLLM's nccl backend is named before any engine is built; ours passes."""
    from rlhf_engine.engine.generation.servers import server_problems
    from rlhf_engine.servers.protocol import EXTENSION_VERSION, RECEIVER

    info = {"extension": EXTENSION_VERSION, "architectures": ["LlamaForCausalLM"], "dtype": "float32",
            "max_model_len": 512, "logprobs_mode": "processed_logprobs", "weight_transfer": RECEIVER}
    assert server_problems(info, "http://s:1", ["LlamaForCausalLM"], "fp32", 100) == []
    found = server_problems({**info, "weight_transfer": "NCCLWeightTransferEngine"}, "http://s:1",
                            ["LlamaForCausalLM"], "fp32", 100)
    assert len(found) == 1 and found[0].startswith("http://s:1 receives weights with NCCLWeightTransferEngine")
    assert "--weight-transfer-config '{\"backend\": \"rlhf_gloo\"}'" in found[0], found


def test_problems_name_each_flag(tmp_path):
    s = ServerSettings(model=str(tmp_path / "missing"), auth_token_env="TOK", port=0, device="tpu")
    assert [flag for flag, _ in problems(s, {})] == ["model", "auth_token_env", "port", "device"]
    ok = ServerSettings(model=str(tmp_path), auth_token_env="TOK")
    assert problems(ok, {"TOK": "x"}) == []


def test_the_launch_script_refuses_before_vllm_and_prints_the_command(tmp_path):
    script = os.path.join(ROOT, "launch", "rollout_server.py")
    env = dict(os.environ)
    env.pop("UNSET_TOKEN_VAR", None)
    bad = subprocess.run([sys.executable, script, str(tmp_path), "--auth_token_env", "UNSET_TOKEN_VAR"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "--auth_token_env: the variable UNSET_TOKEN_VAR is empty" in bad.stderr
    shown = subprocess.run([sys.executable, script, str(tmp_path), "--port", "8200", "--print", "--",
                            "--max-num-seqs", "8"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "vllm.entrypoints.openai.api_server" in shown.stdout and shown.stdout.strip().endswith("--max-num-seqs 8")
