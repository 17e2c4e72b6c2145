"""The cases of bench/bench_attention.py: cpattn.attention and torch SDPA on the same tensors, the
check that they agree, and the interleaved timing of forward and backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import cpattn
from cpattn.core.flops import attention_flops
from cpattn.core.machine import interleaved_medians

# A case passes when max|cpattn - sdpa| <= tolerance * max|sdpa|, for the output and for each
# gradient. A wrong kernel (mask, scale, a missed block) is off by O(1) of that.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 4e-2,
    torch.float16: 5e-3,
}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def run_cpattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """cpattn on (B, S, H, D) tensors."""
    return cpattn.attention(q, k, v, causal=causal)


def run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """torch SDPA on the same (B, S, H, D) tensors, through (B, H, S, D) views."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


IMPLS: dict[str, Attention] = {"cpattn": run_cpattn, "sdpa": run_sdpa}


@dataclass(frozen=True)
class Case:
    """One benchmarked problem: batch 1, `heads` heads, self-attention of length `seqlen`."""

    seqlen: int
    head_dim: int
    heads: int
    causal: bool
    dtype: torch.dtype
    threads: int

    @property
    def batch(self) -> int:
        return 1

    @property
    def fwd_flops(self) -> float:
        return attention_flops(
            self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal
        )

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.seqlen}x{self.heads}x{self.head_dim}"


@dataclass
class Result:
    """Median seconds per call (None when the case was not timed) and the agreement check."""

    case: Case
    fwd_diff: float
    bwd_diff: float
    matches: bool
    fwd_s: dict[str, float] | None = None
    bwd_s: dict[str, float] | None = None


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of shape (B, S, H, D), standard normal, in the case's dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    return tuple(torch.randn(shape, generator=gen).to(case.dtype) for _ in range(4))


def forward_and_grads(
    impl: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of one implementation."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = impl(*leaves, causal)
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), *grads)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, that divided by max |b|), computed in fp32."""
    a, b = a.float(), b.float()
    diff = (a - b).abs().max().item()
    return diff, diff / max(b.abs().max().item(), 1e-30)


def check_case(case: Case, inputs: Sequence[torch.Tensor]) -> tuple[float, float, bool]:
    """Compares cpattn with SDPA: (max abs diff fwd, max abs diff over dq/dk/dv, within tol)."""
    got = forward_and_grads(run_cpattn, *inputs, case.causal)
    ref = forward_and_grads(run_sdpa, *inputs, case.causal)
    diffs = [max_rel_diff(g, r) for g, r in zip(got, ref)]
    tol = TOLERANCE[case.dtype]
    ok = all(rel <= tol for _, rel in diffs) and all(torch.isfinite(g).all() for g in got)
    return diffs[0][0], max(d for d, _ in diffs[1:]), ok


def forward_call(impl: Attention, inputs: Sequence[torch.Tensor], causal: bool) -> Callable:
    """A no-argument forward call without autograd."""
    q, k, v, _ = inputs

    def call() -> torch.Tensor:
        with torch.no_grad():
            return impl(q, k, v, causal)

    return call


def backward_call(impl: Attention, inputs: Sequence[torch.Tensor], causal: bool) -> Callable:
    """A no-argument call of the backward alone, on a graph built here once and retained."""
    q, k, v, dout = inputs
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = impl(*leaves, causal)

    def call() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return call


def run_case(case: Case, warmup: int, reps: int) -> Result:
    """Checks one case, then times it if the two implementations agree."""
    torch.set_num_threads(case.threads)
    inputs = make_inputs(case)
    fwd_diff, bwd_diff, ok = check_case(case, inputs)
    result = Result(case, fwd_diff, bwd_diff, ok)
    if not ok:
        return result
    result.fwd_s = interleaved_medians(
        {name: forward_call(impl, inputs, case.causal) for name, impl in IMPLS.items()},
        warmup,
        reps,
    )
    result.bwd_s = interleaved_medians(
        {name: backward_call(impl, inputs, case.causal) for name, impl in IMPLS.items()},
        warmup,
        reps,
    )
    return result


def heads_for(seqlen: int, head_dim: int, causal: bool, target_gflop: float, multiple: int) -> int:
    """Heads (batch 1) so that one forward is about target_gflop, a multiple of `multiple`."""
    per_head = attention_flops(1, 1, seqlen, seqlen, head_dim, causal) / 1e9
    heads = max(1, round(target_gflop / per_head))
    return -(-heads // multiple) * multiple
