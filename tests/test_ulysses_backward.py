"""Ulysses' backward keeps the output by sequence only: it sends rowsum(dout * out) by heads
(cpattn::row_dot, attention_bwd(row_dot=...)) instead of holding out by heads, and writes dq over
its own dout by heads (attention_bwd_in_dout). Checked here: the op paths give the same bits as
attention_bwd with out, bad combinations raise, and Ulysses'
gradients through out and the LSE together, with every score option, GQA replication and padding
rows, match the float64 reference on real gloo ranks."""

import pytest
import torch
import torch.distributed as dist

import cpattn

from conftest import make_qkv, op_options, randn
from distributed import run_ranks
from reference import reference_attention
from tolerances import FIXED_LOW, FP32

ops = torch.ops.cpattn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_dot_matches_reference(dtype, gen) -> None:
    a, b = (randn((2, 37, 3, 24), gen, dtype) for _ in range(2))
    got = ops.row_dot(a, b)
    want = torch.einsum("bshd,bshd->bhs", a.double(), b.double())
    assert got.dtype == torch.float32 and got.shape == (2, 3, 37)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_from_row_dot_is_the_backward_from_out(dtype, with_dlse, gen) -> None:
    """delta = row_dot - dlse either way: the same bits (every option that reaches the kernel)."""
    q, k, v = make_qkv(gen, 2, 45, 45, 4, 2, 32, dtype)
    slopes = torch.rand(4, generator=gen) * 0.3
    opts = op_options(0.2, True, (7, -1), softcap=3.0, alibi_slopes=slopes, prefix_len=4)
    out, lse = ops.attention_fwd(q, k, v, **opts)
    dout = randn(out.shape, gen, dtype)
    dlse = randn(lse.shape, gen) if with_dlse else None
    from_out = ops.attention_bwd(dout, q, k, v, out, lse, dlse=dlse, **opts)
    from_dot = ops.attention_bwd(dout, q, k, v, None, lse, dlse=dlse,
                                 row_dot=ops.row_dot(dout, out), **opts)
    for name, x, y in zip("qkv", from_out, from_dot):
        assert torch.equal(x, y), f"d{name}"


def _small_problem(gen):
    """q, k, v, out, lse and a random dout of a small causal problem, and its options (by name)."""
    q, k, v = make_qkv(gen, 1, 8, 8, 2, 2, 16)
    opts = op_options(0.25, True)
    out, lse = ops.attention_fwd(q, k, v, **opts)
    return q, k, v, out, lse, randn(out.shape, gen), opts


def test_bad_row_dot_raises(gen) -> None:
    q, k, v, out, lse, dout, opts = _small_problem(gen)
    with pytest.raises(RuntimeError, match="exactly one of out and row_dot, got neither"):
        ops.attention_bwd(dout, q, k, v, None, lse, **opts)
    with pytest.raises(RuntimeError, match="exactly one of out and row_dot, got both"):
        ops.attention_bwd(dout, q, k, v, out, lse, row_dot=ops.row_dot(dout, out), **opts)
    with pytest.raises(RuntimeError, match="row_dot must be float32 with lse's shape"):
        ops.attention_bwd(dout, q, k, v, None, lse, row_dot=lse[:, :, :4], **opts)
    with pytest.raises(RuntimeError, match="row_dot must be float32 with lse's shape"):
        ops.attention_bwd(dout, q, k, v, None, lse, row_dot=lse.double(), **opts)
    with pytest.raises(RuntimeError, match="dlse must have lse's shape"):  # not broadcast
        ops.attention_bwd(dout, q, k, v, None, lse, dlse=lse[:, :, :1],
                          row_dot=ops.row_dot(dout, out), **opts)
    with pytest.raises(RuntimeError, match="row_dot needs a and b of one shape"):
        ops.row_dot(dout, dout[:, :4])


IN_DOUT_CASES = [  # (batch, Sq, Sk, heads, kv heads, D, causal)
    (1, 1100, 1100, 4, 2, 64, True),  # several query chunks, GQA
    (2, 90, 130, 2, 1, 128, False),  # batch 2, more keys than queries
    (1, 70, 20, 3, 3, 40, True),  # rows that see no key; D not a multiple of 16 (fp32: dO copied)
]


@pytest.mark.parametrize("grouped", [False, True], ids=["one_call", "per_kv_head"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", IN_DOUT_CASES, ids=["chunks", "batch2", "empty_rows_d40"])
def test_dq_written_over_dout_is_attention_bwd(case, dtype, grouped, gen, request) -> None:
    """attention_bwd_in_dout: dout afterwards holds attention_bwd's dq and dk, dv are its own,
    bitwise, with every score option and dlse, from out or from row_dot. dout starts as the
    random gradient, so a row left unwritten (or read after being overwritten) differs."""
    if grouped:
        request.getfixturevalue("one_kv_head_per_backward_call")
    b, sq, sk, h, hkv, d, causal = case
    q, k, v = make_qkv(gen, b, sq, sk, h, hkv, d, dtype)
    slopes = torch.rand(h, generator=gen) * 0.3
    opts = op_options(d**-0.5, causal, (300, -1), softcap=2.5, alibi_slopes=slopes, prefix_len=5)
    out, lse = ops.attention_fwd(q, k, v, **opts)
    dout, dlse = randn(out.shape, gen, dtype), randn(lse.shape, gen)
    want = ops.attention_bwd(dout, q, k, v, out, lse, dlse=dlse, **opts)
    assert want[0].abs().sum() > 0
    for given in ("out", "row_dot"):
        mine = dout.clone()
        extra = dict(row_dot=ops.row_dot(dout, out)) if given == "row_dot" else {}
        dk, dv = ops.attention_bwd_in_dout(mine, q, k, v, out if given == "out" else None, lse,
                                           dlse=dlse, **extra, **opts)
        for name, x, y in zip("qkv", (mine, dk, dv), want):
            assert torch.equal(x, y), f"d{name} from {given}"


def test_dq_over_dout_bad_arguments_raise(gen) -> None:
    q, k, v, out, lse, dout, opts = _small_problem(gen)
    with pytest.raises(RuntimeError, match="dout must have q's shape .* and dtype"):
        ops.attention_bwd_in_dout(dout.to(torch.bfloat16), q, k, v, out, lse, **opts)
    v_wide = randn((1, 8, 2, 32), gen)
    out_w, lse_w = ops.attention_fwd(q, k, v_wide, **opts)
    with pytest.raises(RuntimeError, match="dout must have q's shape"):  # Dv != D
        ops.attention_bwd_in_dout(randn(out_w.shape, gen), q, k, v_wide, out_w, lse_w, **opts)
    # dq written over q would corrupt the backward that still reads q
    with pytest.raises(RuntimeError, match="dout must not overlap q"):
        ops.attention_bwd_in_dout(q, q, k, v, out, lse, **opts)
    with pytest.raises(RuntimeError, match="attention_bwd_in_dout needs exactly one of out"):
        ops.attention_bwd_in_dout(dout, q, k, v, None, lse, **opts)
    meta = [t.to("meta") for t in (dout, q, k, v, out, lse)]
    dk, dv = ops.attention_bwd_in_dout(*meta, **opts)
    assert dk.shape == k.shape and dv.shape == v.shape and dk.device.type == "meta"


def _caller_gradient_kept(rank: int, world: int) -> None:
    """dq goes over Ulysses' own dout by heads, never over the caller's gradient (on one rank the
    all-to-all returns it as it is)."""
    torch.manual_seed(rank)
    q, k, v, g = (torch.randn(1, 16, 4, 16, requires_grad=i < 3) for i in range(4))
    kept = g.clone()
    cpattn.ulysses_attention(q, k, v, causal=True).backward(g)
    assert torch.equal(g, kept) and q.grad.abs().sum() > 0


@pytest.mark.parametrize("world", [1, 2])
def test_caller_gradient_is_not_overwritten(world: int) -> None:
    run_ranks(world, _caller_gradient_kept)


def _through_out_and_lse(rank: int, world: int, dtype: torch.dtype) -> None:
    """A loss on out and the LSE together (dlse flows), or on the LSE alone, every score option,
    any length."""
    h, d = 6, 16
    tol = FP32 if dtype == torch.float32 else FIXED_LOW
    for n, hkv in enumerate([6, 2, 1]):  # W = 3 replicates 2 KV heads before the all-to-all
        seqlen = 4 * world + n  # padding rows when n > 0
        torch.manual_seed(900 + 10 * world + n)
        q, k, v, g_out = (torch.randn(1, seqlen, heads, d).to(dtype)
                          for heads in (h, hkv, hkv, h))
        g_lse = torch.randn(1, h, seqlen)
        only_lse = n == 2  # out unused: its gradient is None in the backward
        if only_lse:
            g_out.zero_()
        sinks = (torch.randn(h) * 2).requires_grad_()
        opts = dict(causal=True, window=(9, -1), softcap=4.0, prefix_len=3,
                    alibi_slopes=torch.rand(h) * 0.3 + 0.01)

        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks.detach().double().requires_grad_()
        r_out, r_lse = reference_attention(*ref_in, sinks=ref_sinks, **opts)
        ((r_out * g_out.double()).sum() + (r_lse * g_lse.double()).sum()).backward()

        shard = lambda t, dim=1: cpattn.shard(t, layout="contiguous", dim=dim)  # noqa: E731
        unshard = lambda t, dim=1: cpattn.unshard(  # noqa: E731
            t, layout="contiguous", dim=dim, seqlen=seqlen)
        shards = [shard(t).requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ulysses_attention(*shards, return_lse=True, sinks=sinks,
                                            seqlen=seqlen, **opts)
        loss = (lse * shard(g_lse, 2)).sum()
        (loss if only_lse else loss + (out * shard(g_out)).sum()).backward()

        what = f"W={world} kv heads {hkv} S={seqlen} {dtype}"
        torch.testing.assert_close(unshard(out.detach()).double(), r_out.detach(), atol=tol,
                                   rtol=tol, msg=lambda m: f"out {what}: {m}")
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks)
        pairs = [(f"d{name}", unshard(s.grad), r.grad) for name, s, r in zip("qkv", shards,
                                                                             ref_in)]
        for name, got, want in pairs + [("dsinks", dsinks, ref_sinks.grad)]:
            scale = max(1.0, want.abs().max().item())
            torch.testing.assert_close(got.double(), want, atol=5 * tol * scale, rtol=5 * tol,
                                       msg=lambda m: f"{name} {what}: {m}")


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_through_out_and_lse(world: int) -> None:
    run_ranks(world, _through_out_and_lse, torch.float32)


def test_gradients_through_out_and_lse_bf16() -> None:
    run_ranks(2, _through_out_and_lse, torch.bfloat16)
