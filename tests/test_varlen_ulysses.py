"""Packed documents beyond the ring: cpattn.attention_varlen (one process),
cpattn.ulysses_attention_varlen (all-to-all to heads, then the documents attend locally) and
cpattn.hybrid_attention_varlen (Ulysses inside, the ring across; W = 4 as 2 x 2) against
the float64 reference run per document: out, LSE and every gradient (the sinks' included), on
fresh random inputs with poisoned outputs (CPATTN_POISON in the ranks); padding rows give 0 and
-inf; ranks that disagree on the documents raise on every rank."""

import pytest
import torch
import torch.distributed as dist

import cpattn
import cpattn.sharding.packing

from distributed import run_ranks
from reference import varlen_reference
from tolerances import FP32, expected_of, tolerance

# (causal, window, softcap, sinks, Dv): the options on positions within each document
CASES = [(True, (-1, -1), 0.0, False, 16), (True, (3, 0), 0.0, True, 16),
         (False, (2, 4), 2.0, False, 8), (False, (-1, -1), 0.0, True, 16)]


def _check(what, got, q, k, v, dout, sinks, lengths, causal, window, softcap):
    """got (out, lse, [dq, dk, dv], dsinks or None) against the per-document float64 reference,
    within tests/tolerances.py's bounds (bf16: from torch's own bf16 run of the documents)."""
    args = (q, k, v, dout, lengths, causal, window, sinks, softcap)
    expected = expected_of(*varlen_reference(*args))
    low = None
    if q.dtype != torch.float32:
        low = expected_of(*varlen_reference(*args, compute_dtype=q.dtype))
    tol = tolerance(expected, low)
    got = expected_of(*got)
    for name, want in expected.items():
        tol.check(name, got[name], want, what)


def _problem(seed, lengths, heads, kv_heads, dv, dtype, sinks):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, h, 16, generator=g).to(dtype) for h in (heads, kv_heads))
    v = torch.randn(total, kv_heads, dv, generator=g).to(dtype)
    dout = torch.randn(total, heads, dv, generator=g).to(dtype)
    s = torch.randn(heads, generator=g) if sinks else None
    return q, k, v, dout, s


def test_attention_varlen_matches_reference():
    lengths = [5, 0, 11, 1, 7]
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    for n, (causal, window, softcap, sinks, dv) in enumerate(CASES):
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v, dout, s = _problem(n, lengths, 4, 2, dv, dtype, sinks)
            ins = [t.clone().requires_grad_() for t in (q, k, v)]
            s_in = None if s is None else s.clone().requires_grad_()
            out, lse = cpattn.attention_varlen(*ins, cu, causal=causal, window=window,
                                               softcap=softcap, sinks=s_in, return_lse=True)
            out.backward(dout)
            what = f"attention_varlen {causal} {window} {softcap} sinks={sinks} {dtype}"
            _check(what, (out, lse, [t.grad for t in ins], None if s is None else s_in.grad),
                   q, k, v, dout, s, lengths, causal, window, softcap)
    with pytest.raises(ValueError, match="must end at the"):
        cpattn.attention_varlen(q, k, v, [0, 3])


def _ulysses_cases(rank, world):
    for n, (causal, window, softcap, sinks, dv) in enumerate(CASES):
        dtype = torch.bfloat16 if n == 1 else torch.float32
        lengths = [1, 0, 3 * world + 1, world, 2 * world + 3]
        cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
        q, k, v, dout, s = _problem(200 + n, lengths, 2 * world, world if n % 2 else 1, dv,
                                    dtype, sinks)
        shards = [cpattn.shard_varlen(t, cu, layout="contiguous").requires_grad_()
                  for t in (q, k, v)]
        s_in = None if s is None else s.clone().requires_grad_()
        out, lse = cpattn.ulysses_attention_varlen(*shards, cu, causal=causal, window=window,
                                                   softcap=softcap, sinks=s_in, return_lse=True)
        index, _ = cpattn.positions_varlen(cu, layout="contiguous")
        pad = index < 0
        padded = torch.tensor([int(pad.sum())])
        dist.all_reduce(padded)
        assert padded.item() > 0, "the documents must need padding here (on some rank)"
        assert (out[pad] == 0).all(), "padding rows"
        pad_lse = float("-inf") if s is None else s[:, None].expand(-1, int(pad.sum()))
        assert torch.equal(lse[:, pad], torch.as_tensor(pad_lse).expand_as(lse[:, pad])), "lse"
        out.backward(cpattn.shard_varlen(dout, cu, layout="contiguous"))
        un = lambda t, d=0: cpattn.unshard_varlen(t, cu, layout="contiguous", dim=d)  # noqa: E731
        what = f"ulysses varlen W={world} case {n} {dtype}"
        ds = None
        if s is not None:  # each rank's share, summed over the group
            ds = s_in.grad.clone()
            dist.all_reduce(ds)
        _check(what, (un(out.detach()), un(lse.detach(), 1), [un(t.grad) for t in shards], ds),
               q, k, v, dout, s, lengths, causal, window, softcap)
    # Ranks that disagree on the documents (same token counts) raise on every rank.
    t = torch.randn(4 * world, 2 * world, 16)
    cu = [0, 2 * world, 4 * world] if rank == 0 else [0, world, 4 * world]
    with pytest.raises(ValueError, match="document_lengths"):
        cpattn.ulysses_attention_varlen(t, t[:, :2], t[:, :2], cu)


@pytest.mark.parametrize("world", [2, 3])
def test_ulysses_varlen_matches_reference(world):
    run_ranks(world, _ulysses_cases)


def _hybrid_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    cp = cpattn.ContextParallel(init_device_mesh("cpu", (2, 2)), strategy="hybrid")
    for n, (causal, window, softcap, sinks, dv) in enumerate(CASES):
        lengths = [1, 0, 9, 4, 6]  # per-document zigzag over the 2 ring ranks pads 1, 9 and 6
        cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
        q, k, v, dout, s = _problem(300 + n, lengths, 4, 2 if n % 2 else 1, dv, torch.float32,
                                    sinks)
        docs = cpattn.sharding.packing.Documents(tuple(lengths), (0,) * len(lengths))
        index, _ = cp.document_positions(docs)

        def local(t):
            padded = torch.cat([t, t.new_zeros((1, *t.shape[1:]))])
            return padded[torch.where(index < 0, t.shape[0], index)]

        shards = [local(t).requires_grad_() for t in (q, k, v)]
        s_in = None if s is None else s.clone().requires_grad_()
        out, lse = cpattn.hybrid_attention_varlen(
            *shards, cu, ulysses_group=cp.ulysses_group, ring_group=cp.ring_group,
            causal=causal, window=window, softcap=softcap, sinks=s_in, return_lse=True)
        pad = index < 0
        assert (out[pad] == 0).all(), "padding rows"
        out.backward(local(dout))
        ref_out, ref_lse, ref_grads, ref_ds = varlen_reference(q, k, v, dout, lengths, causal,
                                                               window, s, softcap)
        real = ~pad
        what = f"hybrid varlen case {n}"
        for got, want in ((out, ref_out), *zip((t.grad for t in shards), ref_grads)):
            assert torch.allclose(got[real].double(), want[index[real]], rtol=FP32,
                                  atol=FP32 * want.abs().max()), what
        assert torch.allclose(lse[:, real].double(), ref_lse[:, index[real]], rtol=FP32,
                              atol=FP32), what
        # (each token's dk / dv live on its own rank: the shards' rows are the full gradient's)
        if s is not None:
            ds = s_in.grad.clone()
            dist.all_reduce(ds)
            assert torch.allclose(ds.double(), ref_ds, rtol=FP32,
                                  atol=FP32 * ref_ds.abs().max()), what
    # A shard of the wrong length raises on every rank (before any message).
    t = torch.randn(3, 4, 16)
    with pytest.raises(ValueError, match="q tokens"):
        cpattn.hybrid_attention_varlen(t, t, t, [0, 20], ulysses_group=cp.ulysses_group,
                                       ring_group=cp.ring_group)


def test_hybrid_varlen_matches_reference():
    run_ranks(4, _hybrid_cases)
