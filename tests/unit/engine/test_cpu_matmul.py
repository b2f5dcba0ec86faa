"""bf16 Linear layers through the fp32 kernel (engine/cpu_matmul.py): which machines get it, that the layer computes
x @ W.T + b with its gradients as the fp32 arithmetic does (up to one bf16 rounding), that it keeps only bf16 tensors
for backward, that decode-sized forwards keep the bf16 kernel, and that a whole tiny model (Linear and GPT-2 Conv1D,
a LoRA adapter's layers too) keeps its weights and state dict."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlhf_engine.engine.cpu_matmul import (SMALL_WEIGHT, Fp32KernelLinear, fp32_kernel_layers, resolve_mode,
                                          widened_linear)

AVX2 = {"sse2", "avx2", "fma"}


@pytest.mark.parametrize("setting, dtype, cuda, flags, expect", [
    ("auto", "bf16", False, AVX2, "fp32"),                       # the case it exists for
    ("auto", "bf16", False, AVX2 | {"avx512f"}, "fp32"),         # AVX-512 without its bf16 extension
    ("auto", "bf16", False, AVX2 | {"avx512_bf16"}, "native"),   # bf16 instructions: PyTorch's kernels are fast
    ("auto", "bf16", False, {"amx_bf16"}, "native"),
    ("auto", "bf16", False, None, "native"),                     # flags unreadable (not Linux): nothing changes
    ("auto", "bf16", True, AVX2, "native"),                      # a GPU run
    ("auto", "fp32", False, AVX2, "native"),
    ("auto", "fp16", False, AVX2, "native"),
    ("fp32", "bf16", False, AVX2 | {"avx512_bf16"}, "fp32"),     # asked for: given where bf16 runs on a CPU
    ("fp32", "bf16", True, AVX2, "native"),
    ("native", "bf16", False, AVX2, "native"),
])
def test_the_mode_by_machine(setting, dtype, cuda, flags, expect):
    assert resolve_mode(setting, dtype, cuda, flags) == expect


def _fp32_reference(x, w, b, g):
    """Output and gradients of the same layer computed in fp32 from the same (bf16-valued) tensors."""
    x32, w32, b32 = (t.detach().float().requires_grad_() for t in (x, w, b))
    y = F.linear(x32, w32, b32)
    y.backward(g.float())
    return y, x32.grad, w32.grad, b32.grad


def test_the_layer_is_the_fp32_arithmetic_rounded_once():
    torch.manual_seed(0)
    x = torch.randn(3, 40, 64).bfloat16().requires_grad_()   # 120 rows: the widened path
    w = (torch.randn(96, 64) / 8).bfloat16().requires_grad_()
    b = torch.randn(96).bfloat16().requires_grad_()
    g = torch.randn(3, 40, 96).bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        y = widened_linear(x, w, b)
    assert y.dtype == torch.bfloat16 and y.grad_fn.name().startswith("_WidenedLinear")
    assert saved and set(saved) == {torch.bfloat16}  # nothing fp32 is kept for backward: a bf16 run's memory
    y.backward(g)
    ref_y, ref_gx, ref_gw, ref_gb = _fp32_reference(x, w, b, g)
    # the forward is the fp32 product rounded to bf16 once: equal to that rounding up to fp32 summation order
    torch.testing.assert_close(y.float(), ref_y.detach().bfloat16().float(), rtol=2 ** -7, atol=1e-6)
    for got, ref in ((x.grad, ref_gx), (w.grad, ref_gw), (b.grad, ref_gb)):
        assert got.dtype == torch.bfloat16 and got.shape == ref.shape
        torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-3)
    # negative control: the tolerance tells a layout bug (the weight's rows in the wrong order) from a rounding
    assert not torch.allclose(x.grad.float(), g.float() @ w.float().flip(0), rtol=2 ** -7, atol=1e-3)


def test_without_anything_to_differentiate_the_same_numbers_and_no_graph():
    """Generation, the experience forwards and frozen layers skip the autograd Function, not the fp32 kernel: the
    result is bitwise the grad path's (the lr-0 ratio of 1 compares the two)."""
    torch.manual_seed(1)
    x, w, b = torch.randn(2, 30, 64).bfloat16(), (torch.randn(48, 64) / 8).bfloat16(), torch.randn(48).bfloat16()
    graded = widened_linear(x.clone().requires_grad_(), w.clone().requires_grad_(), b)
    assert graded.grad_fn.name().startswith("_WidenedLinear")
    with torch.no_grad():
        plain = widened_linear(x, w, b)
    frozen = widened_linear(x, w, b)  # grad mode on, nothing requires grad
    assert plain.grad_fn is None and frozen.grad_fn is None
    assert torch.equal(plain, graded.detach()) and torch.equal(frozen, plain)
    assert torch.equal(plain, torch.nn.functional.linear(x.float(), w.float(), b.float()).bfloat16())


def test_decode_sized_forwards_keep_the_bf16_kernel():
    """A few rows keep the bf16 kernel: fewer than 4 through a small weight, fewer than 32 through a large one (an
    LM head), where widening the weight costs more than it saves."""
    def widened(rows, weight):
        x = torch.randn(rows, weight.shape[1]).bfloat16().requires_grad_()
        return widened_linear(x, weight, None).grad_fn.name().startswith("_WidenedLinear")

    small = torch.randn(32, 16).bfloat16()
    large = torch.empty(SMALL_WEIGHT // 64 + 1, 64).bfloat16()  # one row over the small size
    assert [widened(r, small) for r in (1, 3, 4, 40)] == [False, False, True, True]
    assert [widened(r, large) for r in (4, 31, 32)] == [False, False, True]
    exactly_small = large[:SMALL_WEIGHT // 64]  # a small weight still: 4 rows suffice
    assert [widened(r, exactly_small) for r in (3, 4)] == [False, True]
    # fp32 tensors are never touched
    fp32 = widened_linear(torch.randn(64, 16, requires_grad=True), small.float(), None)
    assert not fp32.grad_fn.name().startswith("_WidenedLinear")


def test_a_model_keeps_its_weights_and_computes_alike(tiny):
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    native = AutoModelForCausalLM.from_pretrained(tiny.actor, dtype=torch.bfloat16)
    native.eval()
    model = AutoModelForCausalLM.from_pretrained(tiny.actor, dtype=torch.bfloat16)
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_layers = sum(type(m) in (nn.Linear, Conv1D) for m in model.modules())
    assert fp32_kernel_layers(model) == n_layers > 0
    assert not any(type(m) in (nn.Linear, Conv1D) for m in model.modules())  # every layer of both kinds swapped
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    a, b = native(input_ids=ids).logits.float(), model(input_ids=ids).logits.float()
    # the same model in two bf16 kernels: apart by bf16 roundings only
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)
    fp32 = AutoModelForCausalLM.from_pretrained(tiny.actor, dtype=torch.float32).eval()
    ref = fp32(input_ids=ids).logits
    assert (b - ref).abs().max() <= 2 * (a - ref).abs().max() + 1e-3  # no less accurate than the bf16 kernels


def test_lora_adapters_take_the_fp32_kernel_too(tiny):
    from transformers import AutoModelForCausalLM

    from rlhf_engine.config import RoleConfig
    from rlhf_engine.engine.models import add_lora

    model = AutoModelForCausalLM.from_pretrained(tiny.actor, dtype=torch.bfloat16)
    model = add_lora(model, RoleConfig(lora_dim=4))
    fp32_kernel_layers(model)
    adapters = [m for n, m in model.named_modules() if n.endswith(("lora_A.default", "lora_B.default"))]
    assert adapters and all(isinstance(m, Fp32KernelLinear) for m in adapters)
    ids = torch.randint(0, 100, (2, 16))
    model(input_ids=ids).logits.float().sum().backward()
    grads = [p.grad for n, p in model.named_parameters() if p.requires_grad]
    assert grads and all(g is not None and g.dtype == torch.bfloat16 for g in grads)
