"""pytest-benchmark suite: cpattn.attention and torch SDPA side by side on the CPU.

Every shape is benchmarked forward alone and forward + backward, for both implementations, in
one pytest-benchmark group per (pass, shape, mask) so the two compare directly. With
--benchmark-disable each function runs once, as a smoke test. See bench/README.md.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from bench_attention import (
    BACKWARD_FLOP_FACTOR,
    IMPLS,
    TOLERANCE,
    attention_flops,
    forward_and_grads,
    max_rel_diff,
)

# (seqlen, heads, head_dim), batch 1: about 2 and 9 GFLOP per (non-causal) forward.
SHAPES = [(1024, 8, 64), (2048, 4, 128)]
SHAPE_IDS = [f"S{s}-H{h}-D{d}" for s, h, d in SHAPES]
shapes = pytest.mark.parametrize("seqlen,heads,head_dim", SHAPES, ids=SHAPE_IDS)
masks = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
impls = pytest.mark.parametrize("impl", list(IMPLS))


def make_inputs(
    seqlen: int, heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout: (1, seqlen, heads, head_dim), standard normal, fixed seed."""
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, seqlen, heads, head_dim, generator=gen).to(dtype) for _ in range(4))


def group_name(kind: str, seqlen: int, heads: int, head_dim: int, causal: bool) -> str:
    return f"{kind} S={seqlen} H={heads} D={head_dim} {'causal' if causal else 'full'}"


def run_benchmark(
    benchmark, record_flops: Callable, impl: str, group: str, flops: float, fn: Callable
):
    """Times fn in `group`, records its FLOPs for the GFLOP/s summary, returns fn's result."""
    benchmark.group = group
    benchmark.extra_info["impl"] = impl
    benchmark.extra_info["gflop"] = flops / 1e9
    result = benchmark(fn)
    record_flops(benchmark, impl, flops)
    return result


@impls
@masks
@shapes
def test_fwd(benchmark, record_flops, bench_dtype, impl, seqlen, heads, head_dim, causal):
    q, k, v, _ = make_inputs(seqlen, heads, head_dim, bench_dtype)
    attn = IMPLS[impl]

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return attn(q, k, v, causal)

    flops = attention_flops(1, heads, seqlen, seqlen, head_dim, causal)
    group = group_name("fwd", seqlen, heads, head_dim, causal)
    out = run_benchmark(benchmark, record_flops, impl, group, flops, forward)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()


@impls
@masks
@shapes
def test_fwd_bwd(benchmark, record_flops, bench_dtype, impl, seqlen, heads, head_dim, causal):
    q, k, v, dout = make_inputs(seqlen, heads, head_dim, bench_dtype)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    attn = IMPLS[impl]

    def forward_backward() -> tuple[torch.Tensor, ...]:
        out = attn(*leaves, causal)
        return torch.autograd.grad(out, leaves, dout)

    flops = (1 + BACKWARD_FLOP_FACTOR) * attention_flops(1, heads, seqlen, seqlen, head_dim, causal)
    group = group_name("fwd+bwd", seqlen, heads, head_dim, causal)
    grads = run_benchmark(benchmark, record_flops, impl, group, flops, forward_backward)
    for g, t in zip(grads, leaves):
        assert g.shape == t.shape and torch.isfinite(g).all()


@masks
@shapes
def test_matches_sdpa(bench_dtype, seqlen, heads, head_dim, causal):
    """The timed functions compute the same thing: out and dq/dk/dv agree (2 heads)."""
    inputs = make_inputs(seqlen, 2, head_dim, bench_dtype)
    got = forward_and_grads(IMPLS["cpattn"], *inputs, causal)
    ref = forward_and_grads(IMPLS["sdpa"], *inputs, causal)
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        diff, rel = max_rel_diff(g, r)
        assert rel <= TOLERANCE[bench_dtype], f"{name}: max abs diff {diff:.2e} (rel {rel:.2e})"
