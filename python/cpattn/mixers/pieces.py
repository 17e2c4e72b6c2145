"""Which rank holds which pieces of which document, for the token mixers outside attention.

A *piece* is a maximal run of a rank's local tokens whose global indices are consecutive and lie
in one document. A document's pieces, sorted by their first global index, form its *chain*: the
convolution halo of a piece comes from the tokens just before it in its chain, its entry state
from the fold of the summaries of the pieces before it. Which rank holds a piece does not matter,
so one piece map serves every layout cpattn shards with (contiguous, zigzag, document plans, the
hybrid mesh, padding) as long as a rank's tokens form few runs (striped makes every token a piece
and is refused by the integration).

The piece map is built from what cpattn already computes: every rank's global indices
(cpattn.positions, DocumentPlan.positions, Documents.local_positions; -1 for padding) and the
documents' boundaries. It is a pure function of them, the same on every rank, and hashable:
cached, and under torch.compile its queries are constants (computed in Python while dynamo
traces). Ranks are numbered as the exchange orders them (cpattn.ContextParallel.rank).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from cpattn.core.signature import digest_ints


class Piece(NamedTuple):
    """A run of a rank's tokens: its first local index, length, document and first global index.
    (A tuple: the piece map stays a constant that torch.compile can hold.)"""

    local: int
    length: int
    doc: int
    start: int


class PieceMap(NamedTuple):
    """pieces[r]: rank r's pieces in local order; local_len[r]: its number of local tokens
    (padding included); bounds: the documents' boundaries in the global index (from 0). (A
    tuple of ints: torch.compile holds it as a constant.)"""

    world: int
    bounds: tuple
    pieces: tuple
    local_len: tuple
    signature: bytes

    def __repr__(self) -> str:  # (short: the piece map is a key of caches and appears in errors)
        return (f"PieceMap(world={self.world}, documents={len(self.bounds) - 1}, "
                f"pieces={[len(p) for p in self.pieces]})")

    # --- local token <-> piece rows -------------------------------------------------------------
    def longest(self, rank: int) -> int:
        """The longest piece of rank (the rows' length); 0 without pieces."""
        return _longest(self, rank)

    def lengths(self, rank: int) -> tuple[int, ...]:
        """The lengths of rank's pieces."""
        return _lengths(self, rank)

    def uniform(self, rank: int) -> bool:
        """Whether rank's pieces tile its local tokens in order with one length (no padding):
        pieces are then a view (B, n, L / n) of the local tokens."""
        return _uniform(self, rank)

    def piece_rows(self, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(for each slot of the (pieces, longest) rows, its local token or local_len: a zero
        row; for each local token, its slot in the rows or pieces * longest: a zero row)."""
        return _piece_rows(self, rank)

    # --- the chains -----------------------------------------------------------------------------
    def chain(self, doc: int) -> tuple:
        """(rank, piece) of the document's pieces in global order."""
        return _chains(self)[doc]

    def starts_document(self, rank: int) -> tuple[bool, ...]:
        """For each of rank's pieces: whether it starts its document (no predecessor)."""
        return _starts_document(self, rank)

    @property
    def slots(self) -> int:
        """Summaries each rank publishes (the most of any rank): one per piece whose document
        continues in a later piece."""
        return _slots(self)

    def published(self, rank: int) -> tuple[int, ...]:
        """rank's pieces (indices) that publish a summary, in slot order."""
        return _published(self, rank)

    def predecessors(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """For each of rank's pieces: the gathered slots (source rank * slots + slot) of the
        pieces before it in its document, in global order (empty: it starts its document)."""
        return _predecessors(self, rank)

    def fold_steps(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """predecessors(rank) as the fold's steps: for each step, each piece's gathered slot,
        left-padded with world * slots (the identity) to the longest chain."""
        return _fold_steps(self, rank)

    # --- the convolution halo -------------------------------------------------------------------
    def halo(self, rank: int, width: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
        """For a causal convolution reading `width` earlier tokens: (the local tokens rank
        publishes, padded with -1 to the most any rank publishes; for each of rank's pieces, for
        each of the `width` tokens before it (oldest first), its gathered row (source rank *
        rows + row), or world * rows: a zero row (before the document's start))."""
        return _halo(self, rank, width)


def _constant(fn):
    """fn cached, and a constant under torch.compile (run in Python while dynamo traces: dynamo
    would trace a cached function's body instead)."""
    cached = functools.lru_cache(maxsize=512)(fn)

    @functools.wraps(fn)
    def constant(*args):
        return cached(*args)

    return torch._dynamo.assume_constant_result(constant)


def build_piece_map(indices: Sequence[torch.Tensor], bounds: Sequence[int]) -> PieceMap:
    """The piece map of W ranks holding the global indices indices[r] (int64, -1 for padding) of
    documents with these boundaries. Raises RuntimeError unless every token of every document is
    held exactly once (a layout bug, never a user error)."""
    idx = tuple(tuple(int(i) for i in torch.as_tensor(t).tolist()) for t in indices)
    return _build(idx, tuple(int(b) for b in bounds))


@functools.lru_cache(maxsize=128)
def _build(indices: tuple, bounds: tuple) -> PieceMap:
    cu = torch.tensor(bounds, dtype=torch.int64)
    pieces, held = [], 0
    for idx in indices:
        t = torch.tensor(idx, dtype=torch.int64)
        valid = t >= 0
        doc = torch.searchsorted(cu, t.clamp(min=0), right=True) - 1
        # (padding before a token never continues it: -1 + 1 would be global index 0)
        prev = torch.cat([t.new_tensor([-2]), torch.where(valid, t, -2)[:-1]])
        prev_doc = torch.cat([t.new_tensor([-1]), doc[:-1]])
        new = valid & ((t != prev + 1) | (doc != prev_doc))
        firsts = new.nonzero().flatten()
        if firsts.numel():
            run = torch.cumsum(new.to(torch.int64), 0) - 1
            lengths = torch.bincount(run[valid], minlength=firsts.numel())
        else:
            lengths = firsts
        rank_pieces = tuple(Piece(int(i), int(n), int(doc[i]), int(t[i]))
                            for i, n in zip(firsts.tolist(), lengths.tolist()))
        pieces.append(rank_pieces)
        held += int(valid.sum())
    # Every document's pieces must tile it exactly (and nothing else be held).
    for d in range(len(bounds) - 1):
        at = bounds[d]
        for p in sorted((p for ps in pieces for p in ps if p.doc == d), key=lambda p: p.start):
            if p.start != at:
                raise RuntimeError(f"cpattn.mixers: the ranks' tokens do not tile document {d} "
                                   f"[{bounds[d]}, {bounds[d + 1]}): a piece starts at {p.start}, "
                                   f"expected {at}")
            at += p.length
        if at != bounds[d + 1]:
            raise RuntimeError(f"cpattn.mixers: document {d} [{bounds[d]}, {bounds[d + 1]}) is "
                               f"held up to {at} only")
    if held != bounds[-1] - bounds[0]:
        raise RuntimeError(f"cpattn.mixers: the ranks hold {held} tokens, the documents "
                           f"{bounds[-1] - bounds[0]}")
    flat = [len(indices), len(bounds), *bounds]
    for ps, idx in zip(pieces, indices):
        flat += [-1, len(idx)] + [v for p in ps for v in (p.local, p.length, p.doc, p.start)]
    signature = hashlib.sha256(digest_ints(flat)).digest()
    return PieceMap(len(indices), bounds, tuple(pieces), tuple(len(i) for i in indices),
                     signature)


@_constant
def _longest(piece_map: PieceMap, rank: int) -> int:
    return max((p.length for p in piece_map.pieces[rank]), default=0)


@_constant
def _lengths(piece_map: PieceMap, rank: int) -> tuple[int, ...]:
    return tuple(p.length for p in piece_map.pieces[rank])


@_constant
def _uniform(piece_map: PieceMap, rank: int) -> bool:
    ps = piece_map.pieces[rank]
    if not ps:
        return piece_map.local_len[rank] == 0
    n = ps[0].length
    return all(p.length == n and p.local == i * n for i, p in enumerate(ps)) and \
        n * len(ps) == piece_map.local_len[rank]


@_constant
def _starts_document(piece_map: PieceMap, rank: int) -> tuple[bool, ...]:
    return tuple(p.start == piece_map.bounds[p.doc] for p in piece_map.pieces[rank])


@_constant
def _piece_rows(piece_map: PieceMap, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ps, local = piece_map.pieces[rank], piece_map.local_len[rank]
    longest = piece_map.longest(rank)
    rows = [local] * (len(ps) * longest)
    slot = [len(ps) * longest] * local
    for j, p in enumerate(ps):
        for i in range(p.length):
            rows[j * longest + i] = p.local + i
            slot[p.local + i] = j * longest + i
    return tuple(rows), tuple(slot)


@_constant
def _chains(piece_map: PieceMap) -> tuple:
    chains = [[] for _ in range(len(piece_map.bounds) - 1)]
    for r, ps in enumerate(piece_map.pieces):
        for j, p in enumerate(ps):
            chains[p.doc].append((p.start, r, j))
    return tuple(tuple((r, j) for _, r, j in sorted(c)) for c in chains)


@_constant
def _published(piece_map: PieceMap, rank: int) -> tuple[int, ...]:
    return tuple(j for j, p in enumerate(piece_map.pieces[rank])
                 if piece_map.chain(p.doc)[-1] != (rank, j))


@_constant
def _slots(piece_map: PieceMap) -> int:
    return max((len(_published(piece_map, r)) for r in range(piece_map.world)), default=0)


@_constant
def _predecessors(piece_map: PieceMap, rank: int) -> tuple[tuple[int, ...], ...]:
    slots = _slots(piece_map)
    slot_of = {}
    for r in range(piece_map.world):
        for s, j in enumerate(piece_map.published(r)):
            slot_of[(r, j)] = r * slots + s
    out = []
    for j, p in enumerate(piece_map.pieces[rank]):
        chain = piece_map.chain(p.doc)
        out.append(tuple(slot_of[c] for c in chain[:chain.index((rank, j))]))
    return tuple(out)


@_constant
def _fold_steps(piece_map: PieceMap, rank: int) -> tuple[tuple[int, ...], ...]:
    preds = _predecessors(piece_map, rank)
    steps = max((len(p) for p in preds), default=0)
    pad = piece_map.world * _slots(piece_map)
    ids = [(pad,) * (steps - len(p)) + p for p in preds]
    return tuple(tuple(i[t] for i in ids) for t in range(steps))


@functools.lru_cache(maxsize=512)
def _halo_rows(piece_map: PieceMap, width: int) -> tuple:
    """(per rank: the local tokens it publishes, sorted; for each global index a piece reads
    before its start: (its rank, its local index))."""
    runs = sorted((p.start, r, p) for r, ps in enumerate(piece_map.pieces) for p in ps)
    starts = [s for s, _, _ in runs]
    owner = {}
    needed = [set() for _ in range(piece_map.world)]
    for ps in piece_map.pieces:
        for p in ps:
            for g in range(max(piece_map.bounds[p.doc], p.start - width), p.start):
                _, r, q = runs[bisect.bisect_right(starts, g) - 1]
                owner[g] = (r, q.local + g - q.start)
                needed[r].add(owner[g][1])
    return tuple(tuple(sorted(n)) for n in needed), owner


@_constant
def _halo(piece_map: PieceMap, rank: int, width: int):
    publish, owner = _halo_rows(piece_map, width)
    rows = max((len(p) for p in publish), default=0)
    row_of = {(r, i): r * rows + k for r, pub in enumerate(publish) for k, i in enumerate(pub)}
    zero = piece_map.world * rows
    sources = []
    for p in piece_map.pieces[rank]:
        first = piece_map.bounds[p.doc]
        sources.append(tuple(row_of[owner[g]] if g >= first else zero
                             for g in range(p.start - width, p.start)))
    mine = publish[rank] + (-1,) * (rows - len(publish[rank]))
    return mine, tuple(sources)
