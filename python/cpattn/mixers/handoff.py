"""A token mixer's prefill that continues from, and hands off, its recurrent state: what
generation needs of the mixers (cpattn.integrations' ContextParallelCache).

`Handoff` is the `Mixing` of a prefill chunk of rows of whole sequences (one document per row, the
same piece map for every row). Besides what `Mixing` gives an adapter it

- starts each row from a cached state: `history`, the conv inputs before the chunk (they reach
  the chunk's first k - 1 outputs, added as a correction to the tokens there), and `initial`, the
  recurrent state before the chunk. A sequence held whole by the rank (one process, or the part
  after the context-parallel lead) starts its row's loop from it. A sequence split over the
  ranks starts its first piece from it: folded into that piece's summary (M initial + S), so the
  state scan carries it to every later piece's entry, and added to the first piece's entry;
- records what the row ends with: `tail`, its last k conv inputs (the cache layout's width: the
  module's own decode shifts the oldest out), gathered from the ranks that hold them (one
  exchange of k rows per rank, summed: each row is held by one rank, the others send zeros, so
  the sum is exact); and `final`, its final state: the whole row's loop's last state, or the
  state after the piece that ends the sequence, advanced from that piece's entry through its
  blocks on the rank that holds it (`owner`; `handed_off` broadcasts it).

Every rank calls both exchanges (the adapter calls conv and the recurrence on every rank).
States are in the kernels' layout (cpattn.mixers.kernels): fp32, float64 for float64 inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from cpattn.mixers.algebra import apply_transition
from cpattn.mixers.mixing import Mixing
from cpattn.mixers.pieces import PieceMap

# (state (B, ...), source rank) -> the source's state on every rank
Broadcast = Callable[[torch.Tensor, int], torch.Tensor]


def document_positions(piece_map: PieceMap, rank: int, device=None) -> torch.Tensor:
    """(L,) int64: each local token's position in its document (-1: padding)."""
    pos = torch.full((piece_map.local_len[rank],), -1, dtype=torch.int64)
    for p in piece_map.pieces[rank]:
        first = p.start - piece_map.bounds[p.doc]
        pos[p.local:p.local + p.length] = torch.arange(first, first + p.length)
    return pos.to(device)


def ending_piece(piece_map: PieceMap) -> tuple[int, int]:
    """(rank, piece index) of the piece that ends document 0 (the rows' sequence)."""
    return piece_map.chain(0)[-1]


@dataclass(frozen=True)
class Handoff(Mixing):
    """A Mixing for a prefill chunk of whole sequences (see the module docstring).

    history: (B, k - 1, C) the conv inputs before the chunk (oldest first), or None (the
        sequence starts here: zeros). initial: (B, *state) the state before the chunk in the
        kernel's layout, or None (zero). After the adapter ran, `found` holds "tail"
        (B, k, C) and, on the owner of the sequence's last piece, "final" (B, *state)."""

    history: Optional[torch.Tensor] = None
    initial: Optional[torch.Tensor] = None
    found: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        documents = len(self.piece_map.bounds) - 1
        if documents != 1:
            raise ValueError(f"cpattn.mixers.handoff.Handoff: piece_map holds {documents} "
                             "documents; a Handoff's rows must be one sequence each (one "
                             "document, the same piece map for every row)")

    @property
    def owner(self) -> int:
        """The rank that holds the sequence's last piece (its final state)."""
        return ending_piece(self.piece_map)[0]

    def conv(self, x: torch.Tensor, conv1d: torch.nn.Conv1d) -> torch.Tensor:
        weight = conv1d.weight[:, 0]  # (C, k)
        out = super().conv(x, conv1d)
        width = weight.shape[-1]
        positions = document_positions(self.piece_map, self.rank, x.device)
        self.found["tail"] = self._tail(x, positions, width)
        if self.history is None or width == 1:
            return out
        # The history's part of the first k - 1 outputs: the convolution of [history, zeros].
        seq = torch.cat([self.history, self.history.new_zeros(self.history.shape)], 1)
        part = F.conv1d(seq.transpose(1, 2).to(weight.dtype), weight[:, None, :],
                        groups=weight.shape[0])  # (B, C, k - 1): outputs at positions 0 .. k-2
        part = F.pad(part, (0, 1)).transpose(1, 2).to(out.dtype)  # (a zero row: the others)
        index = torch.where((positions >= 0) & (positions < width - 1), positions, width - 1)
        return out + part.index_select(1, index)

    def _tail(self, x: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
        """(B, width, C): the sequence's last `width` conv inputs (zeros, or the history, before
        its start), from whichever ranks hold them."""
        length = self.piece_map.bounds[1] - self.piece_map.bounds[0]
        slot = positions - (length - width)  # each local token's slot in the tail (< 0: none)
        rows = torch.full((width,), x.shape[1], dtype=torch.int64, device=x.device)
        held = ((positions >= 0) & (slot >= 0)).nonzero().flatten()
        rows[slot[held]] = held
        mine = torch.cat([x, x.new_zeros((x.shape[0], 1, *x.shape[2:]))], 1).index_select(1, rows)
        tail = self.exchange(mine).sum(0)  # (one rank holds each row: exact)
        if self.history is not None and length < width:
            before = width - length  # the slots before the chunk: the history's last ones
            tail = torch.cat([self.history[:, self.history.shape[1] - before:],
                              tail[:, before:]], 1)
        return tail

    def _initial(self, like: torch.Tensor) -> Optional[torch.Tensor]:
        return None if self.initial is None else self.initial.to(like.dtype)

    def _whole_start(self, zero: torch.Tensor) -> torch.Tensor:
        initial = self._initial(zero)
        return zero if initial is None else initial + zero

    def _whole_end(self, state: torch.Tensor) -> None:
        self.found["final"] = state  # (one document per row: the row's last state is its own)

    def _entry_states(self, recurrence, rows, parts, m, s) -> torch.Tensor:
        """The state scan with each row's first piece started from `initial`; records the
        final state (found["final"]) on the owner, an empty buffer of its shape elsewhere."""
        linked = self.piece_map.linked(self.rank)
        starts = self.piece_map.starts_document(self.rank)
        first = torch.tensor([starts[j] for j in linked], dtype=torch.bool, device=s.device)
        first = first.reshape(1, -1, *([1] * (s.dim() - 2)))
        initial = self._initial(s)
        if initial is not None:  # the first piece's summary from the initial state
            s = torch.where(first, apply_transition(recurrence.kind, m, initial[:, None]) + s, s)
        entry = super()._entry_states(recurrence, rows, parts, m, s)
        if initial is not None:
            entry = torch.where(first, entry + initial[:, None], entry)
        owner, piece = ending_piece(self.piece_map)
        if owner != self.rank:
            self.found["final"] = entry.new_empty((entry.shape[0], *entry.shape[2:]))
            return entry
        last = linked.index(piece)
        blocks = type(parts[0]).cat(parts)
        state = entry[:, last]
        for step in blocks.steps()[rows.starts[last]:rows.ends[last] + 1]:
            state = blocks.advance(step, state)
        self.found["final"] = state
        return entry

    def handed_off(self, broadcast: Broadcast) -> torch.Tensor:
        """The final state (B, ...) on every rank: the owner's, broadcast."""
        return broadcast(self.found["final"], self.owner)
