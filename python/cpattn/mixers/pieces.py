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


class FlatRows(NamedTuple):
    """How the recurrences of cpattn.mixers.mixing run a rank's tokens, for blocks of `block`
    tokens (ints only: a constant under torch.compile):

    - whole: the local tokens of its whole documents (pieces that neither continue nor are
      continued elsewhere), in local order: one row, a reset at each position in `resets`
      (each document's start but the row's first);
    - linked: the tokens of its linked pieces (pieces(rank)[i] for i in linked(rank)), each
      from a block's start, padded with local_len (an identity slot: zero inputs) to a block's
      end; the piece's first block starts[i] and last block ends[i];
    - back: each local token's index in whole + linked (their outputs concatenated), or
      len(whole) + len(linked) (a zero: padding tokens).

    Work follows the token count: len(whole) + len(linked) <= local tokens + (block - 1) per
    linked piece."""

    whole: tuple
    resets: tuple
    linked: tuple
    starts: tuple
    ends: tuple
    back: tuple


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

    # --- local tokens <-> the rows the mixers run ------------------------------------------------
    def flat_rows(self, rank: int, block: int) -> FlatRows:
        """rank's tokens as the recurrences run them (FlatRows)."""
        return _flat_rows(self, rank, block)

    def linked_block(self, rank: int, block: int) -> int:
        """The block for rank's linked row, at most `block`: the power of two from 4 that
        minimises its padded tokens plus BLOCK_COST per block (short linked pieces, e.g. packed
        documents each split over every rank, would otherwise pad to `block` each)."""
        return _linked_block(self, rank, block)

    def conv_rows(self, rank: int, width: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """For a causal convolution reading `width` earlier inputs, one sequence of rank's
        pieces each after its halo: (its entries as indices into the local tokens, then the
        pieces' halos (n * width, piece by piece), then a zero; for each local token its output
        in the convolution's output (the sequence less `width`), or one past it: a zero)."""
        return _conv_rows(self, rank, width)

    # --- the chains -----------------------------------------------------------------------------
    def chain(self, doc: int) -> tuple:
        """(rank, piece) of the document's pieces in global order."""
        return _chains(self)[doc]

    def starts_document(self, rank: int) -> tuple[bool, ...]:
        """For each of rank's pieces: whether it starts its document (no predecessor)."""
        return _starts_document(self, rank)

    def linked(self, rank: int) -> tuple[int, ...]:
        """rank's pieces (indices) that continue a document or are continued on another piece:
        the pieces of the state scan (its summaries and entry states are theirs, in this
        order). A whole document is not linked."""
        return _linked(self, rank)

    @property
    def slots(self) -> int:
        """Summaries each rank publishes (the most of any rank): one per piece whose document
        continues in a later piece."""
        return _slots(self)

    def published(self, rank: int) -> tuple[int, ...]:
        """The linked pieces (positions in linked(rank)) that publish a summary, in slot
        order."""
        return _published(self, rank)

    def predecessors(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """For each of rank's linked pieces: the gathered slots (source rank * slots + slot) of
        the pieces before it in its document, in global order (empty: it starts its
        document)."""
        return _predecessors(self, rank)

    def fold_steps(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """predecessors(rank) as the fold's steps: for each step, each linked piece's gathered
        slot, left-padded with world * slots (the identity) to the longest chain."""
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
def _starts_document(piece_map: PieceMap, rank: int) -> tuple[bool, ...]:
    return tuple(p.start == piece_map.bounds[p.doc] for p in piece_map.pieces[rank])


@_constant
def _chains(piece_map: PieceMap) -> tuple:
    chains = [[] for _ in range(len(piece_map.bounds) - 1)]
    for r, ps in enumerate(piece_map.pieces):
        for j, p in enumerate(ps):
            chains[p.doc].append((p.start, r, j))
    return tuple(tuple((r, j) for _, r, j in sorted(c)) for c in chains)


@_constant
def _linked(piece_map: PieceMap, rank: int) -> tuple[int, ...]:
    return tuple(j for j, p in enumerate(piece_map.pieces[rank])
                 if len(piece_map.chain(p.doc)) > 1)


@_constant
def _published(piece_map: PieceMap, rank: int) -> tuple[int, ...]:
    return tuple(i for i, j in enumerate(piece_map.linked(rank))
                 if piece_map.chain(piece_map.pieces[rank][j].doc)[-1] != (rank, j))


@_constant
def _slots(piece_map: PieceMap) -> int:
    return max((len(_published(piece_map, r)) for r in range(piece_map.world)), default=0)


@_constant
def _predecessors(piece_map: PieceMap, rank: int) -> tuple[tuple[int, ...], ...]:
    slots = _slots(piece_map)
    slot_of = {}
    for r in range(piece_map.world):
        for s, i in enumerate(piece_map.published(r)):
            slot_of[(r, piece_map.linked(r)[i])] = r * slots + s
    out = []
    for j in piece_map.linked(rank):
        chain = piece_map.chain(piece_map.pieces[rank][j].doc)
        out.append(tuple(slot_of[c] for c in chain[:chain.index((rank, j))]))
    return tuple(out)


@_constant
def _fold_steps(piece_map: PieceMap, rank: int) -> tuple[tuple[int, ...], ...]:
    preds = _predecessors(piece_map, rank)
    steps = max((len(p) for p in preds), default=0)
    pad = piece_map.world * _slots(piece_map)
    ids = [(pad,) * (steps - len(p)) + p for p in preds]
    return tuple(tuple(i[t] for i in ids) for t in range(steps))


@_constant
def _flat_rows(piece_map: PieceMap, rank: int, block: int) -> FlatRows:
    pieces, local = piece_map.pieces[rank], piece_map.local_len[rank]
    linked = set(piece_map.linked(rank))
    whole, resets = [], []
    for j, p in enumerate(pieces):
        if j not in linked:
            if whole:  # (the row starts from a zero state: no reset needed at its start)
                resets.append(len(whole))
            whole.extend(range(p.local, p.local + p.length))
    row, starts, ends = [], [], []
    for j in piece_map.linked(rank):
        p = pieces[j]
        starts.append(len(row) // block)
        row.extend(range(p.local, p.local + p.length))
        row.extend([local] * (-len(row) % block))
        ends.append(len(row) // block - 1)
    back = [len(whole) + len(row)] * local
    for at, i in enumerate(whole):
        back[i] = at
    for at, i in enumerate(row):
        if i < local:
            back[i] = len(whole) + at
    return FlatRows(tuple(whole), tuple(resets), tuple(row), tuple(starts), tuple(ends),
                    tuple(back))


BLOCK_COST = 16  # tokens: the loop's cost per block, against the padding's per token


@_constant
def _linked_block(piece_map: PieceMap, rank: int, block: int) -> int:
    lengths = [piece_map.pieces[rank][j].length for j in piece_map.linked(rank)]
    sizes = [b for b in (4, 8, 16, 32, 64, 128, 256) if b < block] + [block]
    return min(sizes, key=lambda b: (sum(-(-n // b) * (b + BLOCK_COST) for n in lengths), -b))


@_constant
def _conv_rows(piece_map: PieceMap, rank: int, width: int):
    pieces, local = piece_map.pieces[rank], piece_map.local_len[rank]
    seq, out = [], [0] * local
    for j, p in enumerate(pieces):
        seq.extend(range(local + j * width, local + (j + 1) * width))  # its halo
        for i in range(p.length):
            out[p.local + i] = len(seq) - width + i
        seq.extend(range(p.local, p.local + p.length))
    zero = max(len(seq) - width, 0)
    covered = {p.local + i for p in pieces for i in range(p.length)}
    out = [o if i in covered else zero for i, o in enumerate(out)]
    return tuple(seq), tuple(out)


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
