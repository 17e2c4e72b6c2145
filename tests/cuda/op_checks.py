"""The raw-op checks: global offsets, fp32 out and empty rows, deterministic and dlse backward,
strided views, large scores, argument errors and merge_state_."""

from __future__ import annotations

import math

import torch

import cpattn

import check_harness as harness
from check_harness import (
    GRAD_TOL,
    OUT_TOL,
    check,
    check_close,
    check_lse,
    compare_all,
    gen_for,
    ops,
    out_tol,
    randn,
    reference,
    run_attention,
)


@check("fwd/out_dtype_fp32_raw_op_offsets")
def _raw_offsets():
    """The raw op with global offsets (ring-step cases), fp32 out, empty rows."""
    cases = [  # (sq, sk, q_offset, k_offset, causal, window)
        (128, 256, 256, 0, True, (-1, -1)),
        (100, 130, 0, 256, True, (-1, -1)),
        (64, 100, 100, 130, True, (-1, -1)),
        (96, 256, 256, 0, True, (200, -1)),
        (70, 90, 0, 64, False, (-1, 10)),
        (33, 47, -5, 3, False, (2, 2)),
        (50, 60, 1000, 0, False, (50, 50)),
        (80, 80, 37, 37, True, (0, 0)),
        (300, 700, 1 << 40, (1 << 40) - 500, True, (350, -1)),
    ]
    for sq, sk, qo, ko, causal, window in cases:
        g = gen_for(f"offsets {sq} {sk} {qo} {ko}")
        q, k, v = randn((2, sq, 4, 64), g), randn((2, sk, 2, 64), g), randn((2, sk, 2, 64), g)
        for out_dtype in (torch.float32, torch.bfloat16):
            out, lse = ops.attention_fwd(q, k, v, qo, ko, out_dtype, softmax_scale=0.125,
                                         causal=causal, window_left=window[0],
                                         window_right=window[1])
            assert out.dtype == out_dtype
            r_out, r_lse = reference(q, k, v, causal=causal, window=window, scale=0.125,
                                     q_offset=qo, k_offset=ko)
            empty = torch.isinf(r_lse)  # (B, H, Sq)
            check_close(f"offsets {sq},{sk},{qo},{ko} out", out, r_out.to(harness.DEV),
                        out_tol(q.dtype, out_dtype))
            check_lse(lse, r_lse)
            rows = empty.permute(0, 2, 1)  # (B, Sq, H)
            assert (out[rows.to(harness.DEV)] == 0).all(), "rows that see no key must be exactly 0"
        dout = randn(q.shape, g)
        dq, dk, dv = ops.attention_bwd(dout, q, k, v, out.float(), lse, qo, ko, torch.float32,
                                       None, softmax_scale=0.125, causal=causal,
                                       window_left=window[0], window_right=window[1])
        r = reference(q, k, v, dout, causal=causal, window=window, scale=0.125, q_offset=qo,
                      k_offset=ko)
        for n, x, rr in zip(("dq", "dk", "dv"), (dq, dk, dv), r[2:]):
            check_close(f"offsets {sq},{sk},{qo},{ko} {n}", x, rr.to(harness.DEV),
                        GRAD_TOL[torch.bfloat16])


@check("bwd/deterministic_bitwise")
def _deterministic():
    g = gen_for("deterministic")
    q, k, v = randn((2, 333, 8, 128), g), randn((2, 333, 2, 128), g), randn((2, 333, 2, 128), g)
    dout = randn(q.shape, g)
    opts = dict(softmax_scale=0.09, causal=True)
    out, lse = ops.attention_fwd(q, k, v, 0, 0, None, **opts)
    torch.use_deterministic_algorithms(True)
    try:
        a = ops.attention_bwd(dout, q, k, v, out, lse, 0, 0, None, None, **opts)
        b = ops.attention_bwd(dout, q, k, v, out, lse, 0, 0, None, None, **opts)
    finally:
        torch.use_deterministic_algorithms(False)
    for x, y in zip(a, b):
        assert torch.equal(x, y), "deterministic backward differs between two runs"
    c = ops.attention_bwd(dout, q, k, v, out, lse, 0, 0, None, None, **opts)
    ref = reference(q, k, v, dout, causal=True, scale=0.09)
    for n, x, y, r in zip(("dq", "dk", "dv"), a, c, ref[2:]):
        check_close(f"deterministic {n}", x, r.to(harness.DEV), GRAD_TOL[torch.bfloat16])
        check_close(f"atomic {n}", y, r.to(harness.DEV), GRAD_TOL[torch.bfloat16])


@check("bwd/dlse")
def _dlse():
    g = gen_for("dlse")
    q, k, v = randn((1, 150, 4, 64), g), randn((1, 190, 2, 64), g), randn((1, 190, 2, 64), g)
    dout, dlse = randn(q.shape, g), randn((1, 4, 150), g, torch.float32)
    got = run_attention(q, k, v, dout, True, (-1, -1), dlse=dlse)
    ref = reference(q, k, v, dout, causal=True, dlse=dlse)
    compare_all("dlse", got, ref, torch.bfloat16)


@check("fwd_bwd/strided_views")
def _strided():
    """q, k, v as views of one packed (B, S, 3, H, D) tensor and a sliced sequence."""
    g = gen_for("strided")
    qkv = randn((2, 260, 3, 4, 128), g)
    q, k, v = qkv[:, 3:250, 0], qkv[:, 3:250, 1], qkv[:, 3:250, 2]
    assert not q.is_contiguous()
    dout = randn(q.shape, g)
    got = run_attention(q, k, v, dout, True, (-1, -1))
    ref = reference(q, k, v, dout, causal=True)
    compare_all("strided", got, ref, torch.bfloat16)


@check("fwd/large_scores")
def _large_scores():
    g = gen_for("large")
    q, k, v = randn((1, 200, 2, 64), g), randn((1, 300, 2, 64), g), randn((1, 300, 2, 64), g)
    q, k = (q.float() * 8).bfloat16(), (k.float() * 8).bfloat16()
    dout = randn(q.shape, g)
    got = run_attention(q, k, v, dout, False, (-1, -1))
    ref = reference(q, k, v, dout)
    check_close("large out", got[0], ref[0].to(harness.DEV), OUT_TOL[torch.bfloat16])
    check_lse(got[1], ref[1])
    for n, x, r in zip(("dq", "dk", "dv"), got[2:], ref[2:]):
        check_close(f"large {n}", x, r.to(harness.DEV), 3 * GRAD_TOL[torch.bfloat16])


def _must_raise(fn, needle: str, what: str) -> None:
    """fn() raises a RuntimeError whose message contains needle."""
    try:
        fn()
    except RuntimeError as e:
        assert needle in str(e), str(e)
    else:
        raise AssertionError(f"{what} must raise")


@check("errors/fp32_and_head_dim")
def _errors():
    q = torch.randn(1, 8, 2, 64, device=harness.DEV)
    _must_raise(lambda: cpattn.attention(q, q, q), "bfloat16 or float16", "fp32 CUDA inputs")
    big = torch.randn(1, 8, 2, 512, device=harness.DEV, dtype=torch.bfloat16)
    _must_raise(lambda: cpattn.attention(big, big, big), "head_dim", "head_dim 512")


@check("merge_state/cuda")
def _merge():
    g = gen_for("merge")
    out, part = randn((2, 33, 3, 64), g, torch.float32), randn((2, 33, 3, 64), g, torch.float32)
    lse, plse = randn((2, 3, 33), g, torch.float32), randn((2, 3, 33), g, torch.float32)
    lse[0, 1, :5] = -math.inf
    plse[0, 1, :3] = -math.inf
    out[0, :3, 1] = 0
    ref_lse = torch.logaddexp(lse.double(), plse.double())
    wa = torch.exp(lse.double() - ref_lse).nan_to_num(0.0).permute(0, 2, 1)[..., None]
    wb = torch.exp(plse.double() - ref_lse).nan_to_num(0.0).permute(0, 2, 1)[..., None]
    ref_out = wa * out.double() + wb * part.double()
    o, l_ = out.clone(), lse.clone()
    cpattn.merge_state_(o, l_, part, plse)
    assert not torch.isnan(o).any() and not torch.isnan(l_).any()
    assert (o - ref_out).abs().max().item() < 1e-5
    assert torch.equal(torch.isinf(l_), torch.isinf(ref_lse))
