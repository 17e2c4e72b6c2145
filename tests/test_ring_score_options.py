"""Score options (sinks, softcap, ALiBi, prefix-LM) under the ring and all-gather strategies on
real gloo ranks, against the float64 single-process reference on the full sequence: forward,
LSE and every gradient, the sinks' summed over ranks (each rank holds its rows' share)."""

import functools
import itertools

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.core.layout import LAYOUTS

from distributed import run_ranks
from reference import compare_sharded, reference_attention

# name -> (causal, window, options); sinks / alibi_slopes: True = per-head values drawn below
CASES = {
    "sinks_window": (True, (5, 0), {"sinks": True}),
    "softcap_causal": (True, (-1, -1), {"softcap": 4.0}),
    "alibi_full": (False, (-1, -1), {"alibi_slopes": True}),
    "prefix_causal": (True, (-1, -1), {"prefix_len": 7}),
    "all": (True, (9, -1), {"sinks": True, "softcap": 3.0, "alibi_slopes": True, "prefix_len": 5}),
}


def _draw(options: dict, heads: int) -> dict:
    kwargs = {}
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(heads) * 2
    if options.get("alibi_slopes"):
        kwargs["alibi_slopes"] = torch.rand(heads) * 0.5 + 0.01
    for key in ("softcap", "prefix_len"):
        if key in options:
            kwargs[key] = options[key]
    return kwargs


def _check(rank: int, world: int, strategy: str, dtypes: tuple, names: tuple = tuple(CASES)
           ) -> None:
    seqlen = 2 * world * 5
    h, hkv = 4, 2
    for n, (layout, name, dtype) in enumerate(itertools.product(LAYOUTS, names, dtypes)):
        causal, window, options = CASES[name]
        torch.manual_seed(100 * world + n)  # the same full tensors and options on every rank
        q, k, v, dout = (torch.randn(1, seqlen, heads, 16).to(dtype) for heads in (h, hkv, hkv, h))
        kwargs = _draw(options, h)
        run = functools.partial(cpattn.ring_attention, layout=layout, strategy=strategy,
                                allgather_chunk=1)
        compare_sharded(f"W={world} {strategy} {layout} {name} {dtype}", run,
                        functools.partial(cpattn.shard, layout=layout),
                        lambda t, dim=1: cpattn.unshard(t, layout=layout, dim=dim),
                        cpattn.positions(seqlen, layout=layout), (q, k, v, dout), causal, window,
                        kwargs, grad_factor=1.0)


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
@pytest.mark.parametrize("world", [2, 3])
def test_options_match_reference(world: int, strategy: str) -> None:
    run_ranks(world, _check, strategy, (torch.float32,))


@pytest.mark.parametrize("world", [1, 4])
def test_all_options_at_once_w1_w4(world: int) -> None:
    """W = 1 and 4 (every layout, both strategies): the case with every option at once."""
    for strategy in ("ring", "allgather"):
        run_ranks(world, _check, strategy, (torch.float32,), ("all",))


def test_options_bf16() -> None:
    run_ranks(2, _check, "ring", (torch.bfloat16,))


def _check_varlen(rank: int, world: int) -> None:
    cu = torch.tensor([0, 13, 14, 40])
    torch.manual_seed(5)
    h, hkv = 4, 2
    q, k, v, dout = (torch.randn(40, heads, 16) for heads in (h, hkv, hkv, h))
    sinks = (torch.randn(h) * 2).requires_grad_()
    slopes = torch.rand(h) * 0.3
    opts = {"softcap": 5.0, "alibi_slopes": slopes, "prefix_len": 4}
    # reference: each document on its own (positions within the document)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_sinks = sinks.detach().double().requires_grad_()
    outs, lses = [], []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o, lse = reference_attention(*(t[None, a:b] for t in ref_leaves), causal=True,
                                     sinks=ref_sinks, **opts)
        outs.append(o[0])
        lses.append(lse[0])
    ref_out, ref_lse = torch.cat(outs), torch.cat(lses, dim=1)
    ref_out.backward(dout.double())

    shards = [cpattn.shard_varlen(t, cu).requires_grad_() for t in (q, k, v)]
    out, lse = cpattn.ring_attention_varlen(*shards, cu, causal=True, return_lse=True,
                                            sinks=sinks, **opts)
    index, _ = cpattn.positions_varlen(cu)
    padding = index < 0
    assert torch.equal(out[padding], torch.zeros_like(out[padding]))
    assert torch.equal(lse[:, padding], sinks.detach()[:, None].expand(h, int(padding.sum())))
    out.backward(cpattn.shard_varlen(dout, cu))
    torch.testing.assert_close(cpattn.unshard_varlen(out.detach(), cu).double(),
                               ref_out.detach(), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cpattn.unshard_varlen(lse.detach(), cu, dim=1).double(),
                               ref_lse.detach(), atol=2e-5, rtol=2e-5)
    for s, r in zip(shards, ref_leaves):
        torch.testing.assert_close(cpattn.unshard_varlen(s.grad, cu).double(), r.grad,
                                   atol=1e-4, rtol=1e-4)
    dsinks = sinks.grad.clone()
    dist.all_reduce(dsinks)
    torch.testing.assert_close(dsinks.double(), ref_sinks.grad, atol=1e-4, rtol=1e-4)


def test_varlen_options() -> None:
    run_ranks(2, _check_varlen)


def _disagree(rank: int, world: int) -> None:
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    with pytest.raises(ValueError, match="ranks disagree on softcap"):
        cpattn.ring_attention(q, k, v, causal=True, softcap=1.0 + rank)
    with pytest.raises(ValueError, match="ranks disagree on sinks"):
        cpattn.ring_attention(q, k, v, causal=True, sinks=torch.full((2,), float(rank)))
    with pytest.raises(ValueError, match=r"\(k.shape, v.shape\).*must be equal but for the head"):
        cpattn.ring_attention(q, k, torch.randn(1, 4, 1, 4), causal=True)
    # the group stays usable
    cpattn.ring_attention(q, k, v, causal=True, prefix_len=3)


def test_ranks_must_agree_on_options() -> None:
    run_ranks(2, _disagree)


def _ulysses_and_hybrid(rank: int, world: int, dtype: torch.dtype) -> None:
    """Ulysses (W=4) and hybrid (U=2 x R=2), each also with head_dim_v != head_dim, with every
    option: per-head sinks and slopes sliced to each rank's heads."""
    from test_strategies import _hybrid_groups

    ug, rg = _hybrid_groups(world, 2)
    seqlen, h, hkv = 24, 4, 2
    for n, (strategy, dv) in enumerate([("ulysses", 16), ("ulysses", 8), ("hybrid", 16),
                                        ("hybrid", 8)]):
        torch.manual_seed(40 + n)
        full = tuple(torch.randn(1, seqlen, heads, d).to(dtype)
                     for heads, d in ((h, 16), (hkv, 16), (hkv, dv), (h, dv)))
        kwargs = {"softcap": 4.0, "alibi_slopes": torch.rand(h) * 0.3, "prefix_len": 5,
                  "sinks": torch.randn(h) * 2}
        if strategy == "ulysses":
            shard = lambda t, d=1: t.chunk(world, dim=d)[rank]  # noqa: E731
            unshard = lambda t, dim=1: cpattn.unshard(t, layout="contiguous", dim=dim)  # noqa: E731
            run = cpattn.ulysses_attention
        else:
            kw = {"ulysses_group": ug, "ring_group": rg, "layout": "zigzag"}
            shard = lambda t, d=1: cpattn.hybrid_shard(t, dim=d, **kw)  # noqa: E731
            unshard = lambda t, dim=1: cpattn.hybrid_unshard(t, dim=dim, **kw)  # noqa: E731
            run = functools.partial(cpattn.hybrid_attention, **kw)
        compare_sharded(f"{strategy} dv={dv} {dtype}", run, shard, unshard,
                        torch.zeros(seqlen // world, dtype=torch.int64), full, True, (11, -1),
                        kwargs, grad_factor=5.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ulysses_and_hybrid_options(dtype: torch.dtype) -> None:
    run_ranks(4, _ulysses_and_hybrid, dtype)


def _prefill_decode_sinks(rank: int, world: int) -> None:
    """Prefill and decode with sinks: each row's sink joins once after the W partials (and the
    cached tokens' partials) are merged, for both decode merges."""
    torch.manual_seed(9)
    h, hkv, chunk = 6, 3, 4 * world
    total = chunk + 3
    q, k, v = (torch.randn(1, total, heads, 16) for heads in (h, hkv, hkv))
    sinks = torch.randn(h) * 2
    r_out, r_lse = reference_attention(q, k, v, causal=True, sinks=sinks)
    cache = cpattn.KVCacheShard(1, total, hkv, 16, interleave=3)
    pos = cpattn.positions(chunk, layout="zigzag")
    out, lse = cpattn.prefill_attention(*(t[:, pos] for t in (q, k, v)), cache, layout="zigzag",
                                        return_lse=True, sinks=sinks)
    torch.testing.assert_close(out.double(), r_out[:, pos], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), r_lse[:, :, pos], atol=2e-5, rtol=2e-5)
    start = chunk
    for sq in (2, 1):
        new = slice(start, start + sq)
        cache.append(k[:, new], v[:, new])
        for comm in ("all_gather", "reduce_scatter"):
            out, lse = cpattn.decode_attention(q[:, new], cache, comm=comm, return_lse=True,
                                               sinks=sinks)
            heads = slice(None) if comm == "all_gather" else slice(rank * h // world,
                                                                   (rank + 1) * h // world)
            torch.testing.assert_close(out.double(), r_out[:, new, heads], atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(lse.double(), r_lse[:, heads, new], atol=2e-5, rtol=2e-5)
        start += sq


@pytest.mark.parametrize("world", [1, 3])
def test_prefill_and_decode_with_sinks(world: int) -> None:
    run_ranks(world, _prefill_decode_sinks)


def _any_length(rank: int, world: int) -> None:
    """S = 2W k + r for several r: shard pads at the end, ring / all-gather with seqlen= give
    padding rows exactly 0 / -inf and the reference elsewhere, unshard returns S tokens."""
    for n, (layout, r, strategy) in enumerate(
        itertools.product(LAYOUTS, [1, world + 1, 2 * world - 1], ["ring", "allgather"])
    ):
        seqlen = 2 * world * 3 + r
        torch.manual_seed(300 + n)
        q, k, v, dout = (torch.randn(2, seqlen, heads, 16) for heads in (4, 2, 2, 4))
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference_attention(*ref_leaves, causal=True, window=(7, -1))
        ref_out.backward(dout.double())
        pos = cpattn.positions(seqlen, layout=layout)
        shards = [cpattn.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
        assert shards[0].shape[1] == pos.numel()
        out, lse = cpattn.ring_attention(*shards, causal=True, window=(7, -1), layout=layout,
                                         return_lse=True, strategy=strategy, seqlen=seqlen)
        padding = pos < 0
        assert torch.equal(out[:, padding], torch.zeros_like(out[:, padding]))
        assert bool((lse[:, :, padding] == float("-inf")).all())
        out.backward(cpattn.shard(dout, layout=layout))
        un = lambda t, d=1: cpattn.unshard(t, layout=layout, dim=d, seqlen=seqlen)  # noqa: E731
        what = f"W={world} {layout} S={seqlen} {strategy}"
        full = un(out.detach())
        assert full.shape[1] == seqlen, what
        torch.testing.assert_close(full.double(), ref_out.detach(), atol=2e-5, rtol=2e-5,
                                   msg=lambda m: f"out {what}: {m}")
        torch.testing.assert_close(un(lse.detach(), 2).double(), ref_lse.detach(), atol=2e-5,
                                   rtol=2e-5, msg=lambda m: f"lse {what}: {m}")
        for s, ref in zip(shards, ref_leaves):
            torch.testing.assert_close(un(s.grad).double(), ref.grad, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"grad {what}: {m}")
    with pytest.raises(ValueError, match="gives shards of"):
        cpattn.ring_attention(*(torch.randn(1, 3, 2, 8) for _ in range(3)), seqlen=100)


@pytest.mark.parametrize("world", [2, 3])
def test_any_length(world: int) -> None:
    run_ranks(world, _any_length)


def _prefix_per_sequence(rank: int, world: int) -> None:
    """prefix_len as one value per sequence of a batch (ring and all-gather, every layout, with
    sinks, ALiBi and a window; a padded length too): each sequence against the reference with
    its own prefix, forward, LSE and every gradient; bad tensors raise on every rank."""
    h, hkv = 4, 2
    for n, (layout, strategy, extra) in enumerate(
        itertools.product(LAYOUTS, ["ring", "allgather"], [0, world + 1])
    ):
        seqlen = 2 * world * 3 + extra  # extra > 0: any length (padded shards, seqlen=)
        torch.manual_seed(500 + n)
        full = tuple(torch.randn(3, seqlen, heads, 16) for heads in (h, hkv, hkv, h))
        kwargs = {"prefix_len": torch.tensor([0, 5, seqlen]),  # none, part, all of a sequence
                  "sinks": torch.randn(h) * 2, "alibi_slopes": torch.rand(h) * 0.3}
        run = functools.partial(cpattn.ring_attention, layout=layout, strategy=strategy,
                                seqlen=seqlen)
        compare_sharded(f"W={world} {strategy} {layout} S={seqlen}", run,
                        functools.partial(cpattn.shard, layout=layout),
                        lambda t, dim=1: cpattn.unshard(t, layout=layout, dim=dim, seqlen=seqlen),
                        cpattn.positions(seqlen, layout=layout), full, True, (6, -1), kwargs,
                        grad_factor=5.0)
    q = torch.randn(2, 4, 2, 8)
    for prefix, match in [
        (torch.tensor([1, 2, 3]), r"prefix_len.shape=\(3,\): must be \(2,\): one prefix per "
                                  r"sequence of the batch"),
        (torch.tensor([1.0, 2.0]), r"prefix_len.dtype=torch.float32: a prefix per sequence"),
        (torch.tensor([1, 4 * world + 1]), r"prefix_len\[1\]=.*between 0 and the sequence's"),
    ]:
        with pytest.raises(ValueError, match=match):
            cpattn.ring_attention(q, q, q, causal=True, prefix_len=prefix)
    with pytest.raises(ValueError, match="ranks disagree on prefix_per_sequence"):
        cpattn.ring_attention(q, q, q, causal=True, prefix_len=torch.tensor([1, rank]))
    cpattn.ring_attention(q, q, q, causal=True, prefix_len=torch.tensor([1, 2]))  # still usable


@pytest.mark.parametrize("world", [2, 3])
def test_prefix_per_sequence_of_a_batch(world: int) -> None:
    run_ranks(world, _prefix_per_sequence)


def _tensor_prefix_refused(rank: int, world: int) -> None:
    """Only ring_attention (ring / all-gather) takes a prefix per sequence: every other entry
    point refuses a tensor prefix_len on every rank with a message naming the argument, never
    reading it as a number or dropping it."""
    from test_strategies import _hybrid_groups

    ug, rg = _hybrid_groups(world, 2)
    prefix = torch.tensor([3])
    q = torch.randn(1, 2 * world, 4, 8)
    cache = cpattn.KVCacheShard(1, 4 * world, 4, 8)
    calls = {
        "attention": lambda: cpattn.attention(q, q, q, causal=True, prefix_len=prefix),
        "ulysses_attention": lambda: cpattn.ulysses_attention(q, q, q, causal=True,
                                                              prefix_len=prefix),
        "hybrid_attention": lambda: cpattn.hybrid_attention(
            q, q, q, causal=True, prefix_len=prefix, ulysses_group=ug, ring_group=rg),
        "prefill_attention": lambda: cpattn.prefill_attention(q, q, q, cache, prefix_len=prefix),
        "decode_attention": lambda: cpattn.decode_attention(q[:, :1], cache, prefix_len=prefix),
    }
    for call in calls.values():  # a failure's traceback shows the call's line
        with pytest.raises(ValueError, match=r"prefix_len=tensor\(shape=\(1,\).*must be an int"):
            call()
    # nothing was left half-done: every strategy still runs
    torch.testing.assert_close(cpattn.ulysses_attention(q, q, q, causal=True, prefix_len=3),
                               cpattn.ulysses_attention(q, q, q, causal=True, prefix_len=3))


def test_tensor_prefix_refused_where_not_supported() -> None:
    run_ranks(4, _tensor_prefix_refused)
