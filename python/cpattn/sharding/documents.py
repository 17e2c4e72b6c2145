"""Document-aware sharding of packed documents: short documents stay whole on one rank (no
communication, no padding), heavy ones are split (per-document zigzag) over as few ranks as
the balance of the attention work per rank needs.

    plan = cpattn.shard_documents(cu_seqlens, world_size=W, causal=True)
    q_local = plan.shard(q_packed, rank)          # this rank's tokens, in the plan's order
    out = cpattn.ring_attention_varlen(q, k, v, plan, causal=True)
    full = plan.unshard(out)                      # back to the packed order (all-gather)

A rank's tokens are, in this order: its shards of the documents split over every rank, of those
split over a subset of the ranks (each padded to the granularity of its ranks and sharded as
ring_attention_varlen does), then its whole documents one after the other. The plan is a pure
function of its arguments, so every rank computes the same one from the agreed cu_seqlens
(docs/packed-documents.md explains when a document is split).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from cpattn.core.layout import LAYOUTS, document_shards, shard_positions
from cpattn.core.signature import digest_ints
from cpattn.core.validation import (
    check_choice,
    check_cu_seqlens,
    check_int,
    check_window,
    error,
    group_info,
)

# split=: "balanced" splits only the documents it must for the work to balance within
# `tolerance`; "all" splits every document (per-document zigzag, ring_attention_varlen's
# sharding of a cu_seqlens); "none" splits none (no communication at all); "auto" lets the cost
# model pick among them (cpattn.plan.plan_documents).
SPLITS = ("auto", "balanced", "all", "none")


def visible_pairs(positions: torch.Tensor, length: int, causal: bool, window: tuple,
                  prefix: int) -> torch.Tensor:
    """The keys each query at `positions` (within a document of `length` tokens) sees: the
    mask rule of csrc/include/cpattn/mask.h (j < prefix, or j in [i - left, i] / [i - left,
    i + right]), counted per query (int64) by the header itself (op visible_keys)."""
    left, right = window
    return torch.ops.cpattn.visible_keys(positions, length, causal, left, right, prefix)


@dataclass(frozen=True)
class DocumentPlan:
    """Which rank holds which tokens of a batch of packed documents (cpattn.shard_documents).

    lengths: every document's length, in packed order; split: the indices of the split
    documents, in packed order, and spans: the ranks each is split over (all of them, or a
    subset: per-document zigzag over those ranks); whole[r]: the indices of the documents rank
    r holds whole, in packed order; work[r]: rank r's attention work (visible query-key pairs);
    split_tokens: tokens per rank of the documents split over every rank (their padded shards,
    the same on every rank); subset_tokens[r]: rank r's tokens of the documents split over a
    subset of the ranks; tokens[r]: all of rank r's tokens, in that order: split over all,
    split over a subset, whole. Frozen and hashable: pass it to the
    attention as it is (under torch.compile too)."""

    lengths: tuple
    world: int
    layout: str
    causal: bool
    window: tuple
    prefix: tuple
    split: tuple
    spans: tuple
    whole: tuple
    work: tuple
    split_tokens: int
    subset_tokens: tuple
    tokens: tuple
    signature: bytes  # the plan in 32 bytes, for the agreement check

    @property
    def balance(self) -> float:
        """max / min attention work per rank (1.0: perfect; inf: a rank without work)."""
        lo, hi = min(self.work), max(self.work)
        return 1.0 if hi == 0 else (float("inf") if lo == 0 else hi / lo)

    @property
    def split_lengths(self) -> tuple:
        return tuple(self.lengths[d] for d in self.split)

    def whole_lengths(self, rank: int) -> tuple:
        return tuple(self.lengths[d] for d in self.whole[rank])

    def rank_splits(self, rank: int) -> tuple:
        """(document, its ranks) of the split documents rank holds a shard of, in the order
        of its tokens: those split over every rank, then those over a subset."""
        full = tuple(range(self.world))
        held = [(d, m) for d, m in zip(self.split, self.spans) if rank in m]
        return tuple(sorted(held, key=lambda dm: dm[1] != full))

    def subset_pieces(self, rank: int) -> tuple:
        """rank's shards of the documents split over a subset of the ranks, in the order of
        its tokens: (document, its ranks, rank's index among them, offset from the first such
        token, shard length)."""
        full, at, pieces = tuple(range(self.world)), 0, []
        for d, members in self.rank_splits(rank):
            if members != full:
                n = _shard_length(self.lengths[d], self.layout, len(members))
                pieces.append((d, members, members.index(rank), at, n))
                at += n
        return tuple(pieces)

    @property
    def full_split(self) -> tuple:
        """The documents split over every rank."""
        return tuple(d for d, m in zip(self.split, self.spans) if len(m) == self.world)

    def local_cu_seqlens(self, rank: int) -> torch.Tensor:
        """Boundaries of rank's whole documents within its tokens (they start after its
        shards of the split documents)."""
        return torch.tensor((0, *self.whole_lengths(rank)), dtype=torch.int64).cumsum(0) \
            + self.split_tokens + self.subset_tokens[rank]

    def sent_tokens(self, rank: Optional[int] = None) -> int:
        """Tokens of K/V rank sends per ring pass or gather (default: the most any rank
        sends): its shard of each split document to each other rank of that document."""
        if rank is None:
            return max((self.sent_tokens(r) for r in range(self.world)), default=0)
        return sum((len(m) - 1) * _shard_length(self.lengths[d], self.layout, len(m))
                   for d, m in self.rank_splits(rank))

    def positions(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For each of rank's tokens: (its index into the packed sequence, -1 for padding;
        its position within its document, e.g. for RoPE, -1 for padding)."""
        return _positions(self, rank)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
        """rank's tokens of the packed tensor x along `dim` (padding slots zero)."""
        index, _ = self.positions(rank)
        padded = torch.cat([x, x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1:]))], dim)
        slots = torch.where(index < 0, x.shape[dim], index).to(x.device)
        return padded.index_select(dim, slots)

    def unshard(self, x_local: torch.Tensor, *, group=None, dim: int = 0) -> torch.Tensor:
        """All-gathers every rank's tokens back into the packed sequence (padding dropped).
        Differentiable (a token's gradient is the sum of the ranks' gradients of it)."""
        from cpattn.sharding.sequences import unshard_by

        what = "cpattn.DocumentPlan.unshard"
        _, rank, world = group_info(group)
        most = max(self.tokens)

        def locate(local: int, world_: int):
            if world_ != self.world:
                raise error(what, "group", world_, f"has {world_} ranks; the plan is for "
                            f"{self.world}")
            if given != self.tokens[rank]:
                raise error(what, "x_local", given, f"must hold rank {rank}'s "
                            f"{self.tokens[rank]} tokens of the plan")
            index, _ = self.positions(rank)
            index = torch.cat([index, index.new_full((most - index.numel(),), -1)])
            return index, sum(self.lengths), [("plan", self.signature)]

        given = None  # a bad x_local or dim: unshard_by raises it on every rank
        if isinstance(x_local, torch.Tensor) and isinstance(dim, int) and \
                -x_local.dim() <= dim < x_local.dim():
            d = dim % x_local.dim()
            given = x_local.shape[d]
            if rank < self.world and given == self.tokens[rank]:  # pad to the longest rank's
                x_local = torch.cat([x_local, x_local.new_zeros(
                    (*x_local.shape[:d], most - given, *x_local.shape[d + 1:]))], d)
        return unshard_by(what, x_local, group, dim, locate)

    def describe(self) -> str:
        """One line: what is split, bytes and balance."""
        over_all = sum(len(m) == self.world for m in self.spans)
        return (f"{len(self.split)} of {len(self.lengths)} documents split ({over_all} over "
                f"all {self.world} ranks; {sum(self.split_lengths)} of {sum(self.lengths)} "
                "tokens), "
                f"{self.sent_tokens()} K/V tokens sent per rank, work max/min "
                f"{self.balance:.3f}")


@functools.lru_cache(maxsize=65536)
def _shard_length(n: int, layout: str, members: int) -> int:
    """Tokens per member of a document of n tokens split over `members` ranks (padded as
    ring_attention_varlen pads it: cpattn.core.layout.document_shards)."""
    return document_shards([n], LAYOUTS[layout], members)[0][0] // members


@functools.lru_cache(maxsize=256)
def _positions(plan: DocumentPlan, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    starts = [0]
    for n in plan.lengths:
        starts.append(starts[-1] + n)
    index, within = [], []
    for d, members in plan.rank_splits(rank):
        pos = shard_positions(plan.lengths[d], plan.layout, len(members), members.index(rank))
        index.append(torch.where(pos >= 0, starts[d] + pos, -1))
        within.append(pos)
    for d in plan.whole[rank]:
        pos = torch.arange(plan.lengths[d], dtype=torch.int64)
        index.append(starts[d] + pos)
        within.append(pos)
    if not index:
        empty = torch.empty(0, dtype=torch.int64)
        return empty, empty
    return torch.cat(index), torch.cat(within)


@functools.lru_cache(maxsize=65536)
def _whole_work(n: int, causal: bool, window: tuple, prefix: int) -> int:
    return int(visible_pairs(torch.arange(n), n, causal, window, prefix).sum())


@functools.lru_cache(maxsize=65536)
def _split_work(n: int, members: int, layout: str, causal: bool, window: tuple,
                prefix: int) -> tuple:
    """Each member's work from its shard of a document of n tokens split over `members`."""
    work = []
    for i in range(members):
        pos = shard_positions(n, layout, members, i)
        work.append(int(visible_pairs(pos[pos >= 0], n, causal, window, prefix).sum()))
    return tuple(work)


def _spread(order, doc_work, world: int, cap: float, at_least: dict) -> tuple[dict, list]:
    """Heaviest first, each document whole on the least-loaded rank if that stays within
    `cap`, else split over the fewest least-loaded ranks that keep within it (over all of
    them if none do). at_least[d]: the fewest ranks document d may have. Returns ({document:
    its ranks}, approximate loads)."""
    loads = [0.0] * world
    placed = {}
    for d in order:
        ranked = sorted(range(world), key=lambda r: (loads[r], r))
        for m in range(at_least.get(d, 1), world + 1):
            if m == world or max(loads[r] for r in ranked[:m]) + doc_work[d] / m <= cap:
                break
        members = tuple(sorted(ranked[:m]))
        placed[d] = members
        for r in members:
            loads[r] += doc_work[d] / m
    return placed, loads


def _make_plan(lengths, world, layout, causal, window, prefix, placed: dict) -> DocumentPlan:
    """The plan of documents placed on ranks ({document: its ranks}; one rank: whole)."""
    full = tuple(range(world))
    split = tuple(d for d in range(len(lengths)) if d in placed and len(placed[d]) > 1)
    spans = tuple(placed[d] for d in split)
    whole = tuple(tuple(d for d in range(len(lengths)) if placed.get(d) == (r,))
                  for r in range(world))
    work = [0] * world
    for d, members in zip(split, spans):
        for r, w in zip(members, _split_work(lengths[d], len(members), layout, causal, window,
                                             prefix[d])):
            work[r] += w
    for r, docs in enumerate(whole):
        work[r] += sum(_whole_work(lengths[d], causal, window, prefix[d]) for d in docs)
    split_tokens = sum(_shard_length(lengths[d], layout, world)
                       for d, members in zip(split, spans) if members == full)
    subset_tokens = tuple(sum(_shard_length(lengths[d], layout, len(members))
                              for d, members in zip(split, spans)
                              if members != full and r in members) for r in range(world))
    tokens = tuple(split_tokens + subset_tokens[r] + sum(lengths[d] for d in whole[r])
                   for r in range(world))
    flat = [world, LAYOUTS[layout], int(causal), *window, len(lengths), *lengths, *prefix]
    for d, members in zip(split, spans):
        flat += [-1, d, *members]
    for docs in whole:
        flat += [-2, *docs]
    signature = hashlib.sha256(digest_ints(flat)).digest()
    return DocumentPlan(lengths, world, layout, causal, window, prefix, split, spans, whole,
                        tuple(work), split_tokens, subset_tokens, tokens, signature)


# Caps on a rank's work (times the mean) that "balanced" tries, most packed first.
_CAPS = (1.0, 1.005, 1.01, 1.02, 1.03, 1.05, 1.08, 1.12, 1.2)


@functools.lru_cache(maxsize=1024)
def _plan(lengths: tuple, world: int, layout: str, causal: bool, window: tuple, prefix: tuple,
          split: str, tolerance: float, split_above: Optional[int]) -> DocumentPlan:
    args = (lengths, world, layout, causal, window, prefix)
    nonempty = [d for d, n in enumerate(lengths) if n > 0]
    if world == 1 or split == "none":
        doc_work = [_whole_work(n, causal, window, p) for n, p in zip(lengths, prefix)]
        order = sorted(nonempty, key=lambda d: (-doc_work[d], d))
        placed, _ = _spread(order, doc_work, world, float("inf"), {})
        return _make_plan(*args, placed)
    full = tuple(range(world))
    if split == "all":
        return _make_plan(*args, {d: full for d in nonempty})
    # "balanced": of the spreads under each cap, the one within tolerance that sends the
    # fewest bytes (its busiest sender's); none within: every document split (balanced).
    doc_work = [_whole_work(n, causal, window, p) for n, p in zip(lengths, prefix)]
    order = sorted(nonempty, key=lambda d: (-doc_work[d], d))  # ties: the earlier document
    mean = sum(doc_work) / world
    at_least = {d: 2 for d in nonempty if split_above is not None and lengths[d] > split_above}
    candidates = [_make_plan(*args, _spread(order, doc_work, world, cap * mean, at_least)[0])
                  for cap in _CAPS]
    candidates.append(_make_plan(*args, _heaviest_over_all(order, doc_work, args, tolerance,
                                                           at_least)))
    if not at_least:  # nothing split at all (the first with 0 bytes when it balances)
        candidates.insert(0, _make_plan(*args, _spread(order, doc_work, world, float("inf"),
                                                       {})[0]))
    within = [p for p in candidates if p.balance <= tolerance]
    if within:
        return min(within, key=lambda p: p.sent_tokens())  # ties: the first (tightest cap)
    # None within: the best balanced of those and of every document split; the fewest bytes
    # among equals.
    fallbacks = [*candidates, _make_plan(*args, {d: full for d in nonempty})]
    return min(fallbacks, key=lambda p: (p.balance, p.sent_tokens()))


def _heaviest_over_all(order, doc_work, args, tolerance: float, at_least: dict) -> dict:
    """The heaviest documents split over every rank one by one until the others, each whole
    on the least-loaded rank (heaviest first), balance within tolerance."""
    lengths, world, layout, causal, window, prefix = args
    full = tuple(range(world))
    base = [0] * world
    for n_split in range(len(order) + 1):
        split, rest = order[:n_split], order[n_split:]
        if n_split:
            d = split[-1]
            for r, w in zip(full, _split_work(lengths[d], world, layout, causal, window,
                                              prefix[d])):
                base[r] += w
        if any(at_least.get(d, 1) > 1 for d in rest):
            continue
        loads = list(base)
        placed = {d: full for d in split}
        for d in rest:
            r = min(full, key=lambda i: (loads[i], i))
            placed[d] = (r,)
            loads[r] += doc_work[d]
        if max(loads) == 0 or (min(loads) > 0 and max(loads) / min(loads) <= tolerance):
            return placed
    return {d: full for d in order}


def shard_documents(cu_seqlens, *, world_size: Optional[int] = None, group=None,
                    layout: str = "zigzag", causal: bool = True, window=(-1, -1),
                    prefix_len=0, split: str = "auto", tolerance: float = 1.05,
                    split_above: Optional[int] = None, **model) -> DocumentPlan:
    """The document-aware sharding of packed documents over `world_size` ranks (default: the
    group's size): the same plan on every rank for the same arguments.

    Documents stay whole on one rank unless splitting is needed: with split="balanced" they
    are placed heaviest first (by attention work: visible query-key pairs under causal /
    window / prefix_len), whole on the least-loaded rank if its work stays within a cap, else
    split over the fewest least-loaded ranks that keep within it; of the caps tried, the plan
    within `tolerance` (max / min work per rank) whose busiest sender sends the fewest K/V
    tokens. split="all" splits every document over every rank (ring_attention_varlen's
    sharding of a cu_seqlens), "none" none (no communication at all). split="auto" (default)
    predicts the time of all three with the cost model (cpattn.plan) and
    takes the fastest; `model` may give the problem's heads, kv_heads, head_dim, dtype,
    training (cpattn.plan.plan_documents) and machine (default: the group's, as
    strategy="auto" uses, so every rank of an initialised group must call it the first time;
    the cpu-gloo preset without torch.distributed). Documents longer than `split_above`
    tokens are never kept whole. window / prefix_len: as the attention will use them (prefix_len
    an int or one per document)."""
    what = "cpattn.shard_documents"
    lengths = tuple(int(n) for n in check_cu_seqlens(what, cu_seqlens).diff().tolist())
    if world_size is None:
        _, _, world_size = group_info(group)
    world = check_int(what, "world_size", world_size, minimum=1)
    check_choice(what, "layout", layout, tuple(LAYOUTS))
    check_choice(what, "split", split, SPLITS)
    if isinstance(causal, bool) is False:
        raise error(what, "causal", causal, "must be a bool")
    window = check_window(window, what)
    if isinstance(prefix_len, torch.Tensor):
        prefix = tuple(int(p) for p in prefix_len.tolist())
    elif isinstance(prefix_len, (list, tuple)):
        prefix = tuple(int(p) for p in prefix_len)
    else:
        prefix = (check_int(what, "prefix_len", prefix_len, minimum=0),) * len(lengths)
    if len(prefix) != len(lengths):
        raise error(what, "prefix_len", len(prefix), f"must hold one prefix per document "
                    f"({len(lengths)})")
    prefix = tuple(min(p, n) for p, n in zip(prefix, lengths))
    if not (isinstance(tolerance, (int, float)) and tolerance >= 1.0):
        raise error(what, "tolerance", tolerance, "must be a number >= 1 (max / min work)")
    if split_above is not None:
        split_above = check_int(what, "split_above", split_above, minimum=0)
        if split == "none":
            raise error(what, "split_above", split_above, 'contradicts split="none"')
    args = (lengths, world, layout, bool(causal), tuple(window), prefix)
    if split != "auto":
        if model:
            raise error(what, next(iter(model)), "...", 'is only taken with split="auto"')
        return _plan(*args, split, float(tolerance), split_above)
    from cpattn import plan as cost_model

    machine = model.pop("machine", None)
    if machine is None:  # the group's, as strategy="auto" plans with (a collective the 1st time)
        machine = cost_model.machine_for(group) if dist.is_available() and \
            dist.is_initialized() else cost_model.PRESETS["cpu-gloo"]
    candidates = SPLITS[1:]
    if world > 1 and split_above is not None and max(lengths, default=0) > split_above:
        # documents longer than split_above are never kept whole: "none" would
        candidates = tuple(s for s in candidates if s != "none")
    plans = {s: _plan(*args, s, float(tolerance), split_above) for s in candidates}
    return cost_model.plan_documents(plans, machine, **model)[0][0]
