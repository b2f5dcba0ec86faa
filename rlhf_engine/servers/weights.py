"""The trainer's side of the weight transfer to its rollout servers (vLLM's lifecycle, our `rlhf_gloo` backend).

Per server, one gloo group of the trainer's rank 0 (rank 0, serving the group's TCP store on this host) and the
server's workers (ranks 1...): a lost server breaks only its own group. A push, on every server at once:

    pause (mode keep: requests in flight stop where they are and go on with the new weights after the resume; mode
    wait: they finish first; either way the prefix cache is cleared) -> start (vLLM's layer-by-layer reload)
    -> per block of weights: /update_weights announces its names, dtypes and shapes while the trainer broadcasts the
       tensors in that order -> finish with the version -> resume

then each server's receipt (tensors and elements received, finished) is compared with what was sent. The weights
travel in memory, never through a file. vLLM answers every weight route only once its workers are done, so each HTTP
call that pairs with a broadcast runs in a thread of its own while this thread broadcasts.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
from typing import Iterable, Optional

import torch

from .client import ServerClient, ServerError
from .protocol import STORE_PREFIX


class GlooSender:
    """The weight group between this process (rank 0) and one server's workers."""

    def __init__(self, client: ServerClient, workers: int, timeout_s: float):
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        self.client, self.world = client, 1 + int(workers)
        timeout = datetime.timedelta(seconds=float(timeout_s))
        recover(client)
        host = client.local_address()
        self.store = TCPStore(host, 0, self.world, is_master=True, timeout=timeout, wait_for_workers=False)
        info = {"master_address": host, "master_port": int(self.store.port), "world_size": self.world,
                "timeout_s": float(timeout_s)}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.init_weight_transfer, info)
            try:
                self.group = ProcessGroupGloo(PrefixStore(STORE_PREFIX, self.store), 0, self.world, timeout)
            finally:
                joined.result()  # the server's error first: it says why the group did not form

    def send_block(self, tensors: list, update_info: dict) -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answered = pool.submit(self.client.update_weights, update_info)
            try:
                for t in tensors:
                    self.group.broadcast(t, 0).wait()
            finally:
                answered.result()


def recover(client: ServerClient) -> None:
    """Close what an earlier trainer left open on a server (killed or preempted mid-push): an update still active
    is finished (its half-loaded layers are overwritten by this trainer's first push, which comes before any request)
    and a paused server resumed."""
    if client.info().get("update_active"):
        client.finish_weight_update("abandoned")
    if (client.call("GET", "/is_paused") or {}).get("is_paused"):
        client.resume()


def block_payload(values: list, sha256: bool = False) -> tuple[list, dict]:
    """(contiguous CPU tensors, the update_info announcing them) of one block's (name, tensor) pairs."""
    tensors = [v.detach().to("cpu").contiguous() for _, v in values]
    info = {"names": [n for n, _ in values], "dtype_names": [str(t.dtype).replace("torch.", "") for t in tensors],
            "shapes": [list(t.shape) for t in tensors], "sha256": bool(sha256)}
    return tensors, info


def block_sha256(tensors: list) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class WeightPush:
    """One push to a set of servers: `start()`, `block(values)` per block, `finish(version)`. A server that fails at
    any step is left out of the rest of the push and listed in `failed` (url -> reason); the others go on."""

    def __init__(self, senders: dict, sha256: bool = False, pause_mode: str = "keep"):
        self.senders = dict(senders)  # url -> GlooSender
        self.failed: dict = {}
        self.sha256, self.pause_mode = sha256, pause_mode
        self.sent = {"tensors": 0, "elements": 0, "sha256": []}
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self.senders)))

    def _each(self, fn) -> None:
        live = [u for u in self.senders if u not in self.failed]
        futures = {u: self._pool.submit(fn, self.senders[u]) for u in live}
        for url, f in futures.items():
            try:
                f.result()
            except (ServerError, RuntimeError, OSError) as e:
                self.failed[url] = str(e).splitlines()[0][:400] if str(e) else type(e).__name__

    def start(self) -> None:
        def go(s: GlooSender):
            s.client.pause(self.pause_mode)
            s.client.start_weight_update()
        self._each(go)

    def block(self, values: Iterable) -> None:
        tensors, info = block_payload(list(values), self.sha256)
        self.sent["tensors"] += len(tensors)
        self.sent["elements"] += sum(t.numel() for t in tensors)
        if self.sha256:
            self.sent["sha256"].append(block_sha256(tensors))
        self._each(lambda s: s.send_block(tensors, info))

    def finish(self, version: int) -> None:
        def go(s: GlooSender):
            s.client.finish_weight_update(str(version))
            for receipt in s.client.weight_receipts():
                got = {k: (receipt or {}).get(k) for k in ("tensors", "elements")}
                if got != {"tensors": self.sent["tensors"], "elements": self.sent["elements"]} or not (
                        receipt or {}).get("finished"):
                    raise RuntimeError(f"{s.client.url} received {got} of {self.sent['tensors']} tensors "
                                       f"({self.sent['elements']} elements) in the push of version {version}")
                if self.sha256 and receipt.get("sha256") != self.sent["sha256"]:
                    raise RuntimeError(f"{s.client.url}: the weights' bytes differ from what was sent")
            s.client.resume()
        self._each(go)
        self._pool.shutdown()

    def abort(self) -> None:
        """After a failure on this side (the weight stream raised): every server resumes on what it holds."""
        def go(s: GlooSender):
            s.client.resume()
        self._each(go)
        self._pool.shutdown()


def connect_senders(clients: list, workers: dict, timeout_s: float) -> tuple[dict, dict]:
    """({url: GlooSender}, {url: why it could not join}) for the given clients (`workers`: url -> worker count)."""
    senders, failed = {}, {}
    for c in clients:
        try:
            senders[c.url] = GlooSender(c, workers[c.url], timeout_s)
        except (ServerError, RuntimeError, OSError) as e:
            failed[c.url] = str(e).splitlines()[0][:400] if str(e) else type(e).__name__
    return senders, failed


def version_of(label: Optional[str]) -> Optional[int]:
    """The trainer's version from a server's weight-version label ('default' or anything else foreign: None)."""
    try:
        return int(str(label))
    except (TypeError, ValueError):
        return None
