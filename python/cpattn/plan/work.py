"""What each rank holds and computes: its tokens and heads under a strategy, and the kernel work
per (rank, ring step) from the schedule itself (torch.ops.cpattn.schedule_work, the rule in
csrc/include/cpattn/work.h): visited kernel tiles, so layouts, masks, windows and packed
documents are counted exactly."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from cpattn.core.layout import (
    LAYOUTS,
    default_head_group,
    granularity,
    kv_heads_for_ranks,
    round_up,
)
from cpattn.plan.model import Machine, Problem


@functools.lru_cache(maxsize=4096)
def schedule_work(seqlen: int, world: int, layout: str, causal: bool, window: tuple,
                  block: tuple, documents: Optional[tuple]) -> torch.Tensor:
    """(world, world, 3) float64: visible pairs, visited tile pairs, kernel calls per
    (rank, step), per batch row and head."""
    docs = torch.tensor(documents, dtype=torch.int64) if documents is not None else None
    w = torch.ops.cpattn.schedule_work(seqlen, world, LAYOUTS[layout], causal, window[0],
                                       window[1], block[0], block[1], docs)
    return w.double()


def tokens_per_rank(p: Problem, world: int, layout: str) -> int:
    """Tokens per rank (documents padded per document as ring_attention_varlen does)."""
    if p.documents is None:
        return p.seqlen // world
    g = granularity(layout, world)
    return sum(round_up(n, g) for n in p.documents) // world


def compute_steps(p: Problem, m: Machine, world: int, layout: str, heads: int,
                  seqlen: Optional[int] = None, backward: bool = False) -> torch.Tensor:
    """(world ranks, world steps) kernel seconds."""
    w = schedule_work(seqlen or p.seqlen, world, layout, p.causal, tuple(p.window),
                      tuple(m.block), p.documents if seqlen is None else None)
    per_pair = (10 if backward else 4) * p.head_dim * p.batch * heads
    return w[..., 1] * per_pair / m.flops(p.dtype, backward) + w[..., 2] * m.call_overhead


def divisible(p: Problem, world: int, layout: str) -> bool:
    """Whether the layout can shard the problem's sequence over `world` ranks."""
    return p.documents is not None or p.seqlen % granularity(layout, world) == 0


# ring_attention(strategy="allgather")'s default KV heads per gather, as the strategy decides it
allgather_chunk = default_head_group


def kv_heads_sent(heads: int, kv_heads: int, u: int) -> int:
    """KV heads each rank puts into Ulysses' all-to-all: those kv_heads_for_ranks picks."""
    repeats = kv_heads_for_ranks(heads, kv_heads, u)
    return kv_heads * (repeats or 1)
