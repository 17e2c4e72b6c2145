"""Forward and backward of cpattn.attention and the raw ops against the float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

import cpattn

from conftest import (
    Window,
    assert_close_baseline,
    assert_close_fp32,
    assert_close_low_out,
    assert_close_rounded,
    make_qkv,
    op_options,
    randn,
    reference_attention,
    reference_with_grads,
    visible_mask,
)

ops = torch.ops.cpattn

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
Shape = tuple[int, int, int, int, int, int]
SHAPES: list[Shape] = [
    (1, 1, 1, 1, 1, 64),  # a single token
    (2, 7, 7, 2, 2, 32),  # batch > 1, odd length
    (1, 63, 65, 3, 3, 64),  # Sq < Sk, both odd, around the 64-query block
    (1, 65, 63, 2, 1, 96),  # Sq > Sk, MQA
    (1, 129, 200, 4, 2, 80),  # GQA, several key blocks
    (1, 200, 129, 4, 2, 128),  # Sq > Sk, several query blocks
    (1, 1, 300, 4, 1, 72),  # decode: one query sees every key (odd head dim)
    (2, 64, 128, 2, 2, 256),  # exact blocks, largest head dim
    (1, 300, 300, 2, 1, 40),  # odd head dim, MQA
    (3, 17, 5, 6, 2, 16),  # Sq >> Sk: many empty rows under causal
]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]

# name -> (causal, window)
MASKS: dict[str, tuple[bool, Window]] = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "left": (False, (16, -1)),
    "right": (False, (-1, 9)),
    "both": (False, (20, 5)),
    "zero": (False, (0, 0)),
    "causal_left": (True, (33, -1)),
}

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_public(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    window: Window,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """cpattn.attention forward (out, lse) and the gradients of q, k, v for dout."""
    out, lse = cpattn.attention(
        q, k, v, causal=causal, window=window, softmax_scale=scale, return_lse=True
    )
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


def check_against_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                            causal: bool, window: Window, scale: float | None = None) -> None:
    """Runs the public API and compares out, lse and gradients with the float64 reference."""
    dtype = q.dtype
    out, lse, (dq, dk, dv) = run_public(q, k, v, dout, causal, window, scale)
    ref = reference_with_grads(q, k, v, dout, causal=causal, window=window, scale=scale)
    r_out, r_lse, r_dq, r_dk, r_dv = ref

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_fp32(lse, r_lse, "lse")  # fp32 from exactly upcast inputs, in every dtype
    if dtype == torch.float32:
        assert_close_fp32(out, r_out, "out")
        for name, got, want in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
            assert_close_fp32(got, want, name)
    else:
        base = reference_with_grads(
            q, k, v, dout, compute_dtype=dtype, causal=causal, window=window, scale=scale
        )
        assert_close_low_out(out, r_out, base[0], dtype)
        for name, got, want, low in (
            ("dq", dq, r_dq, base[2]),
            ("dk", dk, r_dk, base[3]),
            ("dv", dv, r_dv, base[4]),
        ):
            assert got.dtype == dtype
            assert_close_baseline(got, want, low, name)


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fp32_shapes_and_masks(shape: Shape, mask: str, gen: torch.Generator) -> None:
    """fp32 forward and backward over shapes (Sq != Sk both ways, GQA/MQA, odd sizes) x masks."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, *shape, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, window)


LOW_SHAPES: list[Shape] = [SHAPES[2], SHAPES[4], SHAPES[6], SHAPES[9]]


@pytest.mark.parametrize("mask", ["full", "causal", "both"])
@pytest.mark.parametrize("shape", LOW_SHAPES, ids=["x".join(map(str, s)) for s in LOW_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision(dtype: torch.dtype, shape: Shape, mask: str, gen: torch.Generator) -> None:
    """bf16/fp16: out within twice its rounding, gradients within 2x torch's own error."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, *shape, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, causal, window)


@pytest.mark.parametrize("head_dim", [1, 8, 32, 40, 64, 72, 80, 96, 128, 160, 200, 256])
def test_head_dims(head_dim: int, gen: torch.Generator) -> None:
    """Any head_dim up to 256 works (the kernel pads to a multiple of 16 internally)."""
    q, k, v = make_qkv(gen, 1, 33, 70, 2, 1, head_dim, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal=True, window=(-1, -1))


@pytest.mark.parametrize("head_dim", [1, 8, 33, 40, 130, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_head_dims(dtype: torch.dtype, head_dim: int, gen: torch.Generator) -> None:
    """bf16/fp16 with odd and padded head dims (the bf16 kernel packs d pairs itself)."""
    q, k, v = make_qkv(gen, 1, 33, 70, 2, 1, head_dim, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, causal=True, window=(-1, -1))


@pytest.mark.parametrize("scale", [0.05, 0.37, 1.0, 2.5])
@pytest.mark.parametrize("mask", ["full", "causal", "both"])
def test_softmax_scale(scale: float, mask: str, gen: torch.Generator) -> None:
    """A non-default softmax_scale is applied in the forward and in every gradient."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, 2, 45, 80, 2, 2, 64, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, window, scale=scale)


def test_default_scale_is_inverse_sqrt_head_dim(gen: torch.Generator) -> None:
    """softmax_scale=None means 1 / sqrt(head_dim)."""
    q, k, v = make_qkv(gen, 1, 20, 30, 2, 2, 48)
    out_default = cpattn.attention(q, k, v)
    out_explicit = cpattn.attention(q, k, v, softmax_scale=1 / math.sqrt(48))
    assert torch.equal(out_default, out_explicit)
    out_other = cpattn.attention(q, k, v, softmax_scale=0.5)
    assert not torch.allclose(out_default, out_other)


@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_are_stable(causal: bool, gen: torch.Generator) -> None:
    """Scores in the hundreds (peaked softmax): no overflow, still fp32-accurate."""
    q, k, v = make_qkv(gen, 1, 70, 150, 2, 2, 64)
    q = (q * 12).requires_grad_(True)
    k = (k * 12).requires_grad_(True)
    v.requires_grad_(True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, (-1, -1))


@pytest.mark.parametrize(
    "causal, window", [(True, (100, -1)), (False, (37, 150)), (True, (-1, -1))]
)
def test_long_sequence(causal: bool, window: Window, gen: torch.Generator) -> None:
    """A longer sequence: key/query blocks skipped, masked and full in one call."""
    q, k, v = make_qkv(gen, 1, 520, 700, 2, 1, 64, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (300, -1))]
)
def test_query_block_groups(
    dtype: torch.dtype, causal: bool, window: Window, gen: torch.Generator
) -> None:
    """K/V of a head past 1 MiB: the forward takes several query blocks through one pass over
    the keys (a partial last group here: 2100 queries are 33 blocks); with windows, blocks of a
    group see different key ranges."""
    q, k, v = make_qkv(gen, 1, 2100, 2100, 2, 1, 128, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, causal, window)


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
    two calls sum in the same order)."""
    b, sq, sk, h, hkv, d, causal, (wl, wr) = case
    q, k, v = make_qkv(gen, b, sq, sk, h, hkv, d, dtype=torch.bfloat16)
    dout = randn(q.shape, gen, torch.bfloat16)
    scale, q_off = d**-0.5, sk - sq
    opts = op_options(scale, causal, (wl, wr))
    out, lse = ops.attention_fwd(q, k, v, q_off, 0, **opts)
    split = ops.attention_bwd(dout, q, k, v, out, lse, q_off, 0, **opts)
    wide = ops.attention_bwd(dout, q, k, v, out, lse, q_off, 0, torch.float32, **opts)
    for name, got, want in zip(("dq", "dk", "dv"), split, wide):
        assert got.dtype == torch.bfloat16 and want.dtype == torch.float32
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
