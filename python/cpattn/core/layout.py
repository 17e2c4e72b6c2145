"""How a sequence is split over W ranks: layout names and codes, granularity, padding, positions
(and, for Ulysses, which KV heads each rank holds).

The one Python home of these rules. The layouts themselves live in the header core
(csrc/include/cpattn/layout.h): positions come from it through torch.ops.cpattn.layout_positions,
and the codes below are its `Layout` enum. Any length: a sequence whose length is not a multiple
of the layout's granularity is padded at its end; padding slots have position -1.
"""

from typing import NamedTuple, Optional

import torch

# csrc/include/cpattn/layout.h `Layout`: the integer each op takes as `layout`.
LAYOUTS = {"contiguous": 0, "zigzag": 1, "striped": 2}
# The float dtypes cpattn computes in, by the names the cost model and the benchmarks use.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class PackedDocuments(NamedTuple):
    """Packed documents as the ops take them (their arguments doc_lengths, doc_prefix_lens): the
    documents' lengths, (D,) int64, and with a prefix-LM per document the prefixes' lengths, (D,)
    int64 (None: no prefix per document)."""

    lengths: torch.Tensor
    prefixes: Optional[torch.Tensor] = None


def doc_args(docs: Optional[PackedDocuments]) -> tuple:
    """The ops' (doc_lengths, doc_prefix_lens) of `docs` (None: one sequence, no documents)."""
    return (None, None) if docs is None else (docs.lengths, docs.prefixes)


def layout_code(layout: str) -> int:
    """The header core's integer code of `layout`; ValueError for an unknown name."""
    if layout not in LAYOUTS:
        raise ValueError(f"cpattn: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def granularity(layout: str, world: int) -> int:
    """Global lengths split evenly under `layout` over `world` ranks are multiples of this:
    2W for zigzag (2W segments), W otherwise (layout.h layout_granularity)."""
    return (2 if layout_code(layout) == LAYOUTS["zigzag"] else 1) * world


def round_up(n: int, multiple: int) -> int:
    """n rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def padded_length(seqlen: int, layout: str, world: int) -> int:
    """seqlen rounded up to the layout's granularity (any length: padding at the end)."""
    if seqlen <= 0:
        raise ValueError(f"cpattn: the sequence length must be positive, got {seqlen}")
    return round_up(seqlen, granularity(layout, world))


def check_chunk(what: str, chunk: int, layout: str, world: int, per_rank: Optional[int] = None
                ) -> None:
    """Raises ValueError unless a chunk of `chunk` tokens splits evenly under `layout` (a prefill
    chunk without seqlen= is not padded). `per_rank`: the shard length, named in the message."""
    g = granularity(layout, world)
    if chunk % g != 0:
        shard = "" if per_rank is None else f" ({per_rank} per rank)"
        raise ValueError(f"{what}: the {layout} layout needs a chunk length that is a multiple of "
                         f"{g}, got {chunk}{shard}")


def shard_positions(seqlen: int, layout: str, world: int, rank: int) -> torch.Tensor:
    """Global positions (int64, (padded / W,)) of `rank`'s tokens of a length-`seqlen` sequence,
    -1 for the padding slots of a length that is not a multiple of the granularity."""
    padded = padded_length(seqlen, layout, world)
    pos = torch.ops.cpattn.layout_positions(padded, world, rank, layout_code(layout))
    return pos if padded == seqlen else torch.where(pos < seqlen, pos, -1)


@torch._dynamo.assume_constant_result  # compiled: run while tracing, its result a constant
def document_shards(lengths, code: int, world: int) -> tuple[tuple[int, int, int], ...]:
    """Packed documents as ring_attention_varlen shards them, each padded to the layout's
    granularity and sharded on its own: per document of `lengths` (ints), (its padded length,
    where it starts in the padded packed sequence, where its part starts in every rank's shard).
    The rule is the header core's (cpattn/layout.h document_shard), through the op
    document_shards; `code` a layout code (LAYOUTS)."""
    rows = torch.ops.cpattn.document_shards([int(n) for n in lengths], world, code)
    return tuple(tuple(row) for row in rows.tolist())


def document_positions(docs: torch.Tensor, layout: str, world: int, rank: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Varlen sharding (each document padded to the granularity and sharded on its own:
    document_shards), for `rank`'s local tokens: (index into the packed global sequence or -1
    for padding, position within its document or -1). docs: int64 document lengths (D,)."""
    code = layout_code(layout)  # an unknown layout raises even when every document is empty
    lengths = docs.tolist()
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), docs.cumsum(0)])
    index, within = [], []
    for d, (n, (padded, _, _)) in enumerate(zip(lengths, document_shards(lengths, code, world))):
        if n == 0:
            continue
        pos = torch.ops.cpattn.layout_positions(padded, world, rank, code)
        pos = torch.where(pos < n, pos, -1)
        index.append(torch.where(pos >= 0, starts[d] + pos, -1))
        within.append(pos)
    if not index:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(index), torch.cat(within)


def kv_heads_for_ranks(heads: int, kv_heads: int, world: int) -> Optional[int]:
    """How many times each KV head is repeated (in place, `repeat_interleave` on the heads dim)
    before the all-to-all so that rank r then holds the KV heads of its query heads
    [r * H/W, (r+1) * H/W), with a uniform group size. None: send K/V as they are. A count,
    not an index list: repeating needs no index tensor on the device (no host-to-device copy)."""
    per_rank = heads // world
    group = heads // kv_heads
    if kv_heads % world == 0:
        return None  # each rank gets kv_heads / W heads, group size unchanged
    if group % per_rank == 0:
        # all query heads of a rank share one KV head: each KV head goes to group / per_rank ranks
        return group // per_rank
    # otherwise one KV head per query head (group size 1)
    return group


def default_head_group(kv_heads: int, world: int) -> int:
    """KV heads per gather of the all-gather strategy by default: kv_heads / (4 W), at least one,
    so a gathered head group (its K and V over the whole sequence) is at most a quarter of this
    rank's own K and V shards and the memory per rank falls as 1/W. Here, below the strategies,
    because the planner models that default too."""
    return max(1, kv_heads // (4 * world))
