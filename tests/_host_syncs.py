"""Count host<->device synchronisation points reached from Python, by rlhf_engine site. On CPU they cost nothing, so
tests count them instead of timing."""
import sys
from collections import Counter

import torch

# Tensor methods that wait for the device's queue to drain before they return (plus torch.equal)
METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "numpy", "nonzero")


class HostSyncs:
    """`with HostSyncs() as s: ...`; `s.at("ppo_math/")` = syncs whose innermost non-torch caller is in
    rlhf_engine/ppo_math/ (any path under rlhf_engine/ works as a prefix, e.g. "trainer/guards.py")."""

    def __init__(self):
        self.sites: Counter = Counter()  # "trainer/guards.py:step [tolist]" -> count; "other [...]" outside ours
        self._saved = []
        self._inside = False  # a counted call that calls another one (e.g. __format__ -> item) counts once

    @staticmethod
    def _site() -> str:
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename.replace("\\", "/")
            if "/torch/" in path or path == __file__ or path.startswith("<"):
                f = f.f_back
                continue
            if "/rlhf_engine/" in path:
                return f"{path.split('/rlhf_engine/', 1)[1]}:{f.f_code.co_name}"
            return "other"
        return "other"

    def _wrap(self, name, fn):
        def counted(*a, **k):
            if self._inside:
                return fn(*a, **k)
            self._inside = True
            try:
                self.sites[f"{self._site()} [{name}]"] += 1
                return fn(*a, **k)
            finally:
                self._inside = False

        return counted

    def at(self, prefix: str) -> int:
        return sum(n for site, n in self.sites.items() if site.startswith(prefix))

    def __enter__(self):
        targets = [(torch.Tensor, m) for m in METHODS] + [(torch, "equal")]
        for owner, name in targets:
            orig = owner.__dict__.get(name)  # None: inherited from torch._C.TensorBase, restored by deleting
            self._saved.append((owner, name, orig))
            setattr(owner, name, self._wrap(name, getattr(owner, name)))
        return self

    def __exit__(self, *exc):
        for owner, name, orig in reversed(self._saved):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self._saved.clear()
        return False
