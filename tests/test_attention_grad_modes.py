"""cpattn.attention with strided inputs, in every grad mode, and its determinism across runs and
thread counts, against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import cpattn

from attention_checks import FLOAT_DTYPES, check_against_reference, run_public
from conftest import assert_close_fp32, make_qkv, op_options, randn, reference_with_grads
from reference import reference_attention

ops = torch.ops.cpattn


# ---------------------------------------------------------------------------------------------
# Strides, grad modes, determinism


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 33])
def test_non_contiguous_inputs(dtype: torch.dtype, d: int, gen: torch.Generator) -> None:
    """Transposed, strided, sliced and expanded inputs (last dim contiguous) give the right
    answer, and so does a non-contiguous upstream gradient (bf16 reads q and dout in place)."""
    b, sq, sk, h, hkv = 2, 37, 70, 4, 2
    q = randn((b, h, sq, d), gen, dtype).transpose(1, 2)  # from (B, H, S, D)
    k = randn((b, 2 * sk, hkv, d), gen, dtype)[:, ::2]  # every other token
    # sliced, batch stride 0
    v = randn((1, sk, hkv, 2 * d), gen, dtype)[..., d:].expand(b, -1, -1, -1)
    for t in (q, k, v):
        assert not t.is_contiguous() and t.stride(-1) == 1
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    dout = randn((b, h, sq, d), gen, dtype).transpose(1, 2)
    check_against_reference(q, k, v, dout, True, (30, -1))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_non_contiguous_matches_contiguous(dtype: torch.dtype, gen: torch.Generator) -> None:
    """Bitwise: the kernel's results do not depend on the input strides."""
    q = randn((1, 3, 50, 32), gen, dtype).transpose(1, 2).requires_grad_(True)
    k = randn((1, 3, 60, 32), gen, dtype).transpose(1, 2).requires_grad_(True)
    v = randn((1, 60, 3, 64), gen, dtype)[..., :32].requires_grad_(True)
    dout = randn((1, 3, 50, 32), gen, dtype).transpose(1, 2)
    a = cpattn.attention(q, k, v, causal=True)
    grads_a = torch.autograd.grad(a, (q, k, v), dout)
    qc, kc, vc = (t.detach().contiguous().requires_grad_(True) for t in (q, k, v))
    c = cpattn.attention(qc, kc, vc, causal=True)
    grads_c = torch.autograd.grad(c, (qc, kc, vc), dout.contiguous())
    assert torch.equal(a, c)
    for got, want in zip(grads_a, grads_c):
        assert torch.equal(got, want)


SPLIT_SUM_CASES = [  # (batch, Sq, Sk, heads, kv heads, D, causal, window)
    (1, 700, 700, 4, 2, 64, True, (-1, -1)),  # several query chunks: sums carried across them
    (2, 300, 333, 2, 1, 128, False, (50, 20)),  # batch 2, odd key count, a band
    (1, 70, 20, 3, 3, 32, True, (-1, -1)),  # empty rows
]


@pytest.mark.parametrize("case", SPLIT_SUM_CASES, ids=["chunks", "batch2_band", "empty_rows"])
def test_bf16_gradient_sums_in_split_halves(
    one_kv_head_per_backward_call, case: tuple, gen: torch.Generator
) -> None:
    """Bitwise: bf16 dK / dV are summed as fp32 values split in two halves (the high ones in the
    gradient itself, the low ones beside it) and rounded once at the end: the same bits as
    summing in fp32 gradients and rounding those (one KV head per kernel call in both, so the
    two calls sum in the same order). dQ likewise where both calls group the KV heads alike:
    the brgemm path packs nothing for fp32 gradients, so it takes every head in one call there,
    whose key splits sum dQ in another order (then within one bf16 rounding)."""
    b, sq, sk, h, hkv, d, causal, (wl, wr) = case
    q, k, v = make_qkv(gen, b, sq, sk, h, hkv, d, dtype=torch.bfloat16)
    dout = randn(q.shape, gen, torch.bfloat16)
    scale, q_off = d**-0.5, sk - sq
    opts = op_options(scale, causal, (wl, wr))
    out, lse = ops.attention_fwd(q, k, v, q_off, 0, **opts)
    split = ops.attention_bwd(dout, q, k, v, out, lse, q_off, 0, **opts)
    wide = ops.attention_bwd(dout, q, k, v, out, lse, q_off, 0, torch.float32, **opts)
    grouping = [ops.cpu_backward_sizes(b, sq, sk, h, hkv, d, torch.bfloat16, grad)
                for grad in (torch.bfloat16, torch.float32)]
    for name, got, want in zip(("dq", "dk", "dv"), split, wide):
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
        if name == "dq" and grouping[0] != grouping[1]:
            ulp = 2.0 ** (torch.frexp(want.abs())[1] - 8)  # bf16's spacing at each value
            assert ((got.float() - want).abs() <= ulp).all(), name
            continue
        assert torch.equal(got, want.to(torch.bfloat16)), name
    assert split[1].abs().sum() > 0 and split[2].abs().sum() > 0


def test_inputs_without_grad(gen: torch.Generator) -> None:
    """No input requires grad: a plain tensor comes back; under no_grad likewise."""
    q, k, v = make_qkv(gen, 1, 20, 25, 2, 1, 32)
    out = cpattn.attention(q, k, v, causal=True)
    assert not out.requires_grad
    ref, _ = reference_attention(q, k, v, causal=True)
    assert_close_fp32(out, ref, "out")

    q.requires_grad_(True)
    with torch.no_grad():
        out_ng = cpattn.attention(q, k, v, causal=True)
    assert not out_ng.requires_grad
    assert torch.equal(out_ng, out)


@pytest.mark.parametrize("which", [0, 1, 2])
def test_only_some_inputs_require_grad(which: int, gen: torch.Generator) -> None:
    """Only one of q, k, v requires grad: it gets the right gradient, the others none."""
    q, k, v = make_qkv(gen, 1, 30, 40, 4, 2, 32)
    inputs = [q, k, v]
    inputs[which].requires_grad_(True)
    dout = randn(q.shape, gen)
    out = cpattn.attention(*inputs, causal=True)
    out.backward(dout)
    ref = reference_with_grads(q, k, v, dout, causal=True)
    assert_close_fp32(inputs[which].grad, ref[2 + which], "grad")
    for i, t in enumerate(inputs):
        if i != which:
            assert t.grad is None


def test_backward_through_sum(gen: torch.Generator) -> None:
    """out.sum().backward() hands the op an expanded (stride 0) gradient."""
    q, k, v = make_qkv(gen, 1, 21, 21, 2, 2, 32, requires_grad=True)
    cpattn.attention(q, k, v, causal=True).sum().backward()
    ref = reference_with_grads(q, k, v, torch.ones(q.shape), causal=True)
    for name, t, want in zip("qkv", (q, k, v), ref[2:]):
        assert_close_fp32(t.grad, want, "d" + name)


def test_deterministic_and_thread_independent(gen: torch.Generator) -> None:
    """Repeated calls, and calls with 1 thread instead of several, agree bitwise."""
    q, k, v = make_qkv(gen, 2, 150, 260, 4, 2, 64, requires_grad=True)
    dout = randn(q.shape, gen)

    def run() -> list[torch.Tensor]:
        out, lse, grads = run_public(q, k, v, dout, True, (-1, -1))
        return [out, lse, *grads]

    first = run()
    second = run()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    for a, b, c in zip(first, second, single):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize(
    "dtype, head_dim", [(torch.float32, 64), (torch.float32, 40), (torch.bfloat16, 64)],
    ids=["fp32-in-place", "fp32-padded", "bf16"],
)
def test_chunked_backward_thread_independent(
    dtype: torch.dtype, head_dim: int, gen: torch.Generator
) -> None:
    """The backward over three query chunks (512 rows at this shape) with the key blocks of the
    one (batch, kv head) pair split 8 ways, dK / dV summed in the fp32 outputs themselves (D a
    multiple of 16) or in a buffer of their own (padded D, bf16): close to the float64 reference,
    and the same bits with 1, 2 and 3 threads."""
    q, k, v = make_qkv(gen, 1, 1100, 1100, 2, 1, head_dim, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, True, (-1, -1))
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(run_public(q, k, v, dout, True, (-1, -1))[2])
    finally:
        torch.set_num_threads(threads)
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert torch.equal(a, b)
