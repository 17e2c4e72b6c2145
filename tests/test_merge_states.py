"""cpattn.merge_attention_states: the N-way -inf safe merge op, its gradients and registration."""

from __future__ import annotations

import pytest
import torch

import cpattn

from conftest import assert_close_fp32, assert_close_rounded, randn

ops = torch.ops.cpattn
NEG_INF = float("-inf")


def random_parts(
    n: int, shape: tuple[int, int, int, int], gen: torch.Generator, empty_fraction: float = 0.0,
    center: float = 0.0, dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """outs (N, B, S, H, D) and lses (N, B, H, S); a fraction of (part, row) pairs is empty."""
    b, s, h, d = shape
    outs = randn((n, b, s, h, d), gen)
    lses = randn((n, b, h, s), gen) * 3 + center
    empty = torch.rand((n, b, h, s), generator=gen) < empty_fraction
    lses = lses.masked_fill(empty, NEG_INF)
    outs = outs.masked_fill(empty.transpose(2, 3)[..., None], 0.0)
    return outs.to(dtype), lses


def reference_merge(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64, differentiable: w_n = exp(lse_n - lse), out = sum_n w_n out_n. Rows empty in
    every part give (0, -inf) with zero gradients."""
    outs, lses = outs.double(), lses.double()
    top = lses.max(0).values
    nonempty = torch.isfinite(top)
    top = torch.where(nonempty, top, torch.zeros_like(top))
    e = torch.exp(lses - top)
    total = e.sum(0)
    w = torch.where(nonempty, e / total.clamp_min(1e-300), torch.zeros_like(e))
    out = (w.transpose(2, 3)[..., None] * outs).sum(0)
    lse = torch.where(nonempty, top + torch.log(total.clamp_min(1e-300)),
                      torch.full_like(top, NEG_INF))
    return out, lse


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("empty_fraction", [0.0, 0.4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_merge_matches_float64(n: int, empty_fraction: float, dtype: torch.dtype,
                               gen: torch.Generator) -> None:
    """Any number of parts, some rows empty in some parts; outs of any float dtype, merged in
    fp32 and rounded once to the output dtype."""
    outs, lses = random_parts(n, (2, 5, 3, 24), gen, empty_fraction, dtype=dtype)
    want_out, want_lse = reference_merge(outs, lses)
    out, lse = cpattn.merge_attention_states(outs, lses)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_rounded(out, want_out, dtype, "out")
    assert_close_fp32(lse, want_lse, "lse")
    # A list of parts and an explicit out dtype give the same fp32 result.
    out32, lse32 = cpattn.merge_attention_states(list(outs), list(lses), out_dtype=torch.float32)
    assert_close_fp32(out32, want_out, "out fp32")
    assert torch.equal(lse32, lse)


def test_merge_empty_rows_and_single_part(gen: torch.Generator) -> None:
    """Rows empty in every part are (0, -inf), no NaN; one non-empty part is passed exactly."""
    outs, lses = random_parts(4, (1, 6, 2, 8), gen)
    lses[:, :, :, 0:2] = NEG_INF  # rows 0-1: empty everywhere
    outs[:, :, 0:2] = 0
    lses[1:, :, :, 2:4] = NEG_INF  # rows 2-3: only part 0
    outs[1:, :, 2:4] = 0
    out, lse = cpattn.merge_attention_states(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[:, 0:2], torch.zeros_like(out[:, 0:2]))
    assert torch.isneginf(lse[:, :, 0:2]).all()
    assert torch.equal(out[:, 2:4], outs[0, :, 2:4])
    assert torch.equal(lse[:, :, 2:4], lses[0, :, :, 2:4])


@pytest.mark.parametrize("center", [-300.0, 1000.0, 1e4])
def test_merge_large_magnitudes(center: float, gen: torch.Generator) -> None:
    """LSEs whose exp over- or underflows fp32 merge stably."""
    outs, lses = random_parts(3, (1, 7, 2, 16), gen, center=center)
    want_out, want_lse = reference_merge(outs, lses)
    out, lse = cpattn.merge_attention_states(outs, lses)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_close_fp32(out, want_out, "out")
    assert (lse.double() - want_lse).abs().max().item() <= 1e-6 * abs(center) + 1e-5


def test_two_parts_equal_merge_state(gen: torch.Generator) -> None:
    """For two parts the N-way op computes what the in-place two-way merge_state_ does."""
    outs, lses = random_parts(2, (2, 4, 3, 16), gen, 0.3)
    out, lse = cpattn.merge_attention_states(outs, lses)
    run_out, run_lse = outs[0].clone(), lses[0].clone()
    cpattn.merge_state_(run_out, run_lse, outs[1], lses[1])
    torch.testing.assert_close(out, run_out, atol=1e-6, rtol=1e-6)
    assert torch.equal(lse, run_lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_gradients_match_float64(dtype: torch.dtype, gen: torch.Generator) -> None:
    """Backward through out and lse (upstream gradients on both) equals float64 autograd of the
    formula, including parts and rows that are empty (their gradients are 0, not NaN)."""
    outs, lses = random_parts(3, (2, 5, 4, 16), gen, empty_fraction=0.3, dtype=dtype)
    lses[:, 0, :, 0] = NEG_INF  # a row empty in every part
    outs[:, 0, 0] = 0
    outs.requires_grad_()
    lses.requires_grad_()
    dout = randn(outs.shape[1:], gen)
    dlse = randn(lses.shape[1:], gen)

    out, lse = cpattn.merge_attention_states(outs, lses, out_dtype=torch.float32)
    finite = torch.isfinite(lse.detach())
    loss = (out * dout).sum() + (lse.masked_fill(~finite, 0) * dlse).sum()
    g_outs, g_lses = torch.autograd.grad(loss, (outs, lses))

    r_outs = outs.detach().double().requires_grad_()
    r_lses = lses.detach().double().requires_grad_()
    r_out, r_lse = reference_merge(r_outs, r_lses)
    assert torch.equal(torch.isfinite(r_lse), finite)
    r_loss = (r_out * dout.double()).sum() + (r_lse.masked_fill(~finite, 0) * dlse.double()).sum()
    w_outs, w_lses = torch.autograd.grad(r_loss, (r_outs, r_lses))

    assert g_outs.dtype == dtype and g_lses.dtype == torch.float32
    assert not torch.isnan(g_outs).any() and not torch.isnan(g_lses).any()
    assert_close_rounded(g_outs, w_outs, dtype, "d outs")
    assert_close_fp32(g_lses, w_lses, "d lses")
    assert torch.equal(g_lses[:, 0, :, 0], torch.zeros_like(g_lses[:, 0, :, 0]))


def test_opcheck_merge_attention_states(gen: torch.Generator) -> None:
    """Schema, fake kernel, autograd registration and AOT dispatch, forward and backward."""
    outs, lses = random_parts(3, (2, 4, 3, 8), gen, 0.2)
    torch.library.opcheck(ops.merge_attention_states.default,
                          (outs.requires_grad_(), lses.requires_grad_(), None))
    outs_bf, lses_bf = random_parts(2, (1, 3, 2, 8), gen, dtype=torch.bfloat16)
    torch.library.opcheck(ops.merge_attention_states.default, (outs_bf, lses_bf, torch.float32))
    out, lse = ops.merge_attention_states(outs.detach(), lses.detach())
    dout, dlse = randn(out.shape, gen), randn(lse.shape, gen)
    torch.library.opcheck(ops.merge_attention_states_bwd.default,
                          (dout, dlse, outs.detach(), lses.detach(), lse))
    torch.library.opcheck(ops.merge_attention_states_bwd.default,
                          (dout, None, outs.detach(), lses.detach(), lse))


def test_merge_compiles_fullgraph(gen: torch.Generator) -> None:
    """torch.compile(fullgraph=True) traces the op forward and backward and matches eager."""
    torch._dynamo.reset()

    def f(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
        out, lse = cpattn.merge_attention_states(outs * 2, lses)
        return out.sum() + lse.sum()

    outs, lses = random_parts(3, (1, 4, 2, 8), gen)
    a = [t.clone().requires_grad_() for t in (outs, lses)]
    b = [t.clone().requires_grad_() for t in (outs, lses)]
    f(*a).backward()
    torch.compile(f, fullgraph=True)(*b).backward()
    for x, y in zip(a, b):
        torch.testing.assert_close(x.grad, y.grad)


BAD = {
    "outs_4d": (lambda: (torch.zeros(2, 3, 4, 8), torch.zeros(2, 4, 3)), r"outs must be \(parts"),
    "lses_shape": (lambda: (torch.zeros(2, 1, 3, 4, 8), torch.zeros(2, 1, 3, 4)),
                   r"lses must have shape"),
    "lses_bf16": (lambda: (torch.zeros(2, 1, 3, 4, 8), torch.zeros(2, 1, 4, 3).bfloat16()),
                  r"lses must be float32"),
    "outs_int": (lambda: (torch.zeros(2, 1, 3, 4, 8, dtype=torch.int32), torch.zeros(2, 1, 4, 3)),
                 r"outs must be float32, bfloat16 or float16"),
    "no_parts": (lambda: (torch.zeros(0, 1, 3, 4, 8), torch.zeros(0, 1, 4, 3)),
                 r"at least one part"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_merge_bad_args(case: str) -> None:
    build, pattern = BAD[case]
    with pytest.raises(RuntimeError, match=pattern):
        cpattn.merge_attention_states(*build())
