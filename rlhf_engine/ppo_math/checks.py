"""Input checks shared by every function of the package (private): floating tensors of a given shape, 0/1 masks,
bounded numbers, the global token count. Shape, dtype and hyperparameter checks raise ``ValueError`` at once (no
host sync); data-dependent checks are collected as ``_Check`` pairs and evaluated together by ``_raise_first``, one
host sync per call.
"""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch


_Check = Tuple[torch.Tensor, Callable[[], str]]  # (0-dim bool tensor "input is bad", message builder)


def _shape(x: torch.Tensor) -> Tuple[int, ...]:
    return tuple(x.shape)


def _tensor(name: str, x: object, *, shape: Optional[Sequence[int]] = None,
            shape_of: str = "", ndim: Optional[int] = None) -> torch.Tensor:
    """Check that `x` is a floating tensor of the given shape/ndim; return it upcast to fp32 (graph kept)."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if ndim is not None and x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {_shape(x)}")
    if shape is not None and _shape(x) != tuple(shape):
        ref = f" (the shape of {shape_of})" if shape_of else ""
        raise ValueError(f"{name}: expected shape {tuple(shape)}{ref}, got {_shape(x)}")
    return x.float()


def _mask(name: str, mask: object, shape: Sequence[int], shape_of: str, checks: Optional[List[_Check]]
          ) -> torch.Tensor:
    """Check a 0/1 mask of the given shape (value checks are appended to `checks`; None skips them, and their
    kernels); return it as a bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise ValueError(f"{name}: expected a bool, integer or floating 0/1 tensor, got dtype {mask.dtype}")
    if _shape(mask) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} (the shape of {shape_of}), got {_shape(mask)}")
    if mask.dtype != torch.bool:
        raw = mask
        if checks is not None:
            not01 = (raw != 0) & (raw != 1)
            checks.append((not01.any(), lambda: f"{name}: expected only 0/1 values, got e.g. "
                                                f"{raw[not01][0].item()!r}"))
        mask = raw != 0
    return mask


def _raise_first(checks: Optional[List[_Check]]) -> None:
    """Evaluate the data-dependent checks with a single host sync; raise ValueError for the first failing one."""
    if not checks:
        return
    device = checks[0][0].device
    flags = torch.stack([bad.reshape(()).to(device) for bad, _ in checks]).tolist()
    for bad, (_, message) in zip(flags, checks):
        if bad:
            raise ValueError(message())


def _number(name: str, x: object, *, ge: Optional[float] = None, gt: Optional[float] = None,
            le: Optional[float] = None) -> float:
    """A real number (python/numpy scalar or 1-element tensor) within the given bounds, as a python float."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex():
            raise ValueError(f"{name}: expected a real number, got a tensor of shape {_shape(x)} and dtype {x.dtype}")
        x = x.item()
    if isinstance(x, (str, bytes, bool)) or x is None:
        raise ValueError(f"{name}: expected a real number, got {x!r}")
    try:
        v = float(x)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a real number, got {x!r}") from None
    if math.isnan(v):
        raise ValueError(f"{name}: expected a real number, got nan")
    if ge is not None and not v >= ge:
        raise ValueError(f"{name}: expected a value >= {ge}, got {v}")
    if gt is not None and not v > gt:
        raise ValueError(f"{name}: expected a value > {gt}, got {v}")
    if le is not None and not v <= le:
        raise ValueError(f"{name}: expected a value <= {le}, got {v}")
    return v


def _num_tokens(num_tokens: object, local: torch.Tensor, checks: Optional[List[_Check]]) -> torch.Tensor:
    """The loss denominator as a 0-dim fp32 tensor (>= 1 so an all-empty batch gives loss 0, never NaN); the check
    `num_tokens >= local` is appended to `checks` (None: not checked)."""
    if num_tokens is None:
        return local.clamp_min(1.0)
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1 or num_tokens.is_complex() or num_tokens.dtype == torch.bool:
            raise ValueError(f"num_tokens: expected a number or a 1-element real tensor, got shape "
                             f"{_shape(num_tokens)} and dtype {num_tokens.dtype}")
        n = num_tokens.reshape(()).to(device=local.device, dtype=torch.float32)
    else:
        n = torch.tensor(_number("num_tokens", num_tokens, ge=0), dtype=torch.float32, device=local.device)
    if checks is None:
        return n.clamp_min(1.0)
    checks.append((local > n, lambda: f"num_tokens: expected the global real-token count, which is >= the local count "
                                      f"{int(local.item())}, got {n.item():g}"))
    return n.clamp_min(1.0)


def _f32(x: Union[float, torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float32, device=device)
