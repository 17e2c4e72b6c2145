"""Invariant mode over a KV cache sharded in blocks of `interleave` tokens (inference.py's
prefill and decode): every row gets the bits of the training forward over the whole sequence
(docs/invariance.md). The blocks are aligned blocks of the forward's key tiles
(csrc/include/cpattn/invariant.h): each rank computes its blocks' partial results
(op invariant_partial), and the blocks' results merge in the tile tree's order wherever the rows
live (op invariant_merge)."""

import torch

from cpattn.core.validation import error
from cpattn.inference.kv_cache import KVCacheShard, pack_partial
from cpattn.invariant.checks import check_invariant_call

ops = torch.ops.cpattn


def check_cache(what: str, q: torch.Tensor, cache: KVCacheShard) -> None:
    """A cache whose blocks are whole key tiles, and CPU tensors."""
    tile = ops.invariant_tile()
    if cache.interleave % tile:
        raise error(what, "invariant", True, f"needs a cache whose blocks are whole key tiles of "
                    f"the invariant forward: KVCacheShard(interleave=a multiple of {tile}), got "
                    f"interleave {cache.interleave}")
    check_invariant_call(what, q)


def owned_blocks(q: torch.Tensor, cache: KVCacheShard, q_begin: list, opts) -> torch.Tensor:
    """The partial results of query rows q (B, R, H, D) (sequence b's first at position
    q_begin[b]) over each cache block this rank owns, in slot order: (blocks, B, R, H, D + 1),
    out and lse packed as inference's messages ((0, -inf) where a sequence has no such block)."""
    block, world = cache.interleave, cache.world_size
    lengths = cache.lengths.tolist()
    slots = -(-max(-(-n // block) for n in lengths) // world)  # blocks per rank, at most
    b, r, h, d = q.shape
    parts = q.new_zeros((slots, b, r, h, d + 1), dtype=torch.float32)
    parts[..., -1] = float("-inf")
    for i, n in enumerate(lengths):
        for slot, j in enumerate(range(cache.rank, -(-n // block), world)):
            keys = slice(slot * block, slot * block + min(block, n - j * block))
            out, lse = ops.invariant_partial(q[i:i + 1], cache.k[i:i + 1, keys],
                                             cache.v[i:i + 1, keys], q_begin[i], j * block,
                                             **opts.op_kwargs())
            parts[slot, i] = pack_partial(out, lse)[0]
    return parts


def merge_blocks(parts: torch.Tensor, cache: KVCacheShard, sinks, dtype) -> tuple:
    """parts (W, slots, ...): every rank's blocks (rank s's slot j is block j W + s) -> merged in
    the tile tree's order, the sinks joined, out cast to dtype."""
    tiles_per_block = cache.interleave // ops.invariant_tile()
    parts = parts.transpose(0, 1).flatten(0, 1)  # block order
    outs, lses = parts[..., :-1], parts[..., -1].transpose(2, 3)
    return ops.invariant_merge(outs.contiguous(), lses.contiguous(),
                               [j * tiles_per_block for j in range(parts.shape[0])], sinks, dtype)
