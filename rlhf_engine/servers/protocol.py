"""What the trainer and its rollout servers agree on (both sides import this; no vLLM, no torch)."""
from __future__ import annotations

BACKEND_NAME = "rlhf_gloo"  # the weight-transfer backend vllm_extension.py registers in vLLM
RECEIVER = "GlooWeightTransfer"  # its class, as a server's info names the engine it receives weights with
EXTENSION = "rlhf_engine.servers.vllm_extension.RolloutServerExtension"  # --worker-extension-cls
EXTENSION_VERSION = 1  # raised when the extension's methods or the update protocol change
STORE_PREFIX = "rlhf_weights"  # the gloo group's keys in the trainer's store
MIDDLEWARE = "rlhf_engine.servers.auth.BearerToken"  # --middleware
# the server's environment: the name of the variable that holds its bearer token (the launch script sets it; the
# middleware reads that variable, so the token itself is never on a command line)
TOKEN_ENV_POINTER = "RLHF_ROLLOUT_AUTH_TOKEN_ENV"
