"""The sharded KV cache on W ranks simulated in one process (a KVCacheShard per rank, built with
explicit rank / world_size): the owner rule, appends, capacity, and partial attention over each
rank's shard (torch.ops.cpattn.cache_attention_fwd) merged across ranks vs the float64 reference."""

from __future__ import annotations

import itertools

import pytest
import torch

import cpattn

from conftest import (
    assert_close_fp32,
    assert_close_low_out,
    make_qkv,
    randn,
    reference_attention,
)

ops = torch.ops.cpattn


def owner(t: int, world: int, interleave: int) -> int:
    """The owner rule of the issue, written out independently of the C++ one."""
    return (t // interleave) % world


def sharded_caches(
    k: torch.Tensor, v: torch.Tensor, lengths: list[int], world: int, interleave: int,
    capacity: int, chunks: int = 3,
) -> list[cpattn.KVCacheShard]:
    """W caches holding the first lengths[b] tokens of sequence b of k, v, appended in a few
    pieces of different sizes per sequence."""
    caches = [
        cpattn.KVCacheShard(k.shape[0], capacity, k.shape[2], k.shape[3], interleave=interleave,
                            rank=r, world_size=world, dtype=k.dtype)
        for r in range(world)
    ]
    for b, n in enumerate(lengths):
        cuts = sorted({0, n, *(n * i // chunks for i in range(1, chunks))})
        for c0, c1 in itertools.pairwise(cuts):
            for cache in caches:
                cache.sequences(b, b + 1).append(k[b:b + 1, c0:c1], v[b:b + 1, c0:c1])
    return caches


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (3, 2), (4, 16), (3, 5)])
def test_owner_rule_and_storage(world: int, interleave: int, gen: torch.Generator) -> None:
    """Each token is stored once, on its owner, at the owner's next slot in position order."""
    lengths, capacity = [45, 0, 7, 64], 70
    k, v = randn((4, capacity, 2, 8), gen), randn((4, capacity, 2, 8), gen)
    caches = sharded_caches(k, v, lengths, world, interleave, capacity)
    for b, n in enumerate(lengths):
        seen = []
        for r, cache in enumerate(caches):
            assert cache.lengths.tolist() == lengths
            pos = cache.positions(b)
            assert pos.tolist() == [t for t in range(n) if owner(t, world, interleave) == r]
            local = int(cache.local_lengths()[b])
            assert local == len(pos)
            assert torch.equal(cache.k[b, :local], k[b, pos])
            assert torch.equal(cache.v[b, :local], v[b, pos])
            assert not cache.k[b, local:].any(), "slots past the sequence stay untouched"
            seen += pos.tolist()
        assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("world, interleave", [(1, 1), (2, 1), (4, 1), (4, 16), (3, 64)])
def test_memory_per_rank_is_one_over_world(world: int, interleave: int) -> None:
    """Slots per rank are capacity / W, rounded up to whole interleave blocks; every rank has
    the same shape, and the capacity always fits."""
    capacity = 1000
    caches = [cpattn.KVCacheShard(2, capacity, 2, 8, interleave=interleave, rank=r,
                                  world_size=world) for r in range(world)]
    slots = {c.local_slots for c in caches}
    assert len(slots) == 1
    (n,) = slots
    assert capacity / world <= n < capacity / world + interleave
    assert caches[0].nbytes == 2 * 2 * n * 2 * 8 * 4


def test_capacity_exceeded_raises_and_changes_nothing(gen: torch.Generator) -> None:
    cache = cpattn.KVCacheShard(2, 10, 1, 4, rank=1, world_size=2, interleave=2)
    k = randn((2, 8, 1, 4), gen)
    cache.append(k, k)
    before = (cache.k.clone(), cache.lengths.clone())
    with pytest.raises(ValueError, match=r"capacity exceeded: sequence 0 holds 8 tokens, 3 more "
                                         r"would exceed the capacity of 10"):
        cache.append(k[:, :3], k[:, :3])
    assert torch.equal(cache.k, before[0]) and torch.equal(cache.lengths, before[1])
    cache.sequences(1, 2).append(k[1:, :2], k[1:, :2])  # exactly full
    with pytest.raises(ValueError, match="sequence 1 holds 10"):
        cache.sequences(1, 2).append(k[1:, :1], k[1:, :1])
    # The op itself refuses to write past the storage, whatever the Python object says.
    with pytest.raises(RuntimeError, match="KV cache overflow"):
        ops.cache_store_(cache.k, cache.v, k, k, torch.tensor([9, 0]), 1, 2, 2)


BAD_CACHE_ARGS = {
    "batch_zero": (dict(batch=0), "batch must be a positive int"),
    "interleave_zero": (dict(interleave=0), "interleave must be a positive int"),
    "rank_outside": (dict(rank=3, world_size=3), "rank 3 is not in a group of 3"),
    "capacity_float": (dict(capacity=10.5), "capacity must be a positive int"),
}


@pytest.mark.parametrize("case", sorted(BAD_CACHE_ARGS))
def test_bad_cache_args(case: str) -> None:
    kwargs, pattern = BAD_CACHE_ARGS[case]
    args = dict(batch=2, capacity=16, kv_heads=2, head_dim=8, rank=0, world_size=2) | kwargs
    with pytest.raises(ValueError, match=pattern):
        cpattn.KVCacheShard(args.pop("batch"), args.pop("capacity"), args.pop("kv_heads"),
                            args.pop("head_dim"), **args)


def test_bad_append_shapes(gen: torch.Generator) -> None:
    cache = cpattn.KVCacheShard(2, 16, 2, 8, rank=0, world_size=2)
    for shape in [(1, 3, 2, 8), (2, 3, 1, 8), (2, 3, 2, 4), (2, 3, 16)]:
        with pytest.raises(ValueError, match=r"k and v must be \(batch, tokens, kv_heads"):
            cache.append(randn(shape, gen), randn(shape, gen))
    with pytest.raises(ValueError, match="sequences"):
        cache.sequences(1, 1)


def test_sequence_views_share_storage(gen: torch.Generator) -> None:
    cache = cpattn.KVCacheShard(3, 16, 1, 4, rank=0, world_size=1)
    view = cache.sequences(1, 3)
    k = randn((2, 5, 1, 4), gen)
    view.append(k, k)
    assert cache.lengths.tolist() == [0, 5, 5]
    assert torch.equal(cache.k[1:, :5], k)
    cache.clear()
    assert view.lengths.tolist() == [0, 0]


# ---------------------------------------------------------------------------------------------
# Partial attention over each rank's shard, merged over the simulated ranks


def sharded_attention(
    q: torch.Tensor, caches: list[cpattn.KVCacheShard], q_start: torch.Tensor, causal: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    scale = q.shape[-1] ** -0.5
    parts = [
        ops.cache_attention_fwd(q, c.k, c.v, c.lengths, q_start, c.rank, c.world_size,
                                c.interleave, torch.float32, softmax_scale=scale, causal=causal)
        for c in caches
    ]
    out, lse = cpattn.merge_attention_states([p[0] for p in parts], [p[1] for p in parts],
                                             out_dtype=q.dtype)
    return out, lse, parts


WORLD_INTERLEAVE = [(1, 1), (2, 1), (2, 16), (3, 1), (3, 3), (4, 1), (4, 16)]


@pytest.mark.parametrize("world, interleave", WORLD_INTERLEAVE)
@pytest.mark.parametrize("sq", [1, 3, 7])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_over_shards_matches_reference(
    world: int, interleave: int, sq: int, heads: tuple[int, int], dtype: torch.dtype,
    gen: torch.Generator,
) -> None:
    """The newest Sq tokens of sequences of different lengths (one of them shorter than a block,
    so some shards are empty) attend causally over the sharded cache: exact after the merge."""
    h, hkv = heads
    lengths = [50, sq, 23]
    q_full, k, v = make_qkv(gen, 3, 50, 50, h, hkv, 16, dtype=dtype)
    caches = sharded_caches(k, v, lengths, world, interleave, capacity=60)
    q = torch.stack([q_full[b, n - sq:n] for b, n in enumerate(lengths)])
    lens = torch.tensor(lengths)
    out, lse, _ = sharded_attention(q, caches, lens - sq)
    for b, n in enumerate(lengths):
        r_out, r_lse = reference_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True)
        base, _ = reference_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=True,
                                      compute_dtype=dtype)
        what = f"sequence {b} W={world} I={interleave} Sq={sq}"
        assert_close_low_out(out[b:b + 1], r_out, base, dtype, f"out {what}")
        assert_close_fp32(lse[b:b + 1], r_lse, f"lse {what}")


def test_empty_shards_give_empty_partials(gen: torch.Generator) -> None:
    """A sequence shorter than one interleave block lives on rank 0 only: the other ranks'
    partials are exactly (0, -inf) and the merge ignores them."""
    q, k, v = make_qkv(gen, 2, 3, 40, 4, 2, 16)
    caches = sharded_caches(k, v, [3, 40], world=4, interleave=16, capacity=64)
    lens = torch.tensor([3, 40])
    out, lse, parts = sharded_attention(q, caches, lens - 3)
    for r in (1, 2, 3):
        assert torch.equal(parts[r][0][0], torch.zeros_like(parts[r][0][0]))
        assert torch.isneginf(parts[r][1][0]).all()
    assert torch.isneginf(parts[3][1][1]).all(), "rank 3 holds nothing of 40 tokens either"
    r_out, r_lse = reference_attention(q[:1], k[:1, :3], v[:1, :3], causal=True)
    assert_close_fp32(out[:1], r_out, "out")
    assert_close_fp32(lse[:1], r_lse, "lse")


def test_empty_cache_rows_are_zero_not_nan(gen: torch.Generator) -> None:
    """Queries over a sequence with no cached token at all: out 0, lse -inf on every rank."""
    q = randn((1, 2, 4, 16), gen)
    caches = [cpattn.KVCacheShard(1, 32, 2, 16, rank=r, world_size=2) for r in range(2)]
    out, lse, _ = sharded_attention(q, caches, torch.tensor([0]))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


@pytest.mark.parametrize("world, interleave", [(2, 1), (3, 4)])
def test_queries_after_the_cache_and_non_causal(world: int, interleave: int,
                                                gen: torch.Generator) -> None:
    """Queries placed after the cached tokens (what chunked prefill asks of the cache) see every
    cached key; causal=False sees every key whatever the positions."""
    q, k, v = make_qkv(gen, 2, 9, 30, 4, 2, 16)
    caches = sharded_caches(k, v, [30, 17], world, interleave, capacity=32)
    lens = torch.tensor([30, 17])
    for causal in (True, False):
        q_start = lens if causal else torch.zeros(2, dtype=torch.long)
        out, lse, _ = sharded_attention(q, caches, q_start, causal=causal)
        for b, n in enumerate([30, 17]):
            r_out, r_lse = reference_attention(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n])
            assert_close_fp32(out[b:b + 1], r_out, f"out causal={causal}")
            assert_close_fp32(lse[b:b + 1], r_lse, f"lse causal={causal}")


def test_opcheck_cache_ops(gen: torch.Generator) -> None:
    """Schemas and fake kernels of the cache ops (cache_store_ mutates only the cache)."""
    caches = sharded_caches(*make_qkv(gen, 2, 1, 20, 4, 2, 8)[1:], [20, 9], 2, 3, capacity=24)
    c = caches[1]
    q = randn((2, 3, 4, 8), gen)
    args = (q, c.k, c.v, c.lengths, c.lengths - 3, 1, 2, 3, None)
    torch.library.opcheck(ops.cache_attention_fwd.default, args,
                          dict(softmax_scale=0.3, causal=True))
    new = randn((2, 2, 2, 8), gen)
    torch.library.opcheck(ops.cache_store_.default,
                          (c.k.clone(), c.v.clone(), new, new, c.lengths, 1, 2, 3))


BAD_OP_ARGS = {
    "q_dtype": (lambda c, q: (q.bfloat16(), c.k, c.v, c.lengths, c.lengths), "cache's dtype"),
    "q_heads": (lambda c, q: (q[:, :, :3], c.k, c.v, c.lengths, c.lengths),
                r"query heads \(3\) must be a multiple"),
    "lens_int32": (lambda c, q: (q, c.k, c.v, c.lengths.int(), c.lengths),
                   "cache_lens must be an int64 CPU tensor"),
    "lens_too_long": (lambda c, q: (q, c.k, c.v, c.lengths + 100, c.lengths),
                      "is more than the cache shards hold"),
    "q_start_negative": (lambda c, q: (q, c.k, c.v, c.lengths, c.lengths - 100),
                         "q_start must be >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_OP_ARGS))
def test_cache_attention_bad_args(case: str, gen: torch.Generator) -> None:
    c = cpattn.KVCacheShard(2, 16, 2, 8, rank=0, world_size=2)
    c.append(randn((2, 5, 2, 8), gen), randn((2, 5, 2, 8), gen))
    build, pattern = BAD_OP_ARGS[case]
    with pytest.raises(RuntimeError, match=pattern):
        ops.cache_attention_fwd(*build(c, randn((2, 1, 4, 8), gen)), 0, 2, 1, None,
                                softmax_scale=0.3, causal=True)
