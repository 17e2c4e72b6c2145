"""CUDA checks of cpattn against the float64 reference, runnable with or without pytest.

    python tests/cuda/checks.py [-k SUBSTRING] [--list]   # plain runner (exit 1 on a failure)
    python -m pytest tests/test_cuda.py                   # the same checks under pytest

Every check draws fresh random inputs (a seed per check), runs with outputs poisoned with NaN
(CPATTN_POISON=1: an unwritten element fails), and compares with float64 math in plain torch
(tests/reference.py). Criteria (the emulated kernel tests' rule, tests/emulate): relative error
||x - ref|| / ||ref|| within the INPUT dtype's band (bf16 1e-2, fp16 2e-3 for outputs, half that
for a float32 output: the kernels round P to the input dtype before P V, as FA2 does, so a float32
output only drops the last rounding; twice the band for gradients), LSE to 2e-3 absolute, exact
zeros / -inf for rows that see no key.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import traceback
import zlib
from typing import Callable

os.environ.setdefault("CPATTN_POISON", "1")  # before cpattn is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cpattn  # noqa: E402
from cpattn._layout import LAYOUTS  # noqa: E402
from cpattn.testing.emulation import load_ops  # noqa: E402

from reference import reference_attention  # noqa: E402

load_ops()  # torch.ops.cpattn_testing: the emulated ring, ring_shift
ops = torch.ops.cpattn
# CPATTN_CHECKS_DEVICE=cpu runs the device-independent checks on the CPU kernels: a test of the
# checks themselves (references, tolerances, sharding) on a machine without a GPU.
DEV = os.environ.get("CPATTN_CHECKS_DEVICE", "cuda")
CUDA_ONLY = ("errors/", "ring_nccl/", "opcheck/")
OUT_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_ATOL = 2e-3


def out_tol(in_dtype: torch.dtype, out_dtype: torch.dtype) -> float:
    """Tolerance of an output computed from `in_dtype` inputs, written in `out_dtype`."""
    tol = OUT_TOL[in_dtype]
    return tol / 2 if out_dtype == torch.float32 and in_dtype != torch.float32 else tol


def cuda_ok() -> bool:
    if DEV == "cpu":
        return True
    return torch.cuda.is_available() and cpattn.build_info()["with_cuda"]


def sync() -> None:
    if DEV != "cpu":
        torch.cuda.synchronize()


def gen_for(name: str) -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.manual_seed(zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return g


def randn(shape, g, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=g, device=DEV, dtype=torch.float32).to(dtype)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def check_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: {int((~torch.isfinite(x)).sum())} non-finite values"
    err = rel_err(x, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def check_lse(lse: torch.Tensor, ref: torch.Tensor) -> None:
    ref = ref.to(lse.device)
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty), "lse: -inf positions differ"
    assert (lse[empty] < 0).all(), "lse: +inf where -inf expected"
    assert not torch.isnan(lse).any(), "lse: NaN"
    if (~empty).any():
        err = (lse[~empty].double() - ref[~empty].double()).abs().max().item()
        assert err <= LSE_ATOL, f"lse: max abs error {err:.3g} > {LSE_ATOL}"


def reference(q, k, v, dout=None, causal=False, window=(-1, -1), scale=None, q_offset=None,
              k_offset=0, dlse=None):
    """float64 reference on the CPU: out, lse and (with dout) dq, dk, dv."""
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(dout is not None) for t in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, causal=causal, window=window, scale=scale,
                                   q_offset=q_offset, k_offset=k_offset)
    if dout is None:
        return out.detach(), lse.detach()
    loss = (out * dout.double().cpu()).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse, torch.zeros_like(lse)) * dlse.double().cpu()).sum()
    dq, dk, dv = torch.autograd.grad(loss, (qr, kr, vr))
    return out.detach(), lse.detach(), dq, dk, dv


def run_attention(q, k, v, dout, causal, window, scale=None, dlse=None):
    """cpattn.attention forward (out, lse) and gradients for dout (and dlse)."""
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = cpattn.attention(qg, kg, vg, causal=causal, window=window, softmax_scale=scale,
                                return_lse=True)
    outputs, grads = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse)
    dq, dk, dv = torch.autograd.grad(outputs, (qg, kg, vg), grads)
    return out.detach(), lse.detach(), dq, dk, dv


def compare_all(name, got, ref, dtype, grads=True):
    out, lse = got[0], got[1]
    check_close(f"{name} out", out, ref[0].to(out.device), out_tol(dtype, out.dtype))
    check_lse(lse, ref[1])
    if grads:
        for n, g, r in zip(("dq", "dk", "dv"), got[2:], ref[2:]):
            assert g.dtype == dtype, f"{name} {n}: dtype {g.dtype} != {dtype}"
            check_close(f"{name} {n}", g, r.to(g.device), GRAD_TOL[dtype])


# ---------------------------------------------------------------------------------------------
# The checks: (name, function) pairs, collected in CHECKS.

CHECKS: list[tuple[str, Callable[[], None]]] = []


def check(name: str):
    def deco(fn):
        CHECKS.append((name, fn))
        return fn

    return deco


MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "left": (False, (37, -1)),
    "both": (False, (70, 9)),
    "causal_left": (True, (129, -1)),
    "zero": (False, (0, 0)),
}
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 7, 7, 2, 2, 128),
    (1, 63, 65, 3, 3, 64),
    (1, 65, 63, 4, 1, 128),
    (2, 129, 200, 4, 2, 64),
    (1, 200, 129, 4, 2, 128),
    (1, 1, 300, 4, 1, 64),
    (1, 300, 300, 2, 1, 40),
    (3, 17, 5, 6, 2, 80),
    (1, 1000, 1000, 2, 2, 128),
    (1, 777, 1500, 8, 1, 64),
]


def _shape_id(s):
    return "x".join(map(str, s))


def _fwd_bwd_case(shape, mask, dtype):
    def run():
        name = f"fwd_bwd {_shape_id(shape)} {mask} {dtype}"
        g = gen_for(name)
        b, sq, sk, h, hkv, d = shape
        causal, window = MASKS[mask]
        q, k, v = randn((b, sq, h, d), g, dtype), randn((b, sk, hkv, d), g, dtype), \
            randn((b, sk, hkv, d), g, dtype)
        dout = randn((b, sq, h, d), g, dtype)
        got = run_attention(q, k, v, dout, causal, window)
        ref = reference(q, k, v, dout, causal, window)
        compare_all(name, got, ref, dtype)

    return run


for _shape in SHAPES:
    for _mask in MASKS:
        for _dtype in (torch.bfloat16, torch.float16):
            if _dtype == torch.float16 and _mask not in ("full", "causal"):
                continue
            check(f"fwd_bwd/{_shape_id(_shape)}/{_mask}/{str(_dtype)[6:]}")(
                _fwd_bwd_case(_shape, _mask, _dtype))


class Skip(Exception):
    """A check that does not apply to this build (reported as SKIP, not as a failure)."""


def _compiled_head_dims() -> list[int]:
    if DEV == "cpu":
        return [32, 64, 96, 128, 160, 192, 256]  # the CPU kernels take every head dim
    return [int(x) for x in str(cpattn.build_info()["cuda_head_dims"]).replace(";", ",").split(",")
            if x.strip()]


def _head_dim_case(d):
    def run():
        if d > max(_compiled_head_dims()):  # a smaller one is zero-padded up to a compiled one
            raise Skip(f"no compiled head dim >= {d} (CPATTN_CUDA_HEAD_DIMS=ALL builds them all)")
        for dtype, (causal, window) in ((torch.bfloat16, (True, (-1, -1))),
                                        (torch.float16, (False, (40, 7)))):
            name = f"head_dim {d} {dtype}"
            g = gen_for(name)
            q, k, v = randn((2, 77, 4, d), g, dtype), randn((2, 93, 2, d), g, dtype), \
                randn((2, 93, 2, d), g, dtype)
            dout = randn(q.shape, g, dtype)
            got = run_attention(q, k, v, dout, causal, window)
            compare_all(name, got, reference(q, k, v, dout, causal, window), dtype)

    return run


for _d in (32, 64, 96, 128, 160, 192, 256):
    check(f"head_dim/{_d}")(_head_dim_case(_d))


# Score options (issue 12): softcap, ALiBi, prefix-LM, sinks, v's own head dim; forward, lse and
# every gradient (the sinks' too) against the float64 reference, alone and combined.
# (name, (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v), causal, window,
#  options of cpattn.attention)
SCORE_CASES = [
    ("softcap_causal", (1, 131, 131, 2, 2, 64, 64), True, (-1, -1), {"softcap": 1.5}),
    ("alibi_gqa_bottom_right", (1, 100, 150, 4, 2, 64, 64), True, (-1, -1), {"alibi": True}),
    ("prefix", (2, 90, 140, 2, 1, 128, 128), True, (-1, -1), {"prefix_len": 100}),
    ("prefix_window", (1, 80, 260, 2, 2, 64, 64), True, (16, -1), {"prefix_len": 40}),
    ("sinks_window", (2, 70, 90, 2, 1, 64, 64), False, (40, 9), {"sinks": True}),
    ("sinks_empty_rows", (1, 40, 50, 2, 1, 64, 64), True, (3, -1), {"sinks": True}),
    ("softcap_alibi_window", (1, 130, 200, 4, 2, 128, 128), True, (30, -1),
     {"softcap": 2.0, "alibi": True}),
    ("dv_gqa", (1, 77, 93, 4, 2, 128, 64), True, (-1, -1), {}),
    ("all_dv", (1, 77, 163, 4, 2, 64, 40), True, (60, -1),
     {"softcap": 3.0, "alibi": True, "prefix_len": 20, "sinks": True}),
]


def _score_case(shape, causal, window, opts, dtype):
    def run():
        name = f"score_options {_shape_id(shape)} {opts} {dtype}"
        g = gen_for(name)
        b, sq, sk, h, hkv, d, dv = shape
        q, k, v = randn((b, sq, h, d), g, dtype), randn((b, sk, hkv, d), g, dtype), \
            randn((b, sk, hkv, dv), g, dtype)
        dout = randn((b, sq, h, dv), g, dtype)
        kw = {"softcap": opts.get("softcap", 0.0), "prefix_len": opts.get("prefix_len", 0)}
        if opts.get("alibi"):
            kw["alibi_slopes"] = 0.5 ** torch.arange(1, h + 1, dtype=torch.float32)
        sinks = torch.randn(h, generator=g).float() if opts.get("sinks") else None
        # reference: float64 on the CPU, the sinks' gradient included
        qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
        sr = sinks.double().requires_grad_(True) if sinks is not None else None
        out_r, lse_r = reference_attention(qr, kr, vr, causal=causal, window=window, sinks=sr,
                                           **kw)
        ref_grads = torch.autograd.grad((out_r * dout.double().cpu()).sum(),
                                        (qr, kr, vr) + ((sr,) if sr is not None else ()))
        # cpattn on this device
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        sg = sinks.to(DEV).requires_grad_(True) if sinks is not None else None
        dkw = dict(kw)
        if "alibi_slopes" in dkw:
            dkw["alibi_slopes"] = dkw["alibi_slopes"].to(DEV)
        out, lse = cpattn.attention(qg, kg, vg, causal=causal, window=window, sinks=sg,
                                    return_lse=True, **dkw)
        grads = torch.autograd.grad(out, (qg, kg, vg) + ((sg,) if sg is not None else ()), dout)
        check_close(f"{name} out", out.detach(), out_r.detach().to(out.device),
                    out_tol(dtype, out.dtype))
        check_lse(lse.detach(), lse_r.detach().float())
        for n, x, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
            assert x.shape == r.shape, f"{name} {n}: shape {tuple(x.shape)} != {tuple(r.shape)}"
            check_close(f"{name} {n}", x, r.to(x.device), GRAD_TOL[dtype])
        if sg is not None:
            check_close(f"{name} dsinks", grads[3], ref_grads[3].to(grads[3].device),
                        GRAD_TOL[dtype])

    return run


for _name, _shape, _causal, _window, _opts in SCORE_CASES:
    for _dtype in (torch.bfloat16, torch.float16):
        check(f"score_options/{_name}/{str(_dtype)[6:]}")(
            _score_case(_shape, _causal, _window, _opts, _dtype))


@check("score_options/ring_decode_sinks_W=1")
def _score_options_strategies():
    """Sinks (and ALiBi, softcap) through the drivers that merge partial results and add the sinks
    once at the end (apply_sinks_ / sink_bwd on this device): ring over a one-rank group, and
    prefill + decode against the float64 reference."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        _world_of_one(tmp)
        try:
            g = gen_for("score_options strategies")
            q, k, v = randn((1, 256, 4, 64), g), randn((1, 256, 2, 64), g), \
                randn((1, 256, 2, 64), g)
            dout = randn(q.shape, g)
            sinks = torch.randn(4, generator=g).float()
            slopes = 0.5 ** torch.arange(1, 5, dtype=torch.float32)
            kw = {"causal": True, "softcap": 2.0}
            qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
            sr = sinks.double().requires_grad_(True)
            out_r, _ = reference_attention(qr, kr, vr, sinks=sr, alibi_slopes=slopes, **kw)
            ref = (out_r.detach(), None) + torch.autograd.grad(
                (out_r * dout.double().cpu()).sum(), (qr, kr, vr))
            sg = sinks.to(DEV).requires_grad_(True)
            for strategy in ("ring", "allgather"):
                sg.grad = None
                _check_grads(f"ring_attention {strategy} sinks+alibi+softcap",
                             lambda a, b, c: cpattn.ring_attention(
                                 a, b, c, layout="zigzag", strategy=strategy, sinks=sg,
                                 alibi_slopes=slopes.to(DEV), **kw), q, k, v, dout, ref)
            # prefill then decode with sinks: the sink counted once per row
            n = 192
            full = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                       causal=True, sinks=sinks.double())[0]
            cache = cpattn.KVCacheShard(1, 256, 2, 64, dtype=q.dtype, device=q.device)
            out = cpattn.prefill_attention(q[:, :n], k[:, :n], v[:, :n], cache, layout="zigzag",
                                           sinks=sinks.to(DEV))
            check_close("prefill sinks out", out, full[:, :n].to(DEV), OUT_TOL[q.dtype])
            cache.append(k[:, n:n + 1], v[:, n:n + 1])
            out = cpattn.decode_attention(q[:, n:n + 1], cache, sinks=sinks.to(DEV))
            check_close("decode sinks out", out, full[:, n:n + 1].to(DEV), OUT_TOL[q.dtype])
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()


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
            check_close(f"offsets {sq},{sk},{qo},{ko} out", out, r_out.to(DEV),
                        out_tol(q.dtype, out_dtype))
            check_lse(lse, r_lse)
            rows = empty.permute(0, 2, 1)  # (B, Sq, H)
            assert (out[rows.to(DEV)] == 0).all(), "rows that see no key must be exactly 0"
        dout = randn(q.shape, g)
        dq, dk, dv = ops.attention_bwd(dout, q, k, v, out.float(), lse, qo, ko, torch.float32,
                                       None, softmax_scale=0.125, causal=causal,
                                       window_left=window[0], window_right=window[1])
        r = reference(q, k, v, dout, causal=causal, window=window, scale=0.125, q_offset=qo,
                      k_offset=ko)
        for n, x, rr in zip(("dq", "dk", "dv"), (dq, dk, dv), r[2:]):
            check_close(f"offsets {sq},{sk},{qo},{ko} {n}", x, rr.to(DEV), GRAD_TOL[torch.bfloat16])


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
        check_close(f"deterministic {n}", x, r.to(DEV), GRAD_TOL[torch.bfloat16])
        check_close(f"atomic {n}", y, r.to(DEV), GRAD_TOL[torch.bfloat16])


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
    check_close("large out", got[0], ref[0].to(DEV), OUT_TOL[torch.bfloat16])
    check_lse(got[1], ref[1])
    for n, x, r in zip(("dq", "dk", "dv"), got[2:], ref[2:]):
        check_close(f"large {n}", x, r.to(DEV), 3 * GRAD_TOL[torch.bfloat16])


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
    q = torch.randn(1, 8, 2, 64, device=DEV)
    _must_raise(lambda: cpattn.attention(q, q, q), "bfloat16 or float16", "fp32 CUDA inputs")
    big = torch.randn(1, 8, 2, 512, device=DEV, dtype=torch.bfloat16)
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


def _shard(x, layout, world, rank, dim=1):
    pos = cpattn.positions(x.shape[dim], layout=layout, rank=rank, world_size=world)
    return x.index_select(dim, pos.to(x.device))


def _unshard(parts, layout, world, dim=1):
    seqlen = parts[0].shape[dim] * world
    order = torch.cat([cpattn.positions(seqlen, layout=layout, rank=r, world_size=world)
                       for r in range(world)]).to(parts[0].device)
    full = torch.empty_like(torch.cat(parts, dim))
    full.index_copy_(dim, order, torch.cat(parts, dim))
    return full


def _emulated_ring_case(world):
    def run():
        for n, (layout, (causal, window), (h, hkv)) in enumerate(
                [(lay, m, hh) for lay in LAYOUTS
                 for m in [(False, (-1, -1)), (True, (-1, -1)), (True, (45, 0)), (False, (30, 20))]
                 for hh in [(4, 4), (4, 1)]]):
            g = gen_for(f"ring {world} {n}")
            seqlen = 2 * world * 48
            q, k, v = randn((2, seqlen, h, 64), g), randn((2, seqlen, hkv, 64), g), \
                randn((2, seqlen, hkv, 64), g)
            dout = randn(q.shape, g)
            what = f"W={world} {layout} causal={causal} window={window} heads={h}/{hkv}"
            sh = [[_shard(t, layout, world, r) for r in range(world)] for t in (q, k, v, dout)]
            opts = dict(softmax_scale=0.125, causal=causal, window_left=window[0],
                        window_right=window[1])
            outs, lses = torch.ops.cpattn_testing.ring_fwd_emulated(
                sh[0], sh[1], sh[2], LAYOUTS[layout], **opts)
            dqs, dks, dvs = torch.ops.cpattn_testing.ring_bwd_emulated(
                sh[3], sh[0], sh[1], sh[2], list(outs), list(lses), LAYOUTS[layout], **opts)
            sync()
            ref = reference(q, k, v, dout, causal=causal, window=window, scale=0.125)
            check_close(f"{what} out", _unshard(list(outs), layout, world), ref[0].to(DEV),
                        OUT_TOL[torch.bfloat16])
            check_lse(_unshard(list(lses), layout, world, dim=2), ref[1])
            for name, parts, r in zip(("dq", "dk", "dv"), (dqs, dks, dvs), ref[2:]):
                check_close(f"{what} {name}", _unshard(list(parts), layout, world), r.to(DEV),
                            GRAD_TOL[torch.bfloat16])

    return run


for _w in (1, 2, 3, 4):
    check(f"ring_emulated/W={_w}")(_emulated_ring_case(_w))


@check("ring_nccl/W=1")
def _nccl_w1():
    """A one-rank process group (gloo): NCCL bootstrap through it, send/recv to self, the ring
    forward / backward on CUDA tensors, and a re-created WORLD getting its own communicator."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            g = gen_for("nccl")
            x = randn((3, 1000), g)
            for i in range(20):  # more shifts than event slots
                y = torch.ops.cpattn_testing.ring_shift(x + i, group.group_name, 60.0)
                assert torch.equal(y, x + i), "NCCL send/recv to self changed the data"
            q, k, v = randn((1, 256, 4, 128), g), randn((1, 256, 2, 128), g), \
                randn((1, 256, 2, 128), g)
            dout = randn(q.shape, g)
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = cpattn.ring_attention(qg, kg, vg, causal=True, layout="zigzag")
            dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
            ref = reference(q, k, v, dout, causal=True)
            check_close("nccl out", out.detach(), ref[0].to(DEV), OUT_TOL[torch.bfloat16])
            for n, x_, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
                check_close(f"nccl {n}", x_, r.to(DEV), GRAD_TOL[torch.bfloat16])
        finally:
            dist.destroy_process_group()
        # WORLD re-created under the same name without destroy_communicators(): the cached
        # communicator belongs to the old group object and must not be reused (it is aborted and
        # replaced), and the re-created group works.
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv2", rank=0, world_size=1)
        try:
            y = torch.ops.cpattn_testing.ring_shift(x, dist.group.WORLD.group_name, 60.0)
            assert torch.equal(y, x), "NCCL send/recv to self after re-initialisation"
            assert cpattn.destroy_communicators() == 1, "one live communicator expected"
            assert cpattn.destroy_communicators() == 0
        finally:
            dist.destroy_process_group()


def _world_of_one(tmp: str) -> None:
    """A one-rank process group: gloo for CPU tensors, NCCL for CUDA ones (as on a GPU cluster)."""
    import torch.distributed as dist

    backend = "gloo" if DEV == "cpu" else "cpu:gloo,cuda:nccl"
    if DEV != "cpu":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)


def _check_grads(what, fn, q, k, v, dout, ref):
    """fn(q, k, v) -> out, differentiated against dout; compared with ref (out, lse, dq, dk, dv)."""
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qg, kg, vg)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    check_close(f"{what} out", out.detach(), ref[0].to(out.device), out_tol(q.dtype, out.dtype))
    for n, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
        check_close(f"{what} {n}", x, r.to(x.device), GRAD_TOL[q.dtype])


@check("strategies/W=1")
def _strategies():
    """Every public strategy on this device's tensors over a one-rank group (NCCL for CUDA):
    ring and all-gather (fixed and varlen), Ulysses, hybrid; forward and backward."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        _world_of_one(tmp)
        try:
            world = dist.group.WORLD
            g = gen_for("strategies")
            q, k, v = randn((1, 256, 4, 64), g), randn((1, 256, 2, 64), g), \
                randn((1, 256, 2, 64), g)
            dout = randn(q.shape, g)
            causal_ref = reference(q, k, v, dout, causal=True)
            for strategy in ("ring", "allgather"):
                _check_grads(f"ring_attention {strategy}", lambda a, b, c: cpattn.ring_attention(
                    a, b, c, causal=True, layout="zigzag", strategy=strategy), q, k, v, dout,
                    causal_ref)
            window_ref = reference(q, k, v, dout, causal=True, window=(37, -1))
            _check_grads("ring_attention allgather window", lambda a, b, c: cpattn.ring_attention(
                a, b, c, causal=True, window=(37, -1), strategy="allgather"), q, k, v, dout,
                window_ref)
            _check_grads("ulysses_attention", lambda a, b, c: cpattn.ulysses_attention(
                a, b, c, causal=True), q, k, v, dout, causal_ref)
            _check_grads("hybrid_attention", lambda a, b, c: cpattn.hybrid_attention(
                a, b, c, ulysses_group=world, ring_group=world, causal=True), q, k, v, dout,
                causal_ref)
            # Packed documents 100 + 156 (W = 1: the shard is the packed sequence itself).
            cu = torch.tensor([0, 100, 256])
            refs = [reference(q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], causal=True)
                    for a, b in ((0, 100), (100, 256))]
            # (out, lse, dq, dk, dv) of the packed sequence, batch dim dropped; lse is (H, T)
            doc_ref = [torch.cat([r[i][0] for r in refs], dim=1 if i == 1 else 0)
                       for i in range(5)]
            for strategy in ("ring", "allgather"):
                _check_grads(f"ring_attention_varlen {strategy}",
                             lambda a, b, c: cpattn.ring_attention_varlen(
                                 a, b, c, cu, causal=True, strategy=strategy),
                             q[0], k[0], v[0], dout[0], doc_ref)
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()


@check("inference/W=1")
def _inference():
    """Chunked prefill into a KV cache on this device, then decode steps, over a one-rank group:
    every query against the float64 causal reference of the whole sequence."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        _world_of_one(tmp)
        try:
            g = gen_for("inference")
            n, steps = 192, 3
            q, k, v = randn((2, n + steps, 4, 64), g), randn((2, n + steps, 2, 64), g), \
                randn((2, n + steps, 2, 64), g)
            full = reference(q, k, v, causal=True)[0]  # (B, S, H, D)
            cache = cpattn.KVCacheShard(2, 256, 2, 64, dtype=q.dtype, device=q.device)
            outs = [cpattn.prefill_attention(q[:, a:a + 96], k[:, a:a + 96], v[:, a:a + 96],
                                             cache, layout="zigzag") for a in (0, 96)]
            check_close("prefill (two chunks) out", torch.cat(outs, 1), full[:, :n].to(DEV),
                        OUT_TOL[q.dtype])
            for step in range(steps):
                t = n + step
                cache.append(k[:, t:t + 1], v[:, t:t + 1])
                for comm in ("all_gather", "reduce_scatter"):
                    out = cpattn.decode_attention(q[:, t:t + 1], cache, comm=comm)
                    check_close(f"decode {comm} step {step}", out, full[:, t:t + 1].to(DEV),
                                OUT_TOL[q.dtype])
            parts = [reference(q[:, -1:], k[:, a:b], v[:, a:b]) for a, b in ((0, 90), (90, n))]
            out, lse = cpattn.merge_attention_states([p[0].float().to(DEV) for p in parts],
                                                     [p[1].float().to(DEV) for p in parts])
            ref = reference(q[:, -1:], k[:, :n], v[:, :n])
            check_close("merge_attention_states out", out, ref[0].to(DEV), 1e-5)
            check_lse(lse, ref[1].float())
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()


@check("opcheck/cuda")
def _opcheck():
    g = gen_for("opcheck")
    q, k, v = randn((1, 70, 4, 64), g), randn((1, 90, 2, 64), g), randn((1, 90, 2, 64), g)
    opts = dict(softmax_scale=0.125, causal=True)
    torch.library.opcheck(ops.attention_fwd.default, (q, k, v, 20, 0, None), opts)
    out, lse = ops.attention_fwd(q, k, v, 20, 0, None, **opts)
    dout = randn(q.shape, g)
    torch.library.opcheck(ops.attention_bwd.default, (dout, q, k, v, out, lse, 20, 0, None, None),
                          opts, test_utils=("test_schema", "test_faketensor"))


@check("compile/attention_fullgraph")
def _compile():
    """torch.compile(fullgraph=True) of cpattn.attention (fake kernel + autograd registration):
    the same out and gradients as eager."""
    g = gen_for("compile")
    q, k, v = randn((1, 70, 4, 64), g), randn((1, 90, 2, 64), g), randn((1, 90, 2, 64), g)
    dout = randn(q.shape, g)

    def f(a, b, c):
        return cpattn.attention(a, b, c, causal=True)

    backend = "aot_eager" if DEV == "cpu" else "inductor"  # no C++ codegen on the CPU dry run
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend=backend)):
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fn(qg, kg, vg)
        results.append((out, *torch.autograd.grad(out, (qg, kg, vg), dout)))
    for n, a, b in zip(("out", "dq", "dk", "dv"), *results):
        check_close(f"compiled {n}", b, a, 1e-6)


def sanitizer_case() -> None:
    """A small forward + backward (atomic and deterministic dQ) + emulated ring, for
    compute-sanitizer: every code path, little work."""
    g = gen_for("sanitizer")
    for causal, window in ((True, (-1, -1)), (False, (20, 7))):
        q, k, v = randn((1, 77, 2, 64), g), randn((1, 99, 1, 64), g), randn((1, 99, 1, 64), g)
        dout = randn(q.shape, g)
        run_attention(q, k, v, dout, causal, window)
        torch.use_deterministic_algorithms(True)
        run_attention(q, k, v, dout, causal, window)
        torch.use_deterministic_algorithms(False)
    q, k, v = randn((1, 40, 2, 128), g), randn((1, 40, 2, 128), g), randn((1, 40, 2, 128), g)
    run_attention(q, k, v, randn(q.shape, g), True, (-1, -1))
    torch.ops.cpattn_testing.ring_fwd_emulated([q[:, :20], q[:, 20:]], [k[:, :20], k[:, 20:]],
                                               [v[:, :20], v[:, 20:]], 0, softmax_scale=0.1,
                                               causal=True)
    # GQA / MQA backward with the query heads split over blocks, and the reduction of the splits.
    os.environ["CPATTN_BWD_HEAD_SPLITS"] = "2"
    try:
        q, k, v = randn((1, 50, 4, 64), g), randn((1, 60, 1, 64), g), randn((1, 60, 1, 64), g)
        run_attention(q, k, v, randn(q.shape, g), True, (-1, -1))
    finally:
        del os.environ["CPATTN_BWD_HEAD_SPLITS"]
    sync()


def main() -> int:
    parser = argparse.ArgumentParser(description="cpattn CUDA checks")
    parser.add_argument("-k", default="",
                        help="run the checks whose name contains one of these (comma-separated)")
    parser.add_argument("--first", action="store_true",
                        help="only the first check matching each -k substring (a quick pass)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--sanitizer-case", action="store_true",
                        help="run only the small case for compute-sanitizer")
    args = parser.parse_args()
    if not cuda_ok():
        print("SKIP: no CUDA device or cpattn built without CUDA")
        return 0
    if args.sanitizer_case:
        sanitizer_case()
        print("sanitizer case done")
        return 0
    runnable = [(n, f) for n, f in CHECKS if not (DEV == "cpu" and n.startswith(CUDA_ONLY))]
    selected = []
    for sub in args.k.split(","):
        matching = [c for c in runnable if sub in c[0] and c not in selected]
        selected += matching[:1] if args.first else matching
    selected.sort(key=lambda c: runnable.index(c))
    if args.list:
        print("\n".join(n for n, _ in selected))
        return 0
    failed, skipped = [], 0
    t0 = time.time()
    for name, fn in selected:
        t = time.time()
        try:
            fn()
            sync()
            print(f"PASS {name} ({time.time() - t:.2f} s)", flush=True)
        except Skip as e:
            skipped += 1
            print(f"SKIP {name}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
    print(f"{len(selected) - len(failed) - skipped}/{len(selected)} checks passed, {skipped} "
          f"skipped, in {time.time() - t0:.1f} s")
    for name in failed:
        print(f"  failed: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
