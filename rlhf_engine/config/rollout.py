"""Where the rollouts are generated: the trainer's ranks, rollout servers (docs/rollout-servers.md) or rollout
workers (docs/async-rollouts.md), and how far ahead of training."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problems
from .fields import check_choice, check_positive, is_number, opt

GROUP_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class RolloutConfig:
    """Where the rollouts are generated: on the trainer's ranks (the default), by rollout servers (stock vLLM servers
    started with launch/rollout_server.py, reached over HTTP), or by `rollout_workers` processes started with
    `python launch/rollout_worker.py --rollout_address HOST:PORT` (to be removed: the servers replace them)."""

    rollout_workers: int = opt(0, "Rollout worker processes that generate for this run (0 = the trainer's ranks "
                               "generate). Each is started with launch/rollout_worker.py --rollout_address HOST:PORT "
                               "and runs the generation_backend on a plain copy of the policy.")
    rollout_address: str = opt("", "HOST:PORT where the trainer's rank 0 waits for its rollout workers (a TCP store "
                               "of their own group: never the trainer's DeepSpeed group); give the workers the same.")
    max_staleness: int = opt(0, "Policy versions a trained batch may lag behind the trainer's weights. 0 = "
                             "synchronous: every batch is generated with the current weights (equals the "
                             "colocated run); K >= 1: the workers or servers generate the next K iterations while "
                             "the trainer trains, and rollout_correction defaults to token_truncate. With servers it "
                             "holds per token: no token older than K versions is trained on.")
    rollout_timeout_s: float = opt(300.0, "Seconds the trainer waits for its workers (to join, to answer a batch, "
                                   "to take the weights) before it stops naming the worker.")
    rollout_group_backend: str = opt("auto", "The process group that carries the weights from the trainer to its "
                                     "workers: gloo (through CPU memory), nccl (GPU to GPU: the trainer and every "
                                     "worker on a GPU), auto (nccl when the trainer runs on a GPU and this torch has "
                                     "NCCL, else gloo). The workers take the trainer's choice.")

    rollout_servers: str = opt("", "Rollout servers that generate for this run: URL[,URL...] or @FILE (one URL a "
                               "line), each a stock vLLM server started with launch/rollout_server.py "
                               "(docs/rollout-servers.md). Needs generation_backend vllm; the trainer checks every "
                               "server before it builds an engine and pushes its weights before the first request.")
    rollout_auth_token_env: str = opt("", "The environment variable holding the rollout servers' bearer token (the "
                                      "one their --auth_token_env names); '' = servers without a token.")
    partial_rollouts: bool = opt(False, "Rollout servers at max_staleness >= 2: a weight push pauses the requests "
                                 "in flight and they go on with the new weights (vLLM's pause mode keep), so a "
                                 "response may span two versions, each token scored by the version that sampled "
                                 "it. Off: a push waits until the requests in flight are done (mode wait), every "
                                 "response is one version's, and K >= 2 overlaps no more than K = 1.")

    @property
    def on(self) -> bool:
        """Rollout workers (the TCP-store transport)."""
        return isinstance(self.rollout_workers, int) and self.rollout_workers > 0

    @property
    def servers_on(self) -> bool:
        return bool(str(self.rollout_servers or "").strip())

    @property
    def remote(self) -> bool:
        """Rollouts made outside the trainer's ranks (workers or servers)."""
        return self.on or self.servers_on

    @property
    def ahead(self) -> bool:
        """Rollouts generated ahead of training (max_staleness >= 1 with workers or servers)."""
        return bool(self.remote and is_number(self.max_staleness) and self.max_staleness >= 1)

    def validate(self, p: Problems, prefix: str = "") -> None:
        check_positive(p, prefix, self, "rollout_workers", "max_staleness", allow_zero=True)
        check_positive(p, prefix, self, "rollout_timeout_s")
        check_choice(p, prefix, self, "rollout_group_backend", GROUP_BACKENDS)
        if is_number(self.rollout_workers) and not isinstance(self.rollout_workers, int):
            p.add(prefix + "rollout_workers", self.rollout_workers, "must be a whole number")
        if self.on and not _host_port(self.rollout_address):
            p.add(prefix + "rollout_address", self.rollout_address, "give HOST:PORT (the trainer's rank 0 listens "
                  "there; start each worker with launch/rollout_worker.py --rollout_address HOST:PORT)")
        if is_number(self.max_staleness) and self.max_staleness > 0 and not self.remote:
            p.add(prefix + "max_staleness", self.max_staleness, "needs rollout_servers (or rollout_workers): the "
                  "trainer's own ranks generate with the current weights")
        if self.partial_rollouts and not self.servers_on:
            p.add(prefix + "partial_rollouts", self.partial_rollouts, "needs rollout_servers (the pause that keeps "
                  "requests in flight is vLLM's server's)")
        if self.servers_on:
            if self.on:
                p.add(prefix + "rollout_servers", self.rollout_servers, "choose rollout_servers or rollout_workers, "
                      "not both (the servers replace the workers)")
            try:
                server_urls(self.rollout_servers)
            except ValueError as e:
                p.add(prefix + "rollout_servers", self.rollout_servers, str(e))


def _host_port(address: str) -> tuple | None:
    """('host', port) of 'HOST:PORT', or None."""
    host, _, port = str(address).rpartition(":")
    return (host, int(port)) if host and port.isdigit() and 0 < int(port) < 65536 else None


def parse_address(address: str) -> tuple:
    """('host', port) of a checked 'HOST:PORT' (ValueError naming the flag otherwise)."""
    hp = _host_port(address)
    if hp is None:
        raise ValueError(f"rollout_address {address!r}: give HOST:PORT")
    return hp


def group_backend(choice: str, device_type: str, nccl_available: bool) -> str:
    """The weight group's backend for a trainer on `device_type` ('cuda', 'cpu'): `choice` unless it is auto."""
    if choice != "auto":
        return choice
    return "nccl" if device_type == "cuda" and nccl_available else "gloo"


def server_urls(value: str) -> list:
    """The rollout servers' base URLs from `URL[,URL...]` or `@FILE` (one a line; blank lines and # comments
    skipped), each as http(s)://HOST:PORT[/path] without a trailing slash; a ValueError saying what is wrong."""
    import urllib.parse

    value = str(value or "").strip()
    if value.startswith("@"):
        try:
            with open(value[1:]) as f:
                items = [line.split("#", 1)[0].strip() for line in f]
        except OSError as e:
            raise ValueError(f"cannot read the file of server URLs ({e.strerror}: {value[1:]})") from None
    else:
        items = [v.strip() for v in value.split(",")]
    urls = []
    for item in filter(None, items):
        parsed = urllib.parse.urlsplit(item if "://" in item else "http://" + item)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{item!r} is not a server URL: give http://HOST:PORT")
        try:
            port = parsed.port
        except ValueError:
            port = None
        if port is None:
            raise ValueError(f"{item!r}: give the server's port (http://HOST:PORT)")
        url = f"{parsed.scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        if url in urls:
            raise ValueError(f"{url} is listed twice")
        urls.append(url)
    if not urls:
        raise ValueError("no server URL given")
    return urls
