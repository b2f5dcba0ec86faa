"""Where the rollouts are generated: the trainer's ranks or rollout servers (docs/rollout-servers.md), and how far
ahead of training."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import Problems
from .fields import check_positive, is_number, opt

# the rollout workers' flags, replaced by the rollout servers (docs/rollout-servers.md): what to use instead
RETIRED = {
    "rollout_workers": "the rollout workers were replaced by rollout servers: start stock vLLM servers with "
                       "launch/rollout_server.py MODEL --port PORT and pass --rollout_servers URL[,URL...] with "
                       "--generation_backend vllm (docs/rollout-servers.md)",
    "rollout_address": "rollout servers are reached by URL: --rollout_servers http://HOST:PORT[,...] "
                       "(docs/rollout-servers.md)",
    "rollout_group_backend": "rollout servers take the weights through vLLM's weight-transfer routes, chosen by "
                             "the server (nccl on GPUs, our gloo backend on CPU): drop the flag "
                             "(docs/rollout-servers.md)",
}


@dataclass
class RolloutConfig:
    """Where the rollouts are generated: on the trainer's ranks (the default), or by rollout servers (stock vLLM
    servers started with launch/rollout_server.py, reached over HTTP), and how far ahead of training."""

    max_staleness: int = opt(0, "Policy versions a trained token may lag behind the trainer's weights. 0 = "
                             "synchronous: every batch is generated with the current weights (equals the "
                             "colocated run); K >= 1: the rollout servers generate the next K iterations while the "
                             "trainer trains, no token older than K versions is trained on, and rollout_correction "
                             "defaults to token_truncate.")
    rollout_timeout_s: float = opt(300.0, "Seconds the trainer waits for a rollout server (to answer the plan's "
                                   "check, a request, a weight push) before it marks the server down; with none "
                                   "up, requests wait for one to answer again, and the run stops when none has been "
                                   "up this long.")

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
    def servers_on(self) -> bool:
        return bool(str(self.rollout_servers or "").strip())

    @property
    def ahead(self) -> bool:
        """Rollouts generated ahead of training (max_staleness >= 1 with rollout servers)."""
        return bool(self.servers_on and is_number(self.max_staleness) and self.max_staleness >= 1)

    def validate(self, p: Problems, prefix: str = "") -> None:
        check_positive(p, prefix, self, "max_staleness", allow_zero=True)
        check_positive(p, prefix, self, "rollout_timeout_s")
        if is_number(self.max_staleness) and self.max_staleness > 0 and not self.servers_on:
            p.add(prefix + "max_staleness", self.max_staleness, "needs rollout_servers: the trainer's own ranks "
                  "generate with the current weights")
        if self.partial_rollouts and not self.servers_on:
            p.add(prefix + "partial_rollouts", self.partial_rollouts, "needs rollout_servers (the pause that keeps "
                  "requests in flight is vLLM's server's)")
        if self.servers_on:
            try:
                server_urls(self.rollout_servers)
            except ValueError as e:
                p.add(prefix + "rollout_servers", self.rollout_servers, str(e))


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
