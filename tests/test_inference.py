"""Inference with context parallelism on real ranks (spawned processes, gloo): chunked prefill
into a sharded KV cache and decode steps over it against the float64 reference on the full
sequences, for every W <= 4, layout, interleave, Sq, GQA and dtype; bad inputs raise on every
rank; greedy generation of a tiny transformer matches single-process generation token for token."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.cli.generate_demo import (
    TinyDecoder,
    generate_reference,
    generate_sharded,
    make_prompts,
)
from cpattn.core.layout import LAYOUTS

from conftest import assert_close_fp32, assert_close_low_out
from distributed import run_ranks
from reference import reference_attention

INTERLEAVES = [1, 3, 16]
HEADS = [(4, 4), (4, 2)]  # MHA and GQA (x3 for W = 3: comm="reduce_scatter" splits heads)
DTYPES = [torch.float32, torch.bfloat16]
TIMEOUT = 60


def _check_prefill_decode(rank: int, world: int) -> None:
    cases = itertools.product(LAYOUTS, INTERLEAVES, HEADS, DTYPES)
    for n, (layout, interleave, (h, hkv), dtype) in enumerate(cases):
        if world == 3:
            h, hkv = 3 * h, 3 * hkv
        torch.manual_seed(100 * world + n)  # the same full tensors on every rank
        g = (2 if layout == "zigzag" else 1) * world
        chunks = [[2 * g, g], [g], []]  # chunked prefill, one chunk, none (decode only)
        steps = [3, 1]  # decode Sq: speculative / prompt tail, then one token
        lengths = [sum(c) + sum(steps) for c in chunks]
        total = max(lengths)
        q = torch.randn(3, total, h, 16).to(dtype)
        k = torch.randn(3, total, hkv, 16).to(dtype)
        v = torch.randn(3, total, hkv, 16).to(dtype)
        refs = [reference_attention(q[b:b + 1, :m], k[b:b + 1, :m], v[b:b + 1, :m], causal=True)
                for b, m in enumerate(lengths)]
        # torch's own error in the low dtype: the bound for bf16 outputs (bf16 dot products)
        bases = [reference_attention(q[b:b + 1, :m], k[b:b + 1, :m], v[b:b + 1, :m], causal=True,
                                     compute_dtype=dtype)[0] for b, m in enumerate(lengths)]
        what = f"W={world} {layout} I={interleave} heads={h}/{hkv} {dtype}"
        cache = cpattn.KVCacheShard(3, total + 2, hkv, 16, interleave=interleave, dtype=dtype)

        for b, sizes in enumerate(chunks):
            view, start = cache.sequences(b, b + 1), 0
            for size in sizes:
                pos = cpattn.positions(size, layout=layout)
                assert torch.equal(cpattn.chunk_positions(view, size, layout=layout)[0],
                                   start + pos)
                local = [t[b:b + 1, start + pos] for t in (q, k, v)]
                out, lse = cpattn.prefill_attention(*local, view, layout=layout,
                                                    return_lse=True, timeout=TIMEOUT)
                r_out, r_lse = refs[b]
                assert out.dtype == dtype and out.shape == local[0].shape, what
                assert_close_low_out(out, r_out[:, start + pos], bases[b][:, start + pos], dtype,
                                     f"prefill out {what}")
                assert_close_fp32(lse, r_lse[:, :, start + pos], f"prefill lse {what}")
                start += size
        assert cache.lengths.tolist() == [sum(c) for c in chunks]

        for sq in steps:
            idx = torch.stack([int(m) + torch.arange(sq) for m in cache.lengths])  # (B, Sq)
            pick = [t[torch.arange(3)[:, None], idx] for t in (q, k, v)]
            cache.append(pick[1], pick[2])
            for comm in ("all_gather", "reduce_scatter"):
                out, lse = cpattn.decode_attention(pick[0], cache, comm=comm, return_lse=True,
                                                   timeout=TIMEOUT)
                heads = slice(None) if comm == "all_gather" else slice(
                    rank * h // world, (rank + 1) * h // world)
                for b, (r_out, r_lse) in enumerate(refs):
                    rows = idx[b]
                    assert_close_low_out(out[b:b + 1], r_out[:, rows][:, :, heads],
                                         bases[b][:, rows][:, :, heads], dtype,
                                         f"decode out {comm} Sq={sq} seq {b} {what}")
                    assert_close_fp32(lse[b:b + 1], r_lse[:, heads][:, :, rows],
                                      f"decode lse {comm} Sq={sq} seq {b} {what}")
                unchecked = cpattn.decode_attention(pick[0], cache, comm=comm, validate=False,
                                                    timeout=TIMEOUT)
                assert torch.equal(unchecked, out), f"validate=False changes nothing: {what}"
                if comm == "all_gather":  # replicated: bitwise the same on every rank
                    mine = out.float()
                    gathered = [torch.empty_like(mine) for _ in range(world)]
                    dist.all_gather(gathered, mine)
                    assert all(torch.equal(x, mine) for x in gathered), what
        assert cache.lengths.tolist() == lengths
        # About 1/W of every sequence is stored here.
        local = cache.local_lengths()
        total_local = torch.zeros_like(local)
        dist.all_reduce(total_local.copy_(local))
        assert total_local.tolist() == lengths


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_prefill_and_decode_match_reference(world: int) -> None:
    run_ranks(world, _check_prefill_decode)


# ---------------------------------------------------------------------------------------------
# Bad inputs raise on every rank (a rank that did not raise would go on to the barrier alone,
# and the test would fail on the timeout instead)


def _check_errors(rank: int, world: int) -> None:
    kw = dict(timeout=TIMEOUT)
    x = torch.randn(1, 4, 4, 8)

    cache = cpattn.KVCacheShard(1, 8, 2, 8)
    cache.append(x[:, :, :2], x[:, :, :2])
    with pytest.raises(ValueError, match="capacity exceeded: sequence 0 holds 4 tokens, 6 more"):
        cache.append(torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8))
    chunk = torch.randn(1, 6 // world * 2, 4, 8)  # 12 tokens after 4: over the capacity of 8
    with pytest.raises(ValueError, match="capacity exceeded"):
        cpattn.prefill_attention(chunk, chunk[:, :, :2], chunk[:, :, :2], cache, layout="zigzag",
                                 **kw)
    assert cache.lengths.tolist() == [4]

    # Ranks that disagree: interleave, lengths, query shape, options.
    odd = cpattn.KVCacheShard(1, 8, 2, 8, interleave=1 + rank % 2)
    with pytest.raises(ValueError, match="ranks disagree on cache.interleave"):
        cpattn.decode_attention(x[:, :1], odd, **kw)
    lagging = cpattn.KVCacheShard(1, 8, 2, 8)
    lagging.append(*(torch.randn(1, 1 + rank % 2, 2, 8),) * 2)
    with pytest.raises(ValueError, match="ranks disagree on cache.lengths"):
        cpattn.decode_attention(x[:, :1], lagging, **kw)
    with pytest.raises(ValueError, match="ranks disagree on q.seqlen"):
        cpattn.decode_attention(x[:, :1 + rank % 2], cache, **kw)
    with pytest.raises(ValueError, match="ranks disagree on comm"):
        cpattn.decode_attention(x[:, :1], cache, comm=["all_gather", "reduce_scatter"][rank % 2],
                                **kw)
    with pytest.raises(ValueError, match="ranks disagree on layout"):
        cpattn.prefill_attention(x[:, :2], x[:, :2, :2], x[:, :2, :2], cpattn.KVCacheShard(
            1, 64, 2, 8), layout=["zigzag", "striped"][rank % 2], **kw)

    # A cache that does not belong to this rank / group.
    foreign = cpattn.KVCacheShard(1, 8, 2, 8, rank=rank, world_size=world + 1)
    with pytest.raises(ValueError, match=f"made for rank {rank} of {world + 1}"):
        cpattn.decode_attention(x[:, :1], foreign, **kw)
    swapped = cpattn.KVCacheShard(1, 8, 2, 8, rank=(rank + 1) % world, world_size=world)
    with pytest.raises(ValueError, match="made for rank"):
        cpattn.decode_attention(x[:, :1], swapped, **kw)

    # Inputs that are wrong the same way everywhere.
    with pytest.raises(ValueError, match="fewer than the 5 queries: append"):
        cpattn.decode_attention(torch.randn(1, 5, 4, 8), cache, **kw)
    uneven = torch.randn(1, 1, world + 1, 8)  # heads not a multiple of W
    with pytest.raises(ValueError, match="heads must be a multiple of the world size"):
        cpattn.decode_attention(uneven, _filled(1, 8), comm="reduce_scatter", **kw)
    with pytest.raises(ValueError, match="q must have the cache's dtype"):
        cpattn.decode_attention(x[:, :1].bfloat16(), cache, **kw)
    with pytest.raises(ValueError, match="zigzag layout needs a chunk length that is a multiple"):
        one = torch.randn(1, 1, 4, 8)
        cpattn.prefill_attention(one, one[:, :, :2], one[:, :, :2], cpattn.KVCacheShard(
            1, 64, 2, 8), layout="zigzag", **kw)
    with pytest.raises(ValueError, match="comm=.ring.: must be one of"):
        cpattn.decode_attention(x[:, :1], cache, comm="ring", **kw)
    dist.barrier()


def _filled(kv_heads: int, head_dim: int) -> cpattn.KVCacheShard:
    c = cpattn.KVCacheShard(1, 8, kv_heads, head_dim)
    c.append(torch.ones(1, 2, kv_heads, head_dim), torch.ones(1, 2, kv_heads, head_dim))
    return c


@pytest.mark.parametrize("world", [2, 3])
def test_bad_inputs_raise_on_every_rank(world: int) -> None:
    run_ranks(world, _check_errors)


# ---------------------------------------------------------------------------------------------
# End to end: greedy generation


def _check_generation(rank: int, world: int) -> None:
    model = TinyDecoder()
    prompts = make_prompts([29, 3, 50, 17], model.cfg.vocab)
    reference, gap = generate_reference(model, prompts, steps=10)
    assert gap > 1e-3  # the greedy choices are not fp32 coin flips
    runs = [(1, "zigzag", "all_gather"), (16, "zigzag", "reduce_scatter"),
            (16, "contiguous", "all_gather"), (1, "striped", "reduce_scatter")]
    for interleave, layout, comm in runs:
        tokens = generate_sharded(model, prompts, 10, interleave=interleave, layout=layout,
                                  comm=comm)
        assert tokens == reference, f"W={world} interleave={interleave} {layout} {comm}"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_generation_matches_single_process(world: int) -> None:
    run_ranks(world, _check_generation)
