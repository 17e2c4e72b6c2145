"""The raw ops with arbitrary global offsets (what a ring step or a zigzag chunk calls), rows that
see no key, and the output and gradient dtypes, against the float64 reference."""

from __future__ import annotations

import pytest
import torch

import cpattn

from attention_checks import FLOAT_DTYPES, MASKS, check_against_reference, run_public
from conftest import (
    Window,
    assert_close_baseline,
    assert_close_fp32,
    assert_close_rounded,
    make_qkv,
    op_options,
    randn,
    reference_with_grads,
    visible_mask,
)

ops = torch.ops.cpattn


# ---------------------------------------------------------------------------------------------
# Raw ops with arbitrary global offsets (what a ring step or a zigzag chunk calls)

# (seqlen_q, seqlen_k, q_offset, k_offset, causal, window)
OffsetCase = tuple[int, int, int, int, bool, Window]
OFFSET_CASES: list[OffsetCase] = [
    (128, 256, 256, 0, True, (-1, -1)),  # ring step: every key in the past, all visible
    (100, 130, 0, 256, True, (-1, -1)),  # keys in the future: every row empty
    (64, 100, 100, 130, True, (-1, -1)),  # keys overlap the end: first rows empty
    (96, 256, 256, 0, True, (200, -1)),  # ring step with a window: some keys too old
    (70, 90, 0, 64, False, (-1, 10)),  # right window reaching forward: early rows empty
    (33, 47, -5, 3, False, (2, 2)),  # negative offset, narrow window
    (50, 60, 1000, 0, False, (50, 50)),  # window far from the keys: every row empty
    (80, 80, 37, 37, True, (0, 0)),  # the diagonal only
    (65, 129, 7, 0, False, (-1, -1)),  # no mask: offsets must not matter
]


def offset_id(c: OffsetCase) -> str:
    sq, sk, qo, ko, causal, (wl, wr) = c
    return f"q{sq}@{qo}-k{sk}@{ko}-{'c' if causal else 'n'}-w{wl},{wr}"


@pytest.mark.parametrize("case", OFFSET_CASES, ids=[offset_id(c) for c in OFFSET_CASES])
def test_raw_ops_with_offsets(case: OffsetCase, gen: torch.Generator) -> None:
    """attention_fwd / attention_bwd with explicit q_offset, k_offset vs the reference."""
    sq, sk, q_off, k_off, causal, (wl, wr) = case
    q, k, v = make_qkv(gen, 2, sq, sk, 4, 2, 64)
    dout = randn(q.shape, gen)
    scale = 0.125
    out, lse = ops.attention_fwd(q, k, v, q_off, k_off, **op_options(scale, causal, (wl, wr)))
    dq, dk, dv = ops.attention_bwd(dout, q, k, v, out, lse, q_off, k_off,
                                   **op_options(scale, causal, (wl, wr)))
    ref = reference_with_grads(
        q, k, v, dout, causal=causal, window=(wl, wr), scale=scale, q_offset=q_off, k_offset=k_off
    )
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), ref):
        assert_close_fp32(got, want, name)

    # Rows that see no key and keys that no row sees: exactly zero, LSE exactly -inf.
    vis = visible_mask(sq, sk, causal, (wl, wr), q_off, k_off)
    empty_rows, unseen_keys = ~vis.any(1), ~vis.any(0)
    assert torch.all(out[:, empty_rows] == 0)
    assert torch.all(lse[..., empty_rows] == float("-inf"))
    assert torch.all(dq[:, empty_rows] == 0)
    assert torch.all(dk[:, unseen_keys] == 0) and torch.all(dv[:, unseen_keys] == 0)


def test_raw_op_all_rows_empty(gen: torch.Generator) -> None:
    """Causal with every key after every query: out 0, lse -inf, all gradients 0, no NaN."""
    q, k, v = make_qkv(gen, 1, 40, 50, 2, 2, 32)
    out, lse = ops.attention_fwd(q, k, v, 0, 40, **op_options(0.2, True))
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.all(torch.isneginf(lse))
    dout = randn(q.shape, gen)
    for g in ops.attention_bwd(dout, q, k, v, out, lse, 0, 40, **op_options(0.2, True)):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("mask", ["causal", "zero", "right"])
def test_public_api_empty_rows(mask: str, gen: torch.Generator) -> None:
    """Sq > Sk bottom-right aligned: the first queries sit before key 0 and may see nothing."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, 2, 30, 6, 2, 1, 32, requires_grad=True)
    dout = randn(q.shape, gen)
    out, lse, (dq, dk, dv) = run_public(q, k, v, dout, causal, window)
    empty = ~visible_mask(30, 6, causal, window, 6 - 30, 0).any(1)
    assert empty.any()
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    assert torch.all(torch.isneginf(lse[..., empty]))
    for g in (out, dq, dk, dv):
        assert torch.isfinite(g).all()
    assert torch.equal(dq[:, empty], torch.zeros_like(dq[:, empty]))
    check_against_reference(q, k, v, dout, causal, window)


@pytest.mark.parametrize(
    "in_dtype, out_dtype",
    [
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.bfloat16),
    ],
)
def test_out_and_grad_dtype(
    in_dtype: torch.dtype, out_dtype: torch.dtype, gen: torch.Generator
) -> None:
    """out_dtype / grad_dtype choose the result dtype; fp32 results skip the final rounding."""
    causal, (wl, wr) = True, (40, -1)
    q, k, v = make_qkv(gen, 1, 90, 110, 4, 2, 64, dtype=in_dtype)
    dout = randn(q.shape, gen, in_dtype)
    scale = 1 / 8
    q_off = 110 - 90
    out, lse = ops.attention_fwd(q, k, v, q_off, 0, out_dtype,
                                 **op_options(scale, causal, (wl, wr)))
    assert out.dtype == out_dtype and lse.dtype == torch.float32
    dq, dk, dv = ops.attention_bwd(
        dout, q, k, v, out, lse, q_off, 0, out_dtype, **op_options(scale, causal, (wl, wr))
    )
    assert dq.dtype == dk.dtype == dv.dtype == out_dtype
    r_out, r_lse, r_dq, r_dk, r_dv = reference_with_grads(
        q, k, v, dout, causal=causal, window=(wl, wr), scale=scale
    )
    assert_close_fp32(lse, r_lse, "lse")
    if in_dtype == torch.bfloat16:
        # bf16 dot products (probabilities rounded to bf16): torch's own bf16 error is the bound
        # even for an fp32 out, for out and (through delta = rowsum(dout * out)) the gradients.
        base = reference_with_grads(
            q, k, v, dout, compute_dtype=in_dtype, causal=causal, window=(wl, wr), scale=scale
        )
        for name, got, want, low in zip(
            ("out", "dq", "dk", "dv"),
            (out, dq, dk, dv),
            (r_out, r_dq, r_dk, r_dv),
            (base[0], *base[2:]),
        ):
            assert_close_baseline(got, want, low, name)
    elif out_dtype == torch.float32:
        # From exactly upcast fp16 inputs and an fp32 out, fp32 accuracy throughout.
        for name, got, want in zip(
            ("out", "dq", "dk", "dv"), (out, dq, dk, dv), (r_out, r_dq, r_dk, r_dv)
        ):
            assert_close_fp32(got, want, name)
    else:
        assert_close_rounded(out, r_out, out_dtype, "out")

    # Default: the inputs' dtype.
    out_d, _ = ops.attention_fwd(q, k, v, q_off, 0, **op_options(scale, causal, (wl, wr)))
    assert out_d.dtype == in_dtype
    grads = ops.attention_bwd(dout, q, k, v, out, lse, q_off, 0,
                              **op_options(scale, causal, (wl, wr)))
    assert all(g.dtype == in_dtype for g in grads)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_nan_input_propagates(dtype: torch.dtype, gen: torch.Generator) -> None:
    """A NaN in a query row makes that row's output NaN (as in torch), not a silently empty row
    (0, lse -inf); the other rows are unaffected."""
    q, k, v = make_qkv(gen, 1, 40, 40, 2, 2, 64, dtype=dtype)
    q[0, 7, 1, 3] = float("nan")
    out, lse = ops.attention_fwd(q, k, v, 0, 0, **op_options(1 / 8, True))
    assert torch.isnan(out[0, 7, 1]).all() and torch.isnan(lse[0, 1, 7])
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[0, 7, 1] = False
    assert torch.isfinite(out[mask]).all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("v_scale", [1.0, 3e4, 1e5, 1e-6, 3e-8], ids=lambda s: f"v{s:g}")
def test_low_output_is_rounded_fp32(
    out_dtype: torch.dtype, v_scale: float, gen: torch.Generator
) -> None:
    """The kernel rounds its fp32 result to bf16/fp16 itself, to nearest even: bitwise what
    torch's conversion of the fp32 output gives, also where fp16 overflows to inf (|v| > 65504)
    and in its subnormal range (|v| < 2^-14)."""
    q, k, v = make_qkv(gen, 1, 70, 90, 2, 1, 72)
    v = v * v_scale
    opts = op_options(1 / 8, True)
    out_low, _ = ops.attention_fwd(q, k, v, 0, 0, out_dtype, **opts)
    out_fp32, lse = ops.attention_fwd(q, k, v, 0, 0, None, **opts)
    assert torch.equal(out_low, out_fp32.to(out_dtype))
    dout = randn(q.shape, gen) * v_scale
    grads_low = ops.attention_bwd(dout, q, k, v, out_fp32, lse, 0, 0, out_dtype, **opts)
    grads_fp32 = ops.attention_bwd(dout, q, k, v, out_fp32, lse, 0, 0, None, **opts)
    for got, want in zip(grads_low, grads_fp32):
        assert torch.equal(got, want.to(out_dtype))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["fp32", "bf16", "fp16"])
def test_output_dtype_and_shape(dtype: torch.dtype, gen: torch.Generator) -> None:
    """out has q's dtype and shape; lse is float32 (B, H, Sq); gradients match their inputs."""
    q, k, v = make_qkv(gen, 2, 11, 13, 6, 3, 24, dtype=dtype, requires_grad=True)
    out = cpattn.attention(q, k, v)
    assert isinstance(out, torch.Tensor)
    assert out.dtype == dtype and out.shape == q.shape and out.device == q.device
    out2, lse = cpattn.attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2)
    assert lse.dtype == torch.float32 and lse.shape == (2, 6, 11)
    out.backward(randn(out.shape, gen, dtype))
    for t in (q, k, v):
        assert t.grad is not None and t.grad.dtype == dtype and t.grad.shape == t.shape
