"""Shared fixtures and the float64 reference for the cpattn test suite.

The reference is plain torch math in float64 on the global-position mask rule of docs/design.md:
query row r sits at position q_offset + r, key column c at k_offset + c; key j is visible to
query i iff (not causal or j <= i) and (left < 0 or j >= i - left)
and (right < 0 or j <= i + right).
A row that sees no key has out 0 and lse -inf.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence

# Set before cpattn is imported anywhere: the op layer fills outputs with NaN before the kernel
# runs, so any element the kernel forgets to write fails the comparison.
os.environ["CPATTN_POISON"] = "1"

import pytest
import torch

from cpattn.core.options import AttentionOptions  # noqa: E402
from cpattn.testing.distributed import keep_ranks  # noqa: E402
from cpattn.testing.emulation import load_ops  # noqa: E402

# The test-only ops (torch.ops.cpattn_testing) live in a library of their own: load it for every
# test module (and every spawned rank that imports one).
load_ops()

# The ranks of run_ranks are kept from test to test within a test file (one interpreter start per
# file and world size, not per test); CPATTN_TEST_FRESH_RANKS=1 spawns them afresh for every call.
keep_ranks(os.environ.get("CPATTN_TEST_FRESH_RANKS") != "1")

Window = tuple[int, int]

# ---------------------------------------------------------------------------------------------
# Random inputs


def seed_from(text: str) -> int:
    """A stable 31-bit seed derived from a string (a test id)."""
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test id: fresh inputs per test, reproducible per test."""
    g = torch.Generator()
    g.manual_seed(seed_from(request.node.nodeid))
    return g


def op_options(
    softmax_scale: float,
    causal: bool = False,
    window: Window = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    prefix_len: int = 0,
) -> dict:
    """The option arguments every attention op ends with, by name (unchecked: error tests pass
    bad values through to the op)."""
    return AttentionOptions(softmax_scale=softmax_scale, causal=causal, window=tuple(window),
                            softcap=softcap, alibi_slopes=alibi_slopes,
                            prefix_len=prefix_len).op_kwargs()


@pytest.fixture
def one_kv_head_per_backward_call():
    """The CPU backward in one kernel call per KV head wherever it packs operands or sums dK / dV
    apart from the gradients (bf16 calls with bf16 gradients, or on the micro-kernels' path;
    fp32 with D or Dv not a multiple of 16)."""
    previous = torch.ops.cpattn_testing.set_cpu_backward_group_bytes(1)
    yield
    torch.ops.cpattn_testing.set_cpu_backward_group_bytes(previous)


def randn(
    shape: Sequence[int],
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
) -> torch.Tensor:
    """Unit-normal values (drawn in fp32, then cast), optionally a leaf that requires grad."""
    t = torch.randn(tuple(shape), generator=gen, dtype=torch.float32).to(dtype)
    return t.requires_grad_(requires_grad)


def make_qkv(
    gen: torch.Generator,
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    requires_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Sq, H, D), k and v (B, Sk, Hkv, D)."""
    q = randn((batch, seqlen_q, heads, head_dim), gen, dtype, requires_grad)
    k = randn((batch, seqlen_k, kv_heads, head_dim), gen, dtype, requires_grad)
    v = randn((batch, seqlen_k, kv_heads, head_dim), gen, dtype, requires_grad)
    return q, k, v


# ---------------------------------------------------------------------------------------------
# Reference

from reference import reference_attention, visible_mask  # noqa: E402,F401
from tolerances import (  # noqa: E402,F401
    UNIT_ROUNDOFF,
    Tolerance,
    assert_close_baseline,
    assert_close_fp32,
    assert_close_low_out,
    assert_close_rounded,
    dense_tolerance,
    expected_of,
)


def reference_with_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    compute_dtype: torch.dtype = torch.float64,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference out, lse and (dq, dk, dv) for the upstream gradient dout, all in compute_dtype."""
    qr, kr, vr = (t.detach().to(compute_dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, compute_dtype=compute_dtype, **kwargs)
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), dout.to(compute_dtype))
    return out.detach(), lse.detach(), dq, dk, dv


def seeded_problem(seed: int, seqlen: int, heads: int, kv_heads: int, dtype: torch.dtype,
                   causal: bool, window: tuple[int, int]):
    """(q, k, v, dout) (2, seqlen, heads | kv_heads, 16) from torch.manual_seed(seed) (the same on
    every rank), the float64 reference (out, lse and the reference inputs, whose .grad holds the
    gradients for dout) and the run's Tolerance (tests/tolerances.py)."""
    torch.manual_seed(seed)
    q = torch.randn(2, seqlen, heads, 16).to(dtype)
    k, v = (torch.randn(2, seqlen, kv_heads, 16).to(dtype) for _ in range(2))
    dout = torch.randn(2, seqlen, heads, 16).to(dtype)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_inputs, causal=causal, window=window)
    ref_out.backward(dout.double())
    tol = dense_tolerance((q, k, v, dout),
                          expected_of(ref_out, ref_lse, [t.grad for t in ref_inputs]),
                          causal=causal, window=window)
    return (q, k, v, dout), ref_out, ref_lse, ref_inputs, tol


def assert_matches(what: str, out, lse, grads, ref_out, ref_lse, ref_grads,
                   tol: Tolerance) -> None:
    """out, lse and (dq, dk, dv) against the float64 reference within tol; empty rows (lse -inf)
    must match exactly."""
    got = expected_of(out, lse, grads)
    for name, want in expected_of(ref_out, ref_lse, ref_grads).items():
        tol.check(name, got[name], want, what)


# ---------------------------------------------------------------------------------------------
# Which CPU kernels this run tested: a path the CPU lacks is not tested here (an AVX2-only
# machine runs neither the AVX-512 nor the bf16-dot kernels), and the summary says so.


def _cpu_paths() -> str:
    import cpattn
    from cpattn.core.machine import cpu_model

    info = cpattn.build_info()
    gemm = ", ".join(f"{dtype} {path}" for dtype, path in info["cpu_gemm"].items())
    return (f"cpattn CPU kernels under test: instruction set {info['cpu_isa']}; GEMM paths "
            f"{gemm}; AMX used: {info['cpu_amx']['usable']} (CPU: {cpu_model()})")


def pytest_report_header(config) -> str:
    return _cpu_paths()


def pytest_terminal_summary(terminalreporter) -> None:
    terminalreporter.write_line(_cpu_paths())
