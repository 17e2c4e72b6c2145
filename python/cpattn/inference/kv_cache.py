"""KVCacheShard: this rank's part of a KV cache sharded over the ranks of a group.

Token t of a sequence is stored by rank (t // interleave) % W only (csrc/include/cpattn/kv_cache.h),
so each rank holds about 1/W of every sequence's K/V (cpattn.inference.attention attends over it).
"""

from __future__ import annotations

from typing import Optional

import torch

from cpattn.core.signature import FieldValue, digest_ints, tensor_fields
from cpattn.core.validation import error
from cpattn.sharding.sequences import rank_and_world

ops = torch.ops.cpattn


def _positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"cpattn.KVCacheShard: {name} must be a positive int, got {value!r}")
    return value


class KVCacheShard:
    """This rank's part of a KV cache for a batch of sequences (one layer).

    Token t of each sequence lives on rank (t // interleave) % world_size, and only there: blocks
    of `interleave` consecutive tokens are dealt round-robin over the ranks (1 = single tokens).
    Storage is preallocated for `capacity` tokens per sequence: k and v are
    (batch, local_slots, kv_heads, head_dim) with local_slots about capacity / world_size.
    `lengths` (int64, (batch,)) counts each sequence's tokens over all ranks; it is the same on
    every rank, since every rank appends the same tokens.

    Args:
        batch, capacity, kv_heads, head_dim: sizes; capacity is the maximum tokens per sequence.
        interleave: tokens per round-robin block.
        group: the process group the cache is sharded over (default: the world); or give
            rank and world_size explicitly (no process group needed to build or fill the cache).
        dtype, device: of the K/V storage.
    """

    def __init__(
        self,
        batch: int,
        capacity: int,
        kv_heads: int,
        head_dim: int,
        *,
        interleave: int = 1,
        group=None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        dtype: torch.dtype = torch.float32,
        device: Optional[torch.device] = None,
    ) -> None:
        for name, value in (("batch", batch), ("capacity", capacity), ("kv_heads", kv_heads),
                            ("head_dim", head_dim), ("interleave", interleave)):
            _positive_int(value, name)
        rank, world_size = rank_and_world(group, rank, world_size)
        _positive_int(world_size, "world_size")
        if not 0 <= rank < world_size:
            raise ValueError(f"cpattn.KVCacheShard: rank {rank} is not in a group of {world_size}")
        self.capacity, self.interleave = capacity, interleave
        self.rank, self.world_size = rank, world_size
        slots = ops.cache_local_count(capacity, 0, world_size, interleave)
        self.k = torch.zeros(batch, slots, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.lengths = torch.zeros(batch, dtype=torch.int64)
        self.first_sequence = 0  # index of sequence 0 in the full cache (views of sequences)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def local_slots(self) -> int:
        return self.k.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage on this rank."""
        return self.k.nbytes + self.v.nbytes

    def local_lengths(self) -> torch.Tensor:
        """Tokens of each sequence stored on this rank (int64, (batch,))."""
        return torch.tensor(
            [ops.cache_local_count(int(n), self.rank, self.world_size, self.interleave)
             for n in self.lengths.tolist()],
            dtype=torch.int64,
        )

    def positions(self, index: int) -> torch.Tensor:
        """Global positions of the tokens of sequence `index` stored here, in slot order."""
        n = int(self.lengths[index])
        return ops.cache_positions(n, self.rank, self.world_size, self.interleave)

    def sequences(self, start: int, stop: int) -> "KVCacheShard":
        """A view of sequences [start, stop): same storage, appends through it update this cache.

        Useful to prefill sequences of different lengths one at a time, then decode them together.
        """
        if not 0 <= start < stop <= self.batch:
            raise ValueError(
                f"cpattn.KVCacheShard.sequences: need 0 <= start < stop <= {self.batch}, got "
                f"({start}, {stop})"
            )
        view = object.__new__(KVCacheShard)
        view.__dict__.update(self.__dict__)
        view.k, view.v = self.k[start:stop], self.v[start:stop]
        view.lengths = self.lengths[start:stop]
        view.first_sequence = self.first_sequence + start
        return view

    def clear(self) -> None:
        """Forgets every sequence's tokens (the storage stays allocated)."""
        self.lengths.zero_()

    def check_room(self, tokens: int, what: str) -> None:
        """Raises ValueError if some sequence cannot take `tokens` more. The lengths are the same
        on every rank, so every rank raises."""
        over = (self.lengths + tokens > self.capacity).nonzero().flatten().tolist()
        if over:
            b = over[0]
            raise ValueError(
                f"{what}: KV cache capacity exceeded: sequence {self.first_sequence + b} holds "
                f"{int(self.lengths[b])} "
                f"tokens, {tokens} more would exceed the capacity of {self.capacity}"
            )

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Appends new tokens to every sequence: k, v (batch, n, kv_heads, head_dim), the same
        on every rank (e.g. a decode step's K/V); only each token's owner stores it."""
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != self.batch or (
            k.shape[2:] != self.k.shape[2:]
        ):
            raise ValueError(
                "cpattn.KVCacheShard.append: k and v must be (batch, tokens, kv_heads, head_dim) "
                f"= ({self.batch}, n, {self.kv_heads}, {self.head_dim}), got {tuple(k.shape)} "
                f"and {tuple(v.shape)}"
            )
        self.check_room(k.shape[1], "cpattn.KVCacheShard.append")
        ops.cache_store_(self.k, self.v, k.to(self.dtype), v.to(self.dtype), self.lengths,
                         self.rank, self.world_size, self.interleave)
        self.lengths += k.shape[1]

    def __repr__(self) -> str:
        return (
            f"KVCacheShard(rank {self.rank}/{self.world_size}, interleave {self.interleave}, "
            f"batch {self.batch}, capacity {self.capacity} ({self.local_slots} slots here), "
            f"kv_heads {self.kv_heads}, head_dim {self.head_dim}, {self.dtype}, "
            f"lengths {self.lengths.tolist()})"
        )

    def agreement_fields(self, rank: int) -> list[tuple[str, FieldValue]]:
        """What every rank's cache must agree on (with `rank`, the caller's rank in its group)."""
        return [
            ("cache.world_size", self.world_size),
            ("cache.rank_is_group_rank", int(self.rank == rank)),
            ("cache.interleave", self.interleave),
            ("cache.capacity", self.capacity),
            *tensor_fields("cache.k", self.k),
            # the exact lengths: every rank must have appended the same tokens
            ("cache.lengths", digest_ints(self.lengths)),
        ]

    def check_group(self, rank: int, world: int, what: str) -> None:
        """Raises unless the cache was made for this rank of this group. After the agreement
        check these values are the same on every rank, so every rank raises."""
        if self.world_size != world or self.rank != rank:
            raise ValueError(
                f"{what}: the cache was made for rank {self.rank} of {self.world_size}, but this "
                f"is rank {rank} of {world} in the group"
            )

    def check_query(self, q: torch.Tensor, what: str) -> None:
        """Raises unless q (batch, seqlen, heads, head_dim) fits the cache."""
        if q.dim() != 4 or q.shape[0] != self.batch or q.shape[3] != self.head_dim:
            raise ValueError(
                f"{what}: q must be (batch, seqlen, heads, head_dim) with the cache's batch "
                f"{self.batch} and head_dim {self.head_dim}, got {tuple(q.shape)}"
            )
        if q.shape[2] % self.kv_heads != 0:
            raise ValueError(
                f"{what}: the number of query heads ({q.shape[2]}) must be a multiple of the "
                f"cache's kv_heads ({self.kv_heads})"
            )
        if q.dtype != self.dtype:
            raise ValueError(f"{what}: q must have the cache's dtype {self.dtype}, got {q.dtype}")


def check_cache_type(cache, what: str) -> None:
    if not isinstance(cache, KVCacheShard):
        raise error(what, "cache", cache, "must be a cpattn.KVCacheShard")


# The partial results' messages of prefill and decode (attention.py, invariant_cache.py): out and
# lse of a block of rows travel as one tensor.
def pack_partial(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """(B, S, H, D) fp32 and (B, H, S) -> one (B, S, H, D + 1) message."""
    return torch.cat([out, lse.transpose(1, 2).unsqueeze(-1)], dim=-1)


def unpack_partials(msg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, B, S, H, D + 1) -> outs (N, B, S, H, D), lses (N, B, H, S)."""
    return msg[..., :-1], msg[..., -1].transpose(2, 3).contiguous()
