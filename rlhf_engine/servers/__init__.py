"""Rollout servers: stock `vllm serve` processes that generate for the trainer over HTTP, token in / token out,
their weights pushed through vLLM's own weight-transfer routes (docs/rollout-servers.md).

* `command.py`: the server's `vllm serve` command (launch/rollout_server.py execs it); `auth.py`: the bearer-token
  middleware on every route; `vllm_extension.py`: runs inside vLLM's workers (the `rlhf_gloo` weight-transfer
  backend and the methods the trainer calls through /collective_rpc); `protocol.py`: the names both sides share.
* The trainer's side: `client.py` (one server over HTTP), `pool.py` (requests spread over the servers by least
  outstanding requests, a failed server's requests moved to another with the same seed), `weights.py` (the push).
Nothing here imports DeepSpeed, and only vllm_extension.py imports vLLM.
"""
