"""The ring in passes of a few KV heads (ring_attention(ring_chunk=c)): every pass is the ring of
its heads, results written pass by pass. Against the float64 reference on the full sequence, with
every score option (per-head sinks and slopes sliced to each pass), GQA, a head dim of v of its
own, uneven passes (c not dividing the KV heads), varlen and bf16; and the argument's errors."""

import functools
import itertools

import pytest
import torch

import cpattn

from distributed import run_ranks
from reference import compare_sharded


def _passes(rank: int, world: int) -> None:
    seqlen, h, hkv = 4 * world * 3, 6, 3
    cases = itertools.product(["zigzag", "striped"], [1, 2], [16, 8],
                              [torch.float32, torch.bfloat16])
    for n, (layout, chunk, dv, dtype) in enumerate(cases):
        if dtype == torch.bfloat16 and (layout, dv) != ("zigzag", 16):
            continue
        torch.manual_seed(70 + n)  # the same full tensors and options on every rank
        full = tuple(torch.randn(2, seqlen, heads, d).to(dtype)
                     for heads, d in ((h, 16), (hkv, 16), (hkv, dv), (h, dv)))
        kwargs = {"sinks": torch.randn(h) * 2, "alibi_slopes": torch.rand(h) * 0.3,
                  "softcap": 4.0, "prefix_len": 5}
        run = functools.partial(cpattn.ring_attention, layout=layout, ring_chunk=chunk)
        compare_sharded(f"W={world} {layout} chunk={chunk} dv={dv} {dtype}", run,
                        functools.partial(cpattn.shard, layout=layout),
                        lambda t, dim=1: cpattn.unshard(t, layout=layout, dim=dim),
                        cpattn.positions(seqlen, layout=layout), full, True, (9, -1), kwargs,
                        grad_factor=5.0)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_in_passes_matches_reference(world: int) -> None:
    run_ranks(world, _passes)


def _as_one_pass(rank: int, world: int) -> None:
    """A pass computes what the one-pass ring computes for its heads (to rounding: the kernel's
    split of the key blocks may differ with the number of KV heads it is given)."""
    torch.manual_seed(5)
    q, k, v, dout = (cpattn.shard(torch.randn(1, 8 * world, heads, 16))
                     for heads in (8, 4, 4, 8))
    results = []
    for chunk in (None, 1, 3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ring_attention(*leaves, causal=True, return_lse=True, ring_chunk=chunk)
        out.backward(dout)
        results.append([out, lse, *(t.grad for t in leaves)])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_passes_match_one_pass() -> None:
    run_ranks(2, _as_one_pass)


def _varlen(rank: int, world: int) -> None:
    torch.manual_seed(11)
    cu = torch.tensor([0, 7, 7, 30, 41])
    q, k, v, dout = (torch.randn(41, heads, 16) for heads in (4, 2, 2, 4))
    expect, got = [], []
    for chunk, sink in ((None, expect), (1, got)):
        leaves = [cpattn.shard_varlen(t, cu).requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ring_attention_varlen(*leaves, cu, causal=True, return_lse=True,
                                                ring_chunk=chunk, window=(6, 0))
        out.backward(cpattn.shard_varlen(dout, cu))
        sink += [out, lse, *(t.grad for t in leaves)]
    for a, b in zip(expect, got):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_varlen_in_passes() -> None:
    run_ranks(2, _varlen)


def _bad_chunk(rank: int, world: int) -> None:
    q = torch.randn(1, 8, 2, 8)
    for chunk in (0, -1):
        with pytest.raises(ValueError, match=rf"ring_chunk={chunk}: must be >= 1"):
            cpattn.ring_attention(q, q, q, ring_chunk=chunk)
    with pytest.raises(ValueError, match="ring_chunk=1.5: must be an int"):
        cpattn.ring_attention(q, q, q, ring_chunk=1.5)
    with pytest.raises(ValueError, match='ring_chunk=1: sets the passes of strategy "ring"'):
        cpattn.ring_attention(q, q, q, strategy="allgather", ring_chunk=1)  # never ignored
    with pytest.raises(ValueError, match="ranks disagree on ring_chunk"):
        cpattn.ring_attention(q, q, q, ring_chunk=1 + rank)
    cpattn.ring_attention(q, q, q, ring_chunk=1)  # the group stays usable


def test_bad_ring_chunk_raises_on_every_rank() -> None:
    run_ranks(2, _bad_chunk)


def _auto_takes_the_passes(rank: int, world: int) -> None:
    """strategy="auto" runs the ring in the passes the planner chose (short of memory), and
    ContextParallel (the transformers integration's settings) passes ring_chunk on."""
    from cpattn import plan
    from cpattn.strategies import ring

    chosen = plan.Prediction(plan.Candidate("ring", "zigzag", chunk=1), 0.0, 0.0, 0.0, 0.0, 0.0)
    seen = []
    apply = ring.RingAttention.apply
    plan.choose = lambda *args, **kwargs: chosen
    # apply(q, k, v, sinks, options, group_name, layout_code, timeout, docs, group_size)
    ring.RingAttention.apply = lambda *args: seen.append(args[-1]) or apply(*args)
    torch.manual_seed(3)
    q, k, v = (cpattn.shard(torch.randn(1, 8 * world, h, 16)) for h in (4, 2, 2))
    out = cpattn.ring_attention(q, k, v, causal=True, strategy="auto")
    assert seen == [1]  # ring_chunk=1: two passes of one KV head
    cpattn.ContextParallel(strategy="ring", ring_chunk=1).attention(q, k, v, causal=True)
    cpattn.ring_attention(q, k, v, causal=True)
    assert seen == [1, 1, 2]  # then one pass of both: the default
    torch.testing.assert_close(out, cpattn.ring_attention(q, k, v, causal=True), atol=1e-6,
                               rtol=1e-5)


def test_auto_takes_the_planned_passes() -> None:
    run_ranks(2, _auto_takes_the_passes)
