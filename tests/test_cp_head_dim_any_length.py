"""d_v != d_qk (MLA-style) under ring / all-gather / hybrid, any sequence length under Ulysses and
hybrid, and a prefix-LM length per document under ring_attention_varlen: on real gloo ranks,
against the float64 single-process reference on the full sequence (forward, LSE and every
gradient, the sinks' summed over ranks), with the padding rows checked exactly."""

import itertools

import pytest
import torch
import torch.distributed as dist

import cpattn

from distributed import run_ranks
from reference import compare_sharded, reference_attention

LAYOUTS = ["contiguous", "zigzag", "striped"]


def _options(heads: int, every: bool) -> dict:
    """Every score option (per-head values drawn from the current seed), or none."""
    if not every:
        return {}
    return {"sinks": torch.randn(heads) * 2, "softcap": 4.0,
            "alibi_slopes": torch.rand(heads) * 0.3 + 0.01, "prefix_len": 5}


def _head_dim_v(rank: int, world: int, dtypes: tuple) -> None:
    """Ring and all-gather with v's own head dim, every layout, GQA, with and without every
    score option; the shards' length may be any (seqlen=)."""
    h, hkv, d, dv = 4, 2, 16, 8
    cases = itertools.product(LAYOUTS, ["ring", "allgather"], [False, True], dtypes)
    for n, (layout, strategy, every, dtype) in enumerate(cases):
        seqlen = 2 * world * 3 + (n % 3)  # any length: r = 0, 1, 2
        torch.manual_seed(500 + 10 * world + n)
        full = tuple(torch.randn(1, seqlen, heads, dim).to(dtype)
                     for heads, dim in ((h, d), (hkv, d), (hkv, dv), (h, dv)))
        kwargs = _options(h, every)
        pos = cpattn.positions(seqlen, layout=layout)

        def run(*a, **kw):
            return cpattn.ring_attention(*a, **kw, layout=layout, strategy=strategy,
                                         allgather_chunk=1, seqlen=seqlen)

        compare_sharded(f"W={world} {layout} {strategy} options={every} S={seqlen} {dtype}", run,
                        lambda t: cpattn.shard(t, layout=layout),
                        lambda t, dim=1: cpattn.unshard(t, layout=layout, dim=dim, seqlen=seqlen),
                        pos, full, True, (9, -1), kwargs)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_head_dim_v_ring_and_allgather(world: int) -> None:
    run_ranks(world, _head_dim_v, (torch.float32,))


def test_head_dim_v_bf16() -> None:
    run_ranks(2, _head_dim_v, (torch.bfloat16,))


def _mla_shape(rank: int, world: int) -> None:
    """The MLA head dims (d_qk 192, d_v 128) under the zigzag ring, GQA, bidirectional."""
    torch.manual_seed(7)
    seqlen = 4 * world + 1
    full = tuple(torch.randn(1, seqlen, heads, dim)
                 for heads, dim in ((4, 192), (2, 192), (2, 128), (4, 128)))
    pos = cpattn.positions(seqlen, layout="zigzag")
    compare_sharded(f"MLA W={world}",
                    lambda *a, **kw: cpattn.ring_attention(*a, **kw, seqlen=seqlen),
                    lambda t: cpattn.shard(t, layout="zigzag"),
                    lambda t, dim=1: cpattn.unshard(t, layout="zigzag", dim=dim, seqlen=seqlen),
                    pos, full, False, (-1, -1), {"sinks": torch.randn(4)})


def test_mla_head_dims() -> None:
    run_ranks(2, _mla_shape)


def _ulysses_hybrid_any_length(rank: int, world: int) -> None:
    """Ulysses (W=4) and hybrid (U=2 x R=2, every ring layout) at S = 2W k + r for several r,
    v's head dim equal or not, with and without every option."""
    from test_strategies import _hybrid_groups

    ug, rg = _hybrid_groups(world, 2)
    h, hkv, d = 4, 2, 16
    cases = [("ulysses", "contiguous")] + [("hybrid", layout) for layout in LAYOUTS]
    for n, ((strategy, layout), r, dv) in enumerate(
        itertools.product(cases, [0, 1, 3, 2 * world - 1], [16, 8])
    ):
        seqlen, every = 2 * world * 2 + r, n % 2 == 1
        torch.manual_seed(700 + n)
        full = tuple(torch.randn(1, seqlen, heads, dim)
                     for heads, dim in ((h, d), (hkv, d), (hkv, dv), (h, dv)))
        kwargs = _options(h, every)
        if strategy == "ulysses":
            pos = cpattn.positions(seqlen, layout="contiguous")

            def shard(t):
                return cpattn.shard(t, layout="contiguous")

            def unshard(t, dim=1):
                return cpattn.unshard(t, layout="contiguous", dim=dim, seqlen=seqlen)

            def run(*a, **kw):
                return cpattn.ulysses_attention(*a, **kw, seqlen=seqlen)
        else:
            groups = {"ulysses_group": ug, "ring_group": rg, "layout": layout}
            pos = cpattn.hybrid_positions(seqlen, **groups)

            def shard(t):
                return cpattn.hybrid_shard(t, **groups)

            def unshard(t, dim=1):
                return cpattn.hybrid_unshard(t, dim=dim, seqlen=seqlen, **groups)

            def run(*a, **kw):
                return cpattn.hybrid_attention(*a, **kw, **groups, seqlen=seqlen)
        compare_sharded(f"{strategy} {layout} S={seqlen} dv={dv} options={every}", run, shard,
                        unshard, pos, full, True, (-1, -1) if every else (6, -1), kwargs)
    # a seqlen the shards do not hold raises on every rank, and the groups stay usable
    q = torch.randn(1, 3, h, d)
    with pytest.raises(ValueError, match=r"ulysses_attention: seqlen=20: gives head shards of 20"):
        cpattn.ulysses_attention(q, q[:, :, :hkv], q[:, :, :hkv], seqlen=20)
    with pytest.raises(ValueError, match=r"hybrid_attention: seqlen=3: gives"):
        cpattn.hybrid_attention(q, q[:, :, :hkv], q[:, :, :hkv], ulysses_group=ug, ring_group=rg,
                                seqlen=3)
    cpattn.ulysses_attention(q, q[:, :, :hkv], q[:, :, :hkv], seqlen=10)


def test_ulysses_and_hybrid_any_length() -> None:
    run_ranks(4, _ulysses_hybrid_any_length)


def _prefix_per_document(rank: int, world: int) -> None:
    """ring_attention_varlen with one prefix-LM length per document (and v's own head dim, every
    other option), ring and all-gather, every layout; validation of the per-document tensor."""
    cu = torch.tensor([0, 13, 14, 40, 47])
    prefixes = torch.tensor([4, 0, 26, 2])  # a prefix of a whole document too
    h, hkv, d, dv = 4, 2, 16, 8
    for n, (layout, strategy) in enumerate(itertools.product(LAYOUTS, ["ring", "allgather"])):
        torch.manual_seed(900 + n)
        q, k, v, dout = (torch.randn(47, heads, dim)
                         for heads, dim in ((h, d), (hkv, d), (hkv, dv), (h, dv)))
        sinks = (torch.randn(h) * 2).requires_grad_()
        opts = {"softcap": 5.0, "alibi_slopes": torch.rand(h) * 0.3}
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_sinks = sinks.detach().double().requires_grad_()
        outs, lses = [], []
        for a, b, p in zip(cu[:-1].tolist(), cu[1:].tolist(), prefixes.tolist()):
            o, lse = reference_attention(*(t[None, a:b] for t in ref_leaves), causal=True,
                                         sinks=ref_sinks, prefix_len=p, **opts)
            outs.append(o[0])
            lses.append(lse[0])
        ref_out, ref_lse = torch.cat(outs), torch.cat(lses, dim=1)
        ref_out.backward(dout.double())

        shards = [cpattn.shard_varlen(t, cu, layout=layout).requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ring_attention_varlen(*shards, cu, causal=True, return_lse=True,
                                                layout=layout, strategy=strategy, sinks=sinks,
                                                prefix_len=prefixes, allgather_chunk=1, **opts)
        out.backward(cpattn.shard_varlen(dout, cu, layout=layout))

        def un(t, dim=0):
            return cpattn.unshard_varlen(t, cu, layout=layout, dim=dim)

        what = f"W={world} {layout} {strategy}"
        torch.testing.assert_close(un(out.detach()).double(), ref_out.detach(), atol=2e-5,
                                   rtol=2e-5, msg=lambda m: f"out {what}: {m}")
        torch.testing.assert_close(un(lse.detach(), 1).double(), ref_lse.detach(), atol=2e-5,
                                   rtol=2e-5, msg=lambda m: f"lse {what}: {m}")
        for name, s, r in zip("qkv", shards, ref_leaves):
            torch.testing.assert_close(un(s.grad).double(), r.grad, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"d{name} {what}: {m}")
        dsinks = sinks.grad.clone()
        dist.all_reduce(dsinks)
        torch.testing.assert_close(dsinks.double(), ref_sinks.grad, atol=1e-4, rtol=1e-4)

    # bad per-document prefixes raise on every rank (the same message), the group stays usable
    shards = [cpattn.shard_varlen(torch.randn(47, h, d), cu) for _ in range(3)]
    bad = [
        (prefixes.int(), r"prefix_len.dtype=torch.int32: a prefix per document must be an int64"),
        (prefixes[:3], r"prefix_len.shape=\(3,\): must be \(4,\)"),
        (torch.tensor([4, 2, 0, 0]), (r"prefix_len\[1\]=2: must be between 0 and the "
                                      r"document's length 1")),
        (torch.tensor([4, 0, 0, -1]), r"prefix_len\[3\]=-1"),
    ]
    for prefix, match in bad:
        with pytest.raises(ValueError, match="cpattn.ring_attention_varlen: " + match):
            cpattn.ring_attention_varlen(*shards, cu, causal=True, prefix_len=prefix)
    with pytest.raises(ValueError, match="ranks disagree on prefix_per_document"):
        cpattn.ring_attention_varlen(*shards, cu, causal=True,
                                     prefix_len=torch.tensor([rank, 0, 0, 0]))
    cpattn.ring_attention_varlen(*shards, cu, causal=True, prefix_len=prefixes)


@pytest.mark.parametrize("world", [2, 3])
def test_prefix_per_document(world: int) -> None:
    run_ranks(world, _prefix_per_document)
