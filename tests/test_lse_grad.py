"""Gradients that flow through the returned LSE (d lse_i / d s_ij = p_ij), local and ring."""

import pytest
import torch

import cpattn

from conftest import assert_close_fp32, make_qkv
from distributed import run_ranks
from reference import reference_attention


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (5, 0))])
@pytest.mark.parametrize("with_out_grad", [True, False])
def test_lse_gradient_matches_reference(gen, causal, window, with_out_grad):
    q, k, v = make_qkv(gen, 2, 37, 53, 4, 2, 32, requires_grad=True)
    out, lse = cpattn.attention(q, k, v, causal=causal, window=window, return_lse=True)
    g_out = torch.randn(out.shape, generator=gen) if with_out_grad else torch.zeros(out.shape)
    g_lse = torch.randn(lse.shape, generator=gen)
    # Fully masked rows have lse -inf: give them no gradient (-inf * 0 would be NaN).
    loss = (out * g_out).sum() + (lse.masked_fill(lse.isinf(), 0) * g_lse).sum()
    loss.backward()

    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    r_out, r_lse = reference_attention(*ref_in, causal=causal, window=window)
    r_loss = (r_out * g_out.double()).sum() + (r_lse.masked_fill(r_lse.isinf(), 0) * g_lse).sum()
    r_loss.backward()
    for name, got, ref in zip("qkv", (q, k, v), ref_in):
        assert_close_fp32(got.grad, ref.grad, f"d{name}")


def _ring_lse_grad(rank: int, world: int) -> None:
    torch.manual_seed(11)
    seqlen = 8 * world
    q, k, v = (torch.randn(1, seqlen, 2, 16) for _ in range(3))
    g_lse = torch.randn(1, 2, seqlen)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    _, r_lse = reference_attention(*ref_in, causal=True)
    (r_lse * g_lse).sum().backward()
    shards = [cpattn.shard(t).requires_grad_() for t in (q, k, v)]
    _, lse = cpattn.ring_attention(*shards, causal=True, return_lse=True)
    (lse * cpattn.shard(g_lse, dim=2)).sum().backward()
    for s, r in zip(shards[:2], ref_in[:2]):
        assert_close_fp32(cpattn.unshard(s.grad), r.grad, "ring lse grad")
    assert not cpattn.unshard(shards[2].grad).any(), "lse does not depend on v"


def test_ring_lse_gradient():
    run_ranks(2, _ring_lse_grad)
