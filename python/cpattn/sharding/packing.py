"""Packed documents in a training batch: found in what the collators give, sharded per document.

A batch holds packed documents when its `position_ids` restart inside a row
(transformers' `DataCollatorWithFlattening`, TRL's padding-free batches), when it carries the
collator's document boundaries (`cu_seq_lens_q` / `cu_seq_lens_k`, with
`return_flash_attn_kwargs=True`), or when its `attention_mask` has padding (each row's real
tokens are then one document: unpadding is exact, padding never is under context parallelism).
`cpattn.shard_batch` shards such a batch with a document plan (`cpattn.shard_documents`: short
documents whole on one rank, heavy ones split over as few ranks as the balance needs, over every
rank only where fewer do not balance; strategies ring and allgather) or
per document (`cpattn.shard_varlen`'s layout: each document padded to the layout's granularity
and split over every rank; Ulysses, hybrid, or documents="per-document") and hands the documents
to the attention as the model keyword `cpattn_documents`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from cpattn.core.layout import document_positions
from cpattn.sharding.documents import DocumentPlan

KEYWORD = "cpattn_documents"  # the model keyword that carries the documents to the attention
FLASH_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass(frozen=True)
class Documents:
    """The documents of a packed sequence, the same on every rank (made by cpattn.shard_batch).

    lengths: each document's number of tokens, in packed order.
    starts: each document's first position id (RoPE; 0 for the collators' batches).
    plan: how the documents are sharded: a cpattn.DocumentPlan of these lengths (documents
    whole on one rank or split over a subset of the ranks or over every rank; ranks then hold
    different numbers of tokens),
    or None: per document (every document split over every rank, cpattn.shard_varlen's layout).
    Derived once (plain values, so that torch.compile reads them as constants): cu_seqlens
    (the boundaries, from 0), tokens (their sum), max_position (the largest position id; -1
    without tokens).
    """

    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    cu_seqlens: tuple[int, ...] = field(init=False)
    tokens: int = field(init=False)
    max_position: int = field(init=False)
    plan: Optional[DocumentPlan] = None

    def __post_init__(self) -> None:
        if self.plan is not None and (not isinstance(self.plan, DocumentPlan)
                                      or tuple(self.plan.lengths) != tuple(self.lengths)):
            raise ValueError("cpattn.sharding.packing.Documents: plan must be a "
                             f"cpattn.DocumentPlan of the documents' lengths {self.lengths}")
        cu = [0]
        for n in self.lengths:
            cu.append(cu[-1] + n)
        ends = [s + n - 1 for s, n in zip(self.starts, self.lengths)]
        object.__setattr__(self, "cu_seqlens", tuple(cu))
        object.__setattr__(self, "tokens", cu[-1])
        object.__setattr__(self, "max_position", max(ends) if ends else -1)

    def local_positions(self, layout: str, world: int, rank: int, split: int = 1,
                        part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """For the local tokens of `rank` of `world` (per-document sharding): (index into the
        packed sequence, -1 for padding; position id, 0 for padding). split > 1 (hybrid): that
        shard padded at its end to a multiple of `split` and cut in `split` contiguous parts,
        of which `part`'s tokens. Constants of a compiled graph (computed while tracing)."""
        index, pos = _local_positions(self.lengths, self.starts, layout, world, rank, split,
                                      part)
        return (torch.tensor(index, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64))

    def plan_positions(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For rank's tokens of the plan (self.plan): (index into the packed sequence, -1 for
        padding; position id, 0 for padding). Constants of a compiled graph."""
        index, pos = _plan_positions(self.plan, self.starts, rank)
        return (torch.tensor(index, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64))


def chunk_boundaries(lengths: tuple[int, ...], starts: tuple[int, ...],
                     chunk: int) -> list[int]:
    """Boundaries (from 0) of the pieces of packed documents cut where a position id is a
    multiple of `chunk` (Llama 4's chunked attention, on the documents' own positions)."""
    cu, at = [0], 0
    for n, start in zip(lengths, starts):
        first_cut = -start % chunk  # the first token whose position is a multiple of chunk
        cuts = range(first_cut if first_cut else chunk, n, chunk)
        cu.extend(at + c for c in cuts)
        at += n
        if n:
            cu.append(at)
    return cu


def gathered_order(lengths: tuple[int, ...], layout: str, world: int) -> torch.Tensor:
    """Documents of these lengths sharded per document, every rank's shard concatenated in rank
    order (what an all-gather or Ulysses' all-to-all holds): for each token of the packed
    sequence, its row there. A constant under torch.compile."""
    return torch.tensor(_gathered_order(tuple(lengths), layout, world), dtype=torch.int64)


@torch._dynamo.assume_constant_result
def _gathered_order(lengths: tuple, layout: str, world: int) -> tuple[int, ...]:
    index = torch.cat([torch.tensor(_cached_local_positions(lengths, (0,) * len(lengths),
                                                            layout, world, r)[0])
                       for r in range(world)])
    held = (index >= 0).nonzero().flatten()
    return tuple(held[index[held].argsort()].tolist())


@torch._dynamo.assume_constant_result
def _local_positions(lengths: tuple, starts: tuple, layout: str, world: int, rank: int,
                     split: int, part: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """local_positions as ints (a compile-time constant: run in Python while dynamo traces)."""
    return _cached_local_positions(lengths, starts, layout, world, rank, split, part)


@functools.lru_cache(maxsize=64)
def _cached_local_positions(lengths: tuple, starts: tuple, layout: str, world: int, rank: int,
                            split: int = 1, part: int = 0
                            ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    index, within = document_positions(torch.tensor(lengths, dtype=torch.int64), layout, world,
                                       rank)
    if split > 1:  # (hybrid: the ring shard padded to a multiple of U, cut in U parts)
        pad = -index.numel() % split
        index, within = (torch.cat([t, t.new_full((pad,), -1)]).chunk(split)[part]
                         for t in (index, within))
    cu = torch.tensor([0, *lengths]).cumsum(0)
    doc = torch.searchsorted(cu, index.clamp(min=0), right=True) - 1
    first = torch.tensor(starts, dtype=torch.int64)
    pos = torch.where(index >= 0, within + first[doc.clamp(max=len(starts) - 1)], 0)
    return tuple(index.tolist()), tuple(pos.tolist())


@torch._dynamo.assume_constant_result
def _plan_positions(plan: DocumentPlan, starts: tuple, rank: int
                    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return _cached_plan_positions(plan, starts, rank)


@functools.lru_cache(maxsize=64)
def _cached_plan_positions(plan: DocumentPlan, starts: tuple, rank: int
                           ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    index, within = plan.positions(rank)
    cu = torch.tensor([0, *plan.lengths]).cumsum(0)
    doc = torch.searchsorted(cu, index.clamp(min=0), right=True) - 1
    first = torch.tensor(starts, dtype=torch.int64)
    pos = torch.where(index >= 0, within + first[doc.clamp(max=max(len(starts) - 1, 0))], 0)
    return tuple(index.tolist()), tuple(pos.tolist())


@dataclass
class Packing:
    """A batch seen as packed documents: `docs`, and for each token of the packed sequence its
    place in the batch's rows (`source`, into the flattened (batch * seqlen)). Inside a document
    the position ids count up by one from its start (find_packing checks it)."""

    docs: Documents
    source: torch.Tensor  # int64 (tokens,)


def find_packing(batch: dict[str, Any], key: str, what: str) -> Optional[Packing]:
    """The packed documents of a full batch (None: rows of one document each, positions
    0, 1, ...). Raises ValueError for a form that cannot be made exact."""
    ids = batch[key]
    bsz, seqlen = ids.shape[0], ids.shape[1]
    mask = batch.get("attention_mask")
    mask = None if mask is None else torch.as_tensor(mask).bool().cpu()
    pos = batch.get("position_ids")
    pos = None if pos is None else torch.as_tensor(pos).cpu().to(torch.int64)
    if pos is not None:
        if pos.dim() == 1:
            pos = pos[None]
        if pos.shape[-1] != seqlen or pos.shape[0] not in (1, bsz):
            raise ValueError(f"{what}: position_ids must be (batch, seqlen) = ({bsz}, {seqlen}), "
                             f"got {tuple(pos.shape)}")
        pos = pos.expand(bsz, -1)
    cu = _flash_boundaries(batch, bsz, seqlen, what)
    default = torch.arange(seqlen).expand(bsz, -1)
    padded = mask is not None and not bool(mask.all())
    if cu is None and not padded and (pos is None or torch.equal(pos, default)):
        return None
    if mask is not None and mask.shape != (bsz, seqlen):
        raise ValueError(f"{what}: attention_mask must be (batch, seqlen) = ({bsz}, {seqlen}), "
                         f"got {tuple(mask.shape)}")
    if cu is not None and padded:
        raise ValueError(f"{what}: a batch with cu_seq_lens_q has no padding; got an "
                         "attention_mask with zeros too")
    pos = default if pos is None else pos
    lengths, starts, sources = [], [], []
    for b in range(bsz):
        real = (torch.arange(seqlen) if mask is None else mask[b].nonzero().flatten())
        if real.numel() and int(real[-1] - real[0]) + 1 != real.numel():
            raise ValueError(f"{what}: attention_mask row {b} has padding between real tokens; "
                             "only left or right padding can be unpadded exactly")
        row = pos[b, real]
        new = torch.ones(row.numel(), dtype=torch.bool)  # where positions do not count up
        new[1:] = row.diff() != 1
        if cu is not None:
            bounds = cu
            inside = torch.ones_like(new)
            inside[torch.tensor([c for c in cu[:-1] if c < row.numel()], dtype=torch.int64)] = False
            if bool((new & inside).any()):
                raise ValueError(f"{what}: position_ids restart inside a document of "
                                 "cu_seq_lens_q: the two disagree on the documents")
        else:  # a new document wherever the position does not follow the previous one
            bounds = torch.cat([new.nonzero().flatten(), torch.tensor([row.numel()])]).tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            if e > s:
                lengths.append(e - s)
                starts.append(int(pos[b, real[s]]))
        sources.append(b * seqlen + real)
    return Packing(Documents(tuple(lengths), tuple(starts)), torch.cat(sources))


def _flash_boundaries(batch, bsz: int, seqlen: int, what: str) -> Optional[list[int]]:
    """The collator's cu_seq_lens_q (== cu_seq_lens_k), checked, or None."""
    if not any(k in batch for k in FLASH_KEYS[:2]):
        return None
    cu_q, cu_k = batch.get("cu_seq_lens_q"), batch.get("cu_seq_lens_k")
    if cu_q is None or cu_k is None or not torch.equal(torch.as_tensor(cu_q).cpu(),
                                                       torch.as_tensor(cu_k).cpu()):
        raise ValueError(f"{what}: cu_seq_lens_q and cu_seq_lens_k must both be given and equal "
                         "(self-attention over packed documents)")
    cu = torch.as_tensor(cu_q).cpu().to(torch.int64).flatten().tolist()
    if bsz != 1 or cu[0] != 0 or cu[-1] != seqlen or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{what}: cu_seq_lens_q {cu if len(cu) <= 16 else '...'} must run from 0 "
                         f"to the packed length {seqlen} of a batch of one row (got {bsz} rows)")
    return cu


def check_seq_idx(batch: dict[str, Any], packing: Optional[Packing], key: str,
                  what: str) -> None:
    """TRL's padding-free `seq_idx` (batch, seqlen): each token's document index, for the short
    convolutions of linear-attention layers. It is not passed on (the attention gets the
    documents), so it must mark the same documents as the batch's positions, else ValueError."""
    ids = batch[key]
    bsz, seqlen = ids.shape[0], ids.shape[1]
    seq_idx = torch.as_tensor(batch["seq_idx"]).cpu().to(torch.int64)
    if seq_idx.dim() == 1:
        seq_idx = seq_idx[None]
    if tuple(seq_idx.shape) != (bsz, seqlen):
        raise ValueError(f"{what}: seq_idx must be (batch, seqlen) = ({bsz}, {seqlen}), got "
                         f"{tuple(seq_idx.shape)}")
    if packing is None:  # rows of one document each
        source = torch.arange(bsz * seqlen)
        starts = torch.arange(0, bsz * seqlen, seqlen)
    else:
        source = packing.source
        starts = torch.tensor(packing.docs.cu_seqlens[:-1], dtype=torch.int64)
        starts = starts[torch.tensor(packing.docs.lengths, dtype=torch.int64) > 0]
    flat, row = seq_idx.flatten()[source], source // seqlen
    new = torch.ones(flat.numel(), dtype=torch.bool)  # a row's first token, or a new index
    new[1:] = (flat.diff() != 0) | (row.diff() != 0)
    if not torch.equal(new.nonzero().flatten(), starts):
        raise ValueError(f"{what}: seq_idx marks other documents than the batch's position_ids "
                         "/ cu_seq_lens_q: the two disagree on where documents start")
