"""bf16 linear layers on a CPU without bf16 instructions, through the fp32 kernel.

PyTorch's bf16 matrix products on a CPU that has neither avx512_bf16 nor amx_bf16 take slow generic kernels: on a
2-core AMD EPYC with AVX2 only, a 768x256 by 256x1024 bf16 layer took 51 ms forward and 412 ms for its input
gradient, against 5 ms each through fp32 (docs/configuration.md, "bf16 on a CPU"). `fp32_kernel_layers` turns a
model's Linear (and GPT-2 Conv1D) layers into ones that widen their bf16 operands to fp32 (exact), multiply with the
fp32 kernel (fp32 accumulation, as a bf16 kernel's) and round the product to bf16 once. Weights, activations, saved
tensors and gradients stay bf16: the memory of a bf16 run, the arithmetic of a bf16 kernel that accumulates in fp32,
the speed of fp32.

Widening a weight costs a pass over it, which a forward of a few rows (a decode step) may not earn back: forwards of
fewer than `min_rows(weight)` rows keep the bf16 kernel, 4 for a weight of up to 2M elements (every layer of
SmolLM2-135M but its LM head: widened, a decode step of 4 rows is already 1.6-1.8x faster), 32 above (a 576 x 49152
LM head: 47 ms in bf16 against 105 ms widened at 8 rows, 206 against 150 at 32). The choice depends on the rows and
the weight only: the experience and training forwards of the same rows always take the same kernel.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
SMALL_WEIGHT = 2 ** 21  # elements: widening such a weight (in cache) pays back from 4 rows on; a larger one from 32


def min_rows(weight: torch.Tensor) -> int:
    """Fewest rows for which a forward through `weight` takes the fp32 kernel (see the module's docstring)."""
    return 4 if weight.numel() <= SMALL_WEIGHT else 32


def resolve_mode(setting: str, dtype: str, cuda: bool, cpu_flags: Optional[set]) -> str:
    """What a role's Linear layers do: "fp32" (widened to the fp32 kernel) or "native" (PyTorch's own kernel).

    Only bf16 on a CPU is ever changed. `auto` = fp32 where the CPU's flags are known and hold no bf16 instruction;
    native where they do, or cannot be read (`cpu_flags` None)."""
    if dtype != "bf16" or cuda or setting == "native":
        return "native"
    if setting == "fp32":
        return "fp32"
    return "fp32" if cpu_flags is not None and not cpu_flags & NATIVE_BF16_FLAGS else "native"


def _widened(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """y = x @ w.T + b in fp32, rounded to x's dtype: every forward through the fp32 kernel, with grad or without."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


class _WidenedLinear(torch.autograd.Function):
    """`_widened` with a backward whose products are in fp32 too. Saves the bf16 tensors."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _widened(x, w, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.float().reshape(-1, grad.shape[-1])  # [rows, out]
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ w.float()).to(x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            gw = (g.t() @ x.float().reshape(-1, x.shape[-1])).to(w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0).to(w.dtype)
        return gx, gw, gb


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, weight, bias), for bf16 CPU tensors through the fp32 kernel (a forward of fewer than
    `min_rows(weight)` rows keeps the bf16 kernel); any other tensors go to F.linear unchanged.

    x [..., in], weight [out, in], bias [out] or None -> [..., out] in x's dtype."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return F.linear(x, weight, bias)
    if x.numel() // max(x.shape[-1], 1) < min_rows(weight):
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or
                                    (bias is not None and bias.requires_grad)):
        return _WidenedLinear.apply(x, weight, bias)
    # nothing to differentiate (generation, the experience forwards, frozen layers): the same arithmetic without
    # the autograd Function's call (measured: a fifth of a tiny model's decode step)
    return _widened(x, weight, bias)


class Fp32KernelLinear(nn.Linear):
    """An nn.Linear whose bf16 products run in the fp32 kernel (`widened_linear`). Same parameters, state dict and
    hooks: `fp32_kernel_layers` swaps the class of existing layers."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return widened_linear(x, self.weight, self.bias)


@functools.lru_cache(maxsize=None)  # one class, so that isinstance finds the layers of any model
def _conv1d_class():
    from transformers.pytorch_utils import Conv1D

    class Fp32KernelConv1D(Conv1D):
        """GPT-2's Conv1D (weight stored [in, out]) through `widened_linear`."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return widened_linear(x, self.weight.t(), self.bias)

    return Conv1D, Fp32KernelConv1D


def fp32_kernel_layers(model: nn.Module) -> int:
    """Turn every plain nn.Linear (and transformers' Conv1D) of `model` into its fp32-kernel form, in place; returns
    how many. Subclasses of Linear (e.g. quantized layers) are left alone. Call it after LoRA: peft's layers are no
    Linears themselves, they call their base layer and their adapter's A and B, plain Linears that peft creates."""
    conv1d, conv1d_fp32 = _conv1d_class()
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = Fp32KernelLinear
            n += 1
        elif type(module) is conv1d:
            module.__class__ = conv1d_fp32
            n += 1
    return n


def has_fp32_kernel_layers(model: nn.Module) -> bool:
    """Whether `fp32_kernel_layers` turned layers of `model` (a copy of it must take the same kernels)."""
    kinds = (Fp32KernelLinear, _conv1d_class()[1])
    return any(isinstance(m, kinds) for m in model.modules())
