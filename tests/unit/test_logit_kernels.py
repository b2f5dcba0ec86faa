"""Unit tests for rlhf_engine.logit_kernels internals: what the chunking promises about memory (no full copy of the
logits, no full fp32 tensor saved for the backward) and the default chunk size. The numbers themselves are tested
through the public entry points in test_ppo_math.py."""
import math

import pytest
import torch

from rlhf_engine import logit_kernels as lk


def test_row_blocks_are_views_in_row_order_for_a_non_contiguous_slice():
    full = torch.arange(3 * 6 * 11, dtype=torch.float32).reshape(3, 6, 11)
    logits = full[:, :-1]  # not viewable as [15, 11]
    blocks = lk._row_blocks(logits)
    assert len(blocks) == 3  # fell back to one view per batch row (negative control: a contiguous input gives 1)
    assert all(b.data_ptr() >= full.data_ptr() and b._base is not None for b in blocks)  # views, no copy
    torch.testing.assert_close(torch.cat(blocks), logits.reshape(-1, 11), atol=0.0, rtol=0.0)
    assert len(lk._row_blocks(full)) == 1


def test_chunks_cover_every_row_once_with_block_offsets():
    blocks = [torch.zeros(5, 2), torch.zeros(3, 2)]
    got = [(off, c.shape[0]) for off, c in lk._chunks(blocks, 2)]
    assert got == [(0, 2), (2, 2), (4, 1), (5, 2), (7, 1)]


def test_default_chunk_rows_reads_the_module_constant_at_call_time(monkeypatch):
    assert lk.default_chunk_rows(1000) == (1 << 26) // 1000
    monkeypatch.setattr(lk, "LOGITS_CHUNK_NUMEL", 21)
    assert lk.default_chunk_rows(7) == 3
    assert lk.default_chunk_rows(100) == 1  # never 0 rows, even when one row exceeds the bound


def test_backward_saves_no_full_fp32_copy_of_the_logits():
    """Saved for backward: the bf16 logits, the labels and [N] fp32 statistics only. Negative control: plain autograd
    through an fp32 log_softmax saves an fp32 [N, V] tensor, which the same hook sees."""
    n, v = 6, 50
    logits = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, v, (n,))

    def big_fp32_saved(fn):
        seen = []

        def pack(t):
            seen.append((t.dtype, t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return [s for s in seen if s[0] == torch.float32 and s[1] >= n * v], seen

    big, seen = big_fp32_saved(lambda: lk.chunked_logprobs(logits, labels, 0.7, 2))
    assert not big and seen, seen
    big, seen = big_fp32_saved(lambda: lk.chunked_entropy(logits, 0.7, 2))
    assert not big and seen, seen
    big, _ = big_fp32_saved(lambda: torch.log_softmax(logits.float() / 0.7, -1).gather(-1, labels[:, None]))
    assert big  # the counter does see a full fp32 copy where one is saved


def test_no_grad_path_and_grad_path_agree():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 9)
    labels = torch.randint(0, 9, (8,))
    plain = lk.chunked_logprobs(logits, labels, 1.3, 3)
    graded = lk.chunked_logprobs(logits.clone().requires_grad_(), labels, 1.3, 3)
    assert graded.requires_grad and not plain.requires_grad
    torch.testing.assert_close(graded.detach(), plain, atol=0.0, rtol=0.0)
    ent_plain = lk.chunked_entropy(logits, 1.3, 3)
    ent_graded = lk.chunked_entropy(logits.clone().requires_grad_(), 1.3, 3)
    assert ent_plain.shape == (8,)
    torch.testing.assert_close(ent_graded.detach(), ent_plain, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("dtype, temperature, chunk_rows", [(torch.float32, 1.0, 3), (torch.bfloat16, 0.7, 5),
                                                            (torch.float32, 1.3, None)])
def test_fused_logprobs_and_entropy_equal_the_separate_kernels_bitwise(dtype, temperature, chunk_rows):
    from rlhf_engine.ppo_math import entropy_from_logits, logprobs_and_entropy_from_logits, logprobs_from_logits

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 7, 50, generator=g) * 4).to(dtype)[:, 1:]  # a non-contiguous slice, as in the engine
    logits[0, 0, :10] = -math.inf  # masked stop tokens: 0 * log 0 counts 0
    labels = torch.randint(10, 50, (2, 6), generator=g)
    with torch.no_grad():
        lp, ent = logprobs_and_entropy_from_logits(logits, labels, temperature, chunk_rows)
        assert torch.equal(lp, logprobs_from_logits(logits, labels, temperature, chunk_rows))
        assert torch.equal(ent, entropy_from_logits(logits, temperature, chunk_rows))
    # by hand for one row: log softmax and its entropy in float64
    x = logits[1, 2].double() / temperature
    ref = torch.log_softmax(x, -1)
    assert abs(lp[1, 2].item() - ref[labels[1, 2]].item()) < 1e-5
    assert abs(ent[1, 2].item() + (ref.exp() * ref).sum().item()) < 1e-4
    # with grad (an on-policy training forward): the same numbers, the log-probs' gradient that of the separate
    # kernel, the entropy a metric without one
    x32 = logits.float().requires_grad_()
    lp_g, ent_g = logprobs_and_entropy_from_logits(x32, labels, temperature, chunk_rows)
    assert lp_g.requires_grad and not ent_g.requires_grad
    assert torch.equal(lp_g.detach(), logprobs_from_logits(logits.float(), labels, temperature, chunk_rows))
    assert torch.equal(ent_g, entropy_from_logits(logits.float(), temperature, chunk_rows))
    w = torch.randn(lp_g.shape, generator=g)
    (grad,) = torch.autograd.grad((lp_g * w).sum(), x32)
    x_ref = logits.float().requires_grad_()
    (grad_ref,) = torch.autograd.grad((logprobs_from_logits(x_ref, labels, temperature, chunk_rows) * w).sum(), x_ref)
    assert torch.equal(grad, grad_ref) and grad.abs().sum() > 0
