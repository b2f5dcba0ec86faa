"""User code named on the command line as 'package.module:name' (a reward function, an environment factory)."""
from __future__ import annotations

import importlib
from typing import Callable


def load_callable(spec: object, setting: str, example: str, what: str = "function") -> Callable:
    """'package.module:name' -> the callable it names. Raises ValueError naming the setting, the spec and the fix."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"{setting} = {spec!r}: expected 'module:{what}', e.g. '{example}'")
    module_name, name = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (any import failure is the user's to fix)
        raise ValueError(f"{setting} = {spec!r}: cannot import {module_name!r} ({type(e).__name__}: {e}); make it "
                         "importable (PYTHONPATH) or fix the module name") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{setting} = {spec!r}: {module_name} has no callable {name!r}")
    return fn
