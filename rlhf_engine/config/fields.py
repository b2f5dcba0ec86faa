"""The pieces every section is made of: `opt` (a field with its help text), the shared checks, and the names
the sections choose from."""
from __future__ import annotations

import math
from dataclasses import field
from typing import Any

from ..errors import Problems


DTYPES = ("auto", "fp32", "bf16", "fp16")  # auto: bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU
CPU_BF16_MATMUL = ("auto", "fp32", "native")  # RoleConfig.cpu_bf16_matmul (engine/cpu_matmul.py)
SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
ROLES = ("actor", "critic", "reference", "reward")  # every role a PPO run can have
TRAINED_ROLES = ("actor", "critic")  # the roles with an optimizer (the others are eval-only)


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with help text (the CLI and the docs read `metadata['help']`)."""
    if isinstance(default, (list, dict)):  # mutable defaults need a factory
        return field(default_factory=lambda: default.copy(), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


def is_number(v: Any) -> bool:
    """A real number (not a bool, not NaN): what every numeric field needs before it can be compared."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def check_positive(p: Problems, prefix: str, obj: Any, *names: str, allow_zero: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        bad = not is_number(v) or (v < 0 if allow_zero else v <= 0)
        if bad:
            p.add(prefix + n, v, f"must be {'>= 0' if allow_zero else '> 0'}")


def check_choice(p: Problems, prefix: str, obj: Any, name: str, choices: tuple) -> None:
    v = getattr(obj, name)
    if v not in choices:
        p.add(prefix + name, v, f"must be one of {', '.join(map(str, choices))}")
