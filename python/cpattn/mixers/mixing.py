"""What an adapter of a token-mixing module (a model's convolution, Mamba or delta-rule layer)
needs to run it exactly on this rank's tokens: the convolution with its halo and the recurrences
with their state scan. Transformers-free.

A recurrence runs on two flat rows (cpattn.mixers.pieces.FlatRows): the rank's whole documents
one after another with resets (no entry state, no summary, nothing exchanged), and its linked
pieces, each from a block's start: their summaries (M, S) go through the state scan, and the
entry states come back as the states their first blocks start from. Work and memory follow the
token count, whatever the number of documents.

The state math runs in float32 (float64 for float64 inputs) with autocast off, whatever the
module's dtype or autocast; the outputs are float32 and the adapter casts them as the module
would. With gradients on, each row's block computation runs under torch.utils.checkpoint: the
backward recomputes it, so a rank keeps its inputs and the per-block terms of its linked row,
not the blocks' intermediates nor the states they start from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.utils.checkpoint

from cpattn.mixers import kernels
from cpattn.mixers.exchange import Exchange
from cpattn.mixers.pieces import FlatRows, PieceMap
from cpattn.mixers.primitives import causal_conv, state_scan


def _index(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _rows(x: torch.Tensor, index: tuple) -> torch.Tensor:
    """x's local tokens (B, L, ...) at index (L: a zero token), or x itself for every token in
    order."""
    if index == tuple(range(x.shape[1])):
        return x
    zero = x.new_zeros((x.shape[0], 1, *x.shape[2:]))
    return torch.cat([x, zero], 1).index_select(1, _index(index, x.device))


@dataclass(frozen=True)
class Recurrence:
    """A recurrence: prepare(*rows, resets, block) -> its per-block terms (kernels.Blocks or
    kernels.Diagonal); `kind` its transition for the state scan; block its block size; shapes
    (batch, *inputs) -> (the state's shape, the transition's shape for the scan)."""

    prepare: Callable
    kind: str
    block: int
    shapes: Callable


def _heads_shapes(batch, q, k, v, *rest):
    return (batch, q.shape[2], q.shape[3], v.shape[3]), (batch, q.shape[2], q.shape[3])


def _scalar_prepare(q, k, v, a, resets, block):
    return kernels.scalar_blocks(q, k, v, kernels.with_resets(a, resets), block)


def _delta_prepare(q, k, v, a, beta, resets, block):
    return kernels.delta_blocks(q, k, v, kernels.with_resets(a, resets), beta, block)


def _kda_prepare(q, k, v, g, beta, resets, block):
    return kernels.kda_blocks(q, k, v, kernels.with_resets(g, resets), beta, block)


def _selective_prepare(dt, x, b, c, a, resets, block):
    return kernels.selective_blocks(dt, a, x, b, c, resets, block)


def _selective_shapes(batch, dt, x, b, c, a):
    return (batch, *a.shape), (batch, *a.shape)


SEGMENT = 16  # blocks per checkpointed segment of a row: the backward recomputes one at a time
SCALAR = Recurrence(_scalar_prepare, "scalar", 64, _heads_shapes)
DELTA = Recurrence(_delta_prepare, "matrix", 64, _heads_shapes)
KDA = Recurrence(_kda_prepare, "matrix", 32, _heads_shapes)
SELECTIVE = Recurrence(_selective_prepare, "diagonal", 64, _selective_shapes)


@dataclass(frozen=True)
class Mixing:
    """What an adapter needs: this rank's piece map, its rank, the exchange and the batch rows
    (B rows sharded alike, or one row of packed documents). `recompute`: checkpoint the block
    computations when gradients are on; `block`: the scan block (None: the recurrence's, 64
    tokens, 32 for Kimi delta attention)."""

    piece_map: PieceMap
    rank: int
    exchange: Exchange
    batch: int
    recompute: bool = True
    block: Optional[int] = None

    def conv(self, x: torch.Tensor, conv1d: torch.nn.Conv1d) -> torch.Tensor:
        """The module's depthwise causal convolution of x (B, L, C), no activation."""
        return causal_conv(x, conv1d.weight[:, 0], conv1d.bias, self.piece_map, self.rank,
                           self.exchange)

    def scalar_decay(self, q, k, v, a) -> torch.Tensor:
        """Mamba-2's SSD and lightning attention (kernels.scalar_blocks): q, k (B, L, H, K),
        v (B, L, H, V), a (B, L, H) -> y (B, L, H, V)."""
        return self._run(SCALAR, (q, k, v, a))

    def delta_rule(self, q, k, v, a, beta) -> torch.Tensor:
        """The gated delta rule (kernels.delta_blocks) -> y (B, L, H, V)."""
        return self._run(DELTA, (q, k, v, a, beta))

    def kda(self, q, k, v, g, beta) -> torch.Tensor:
        """Kimi delta attention (kernels.kda_blocks; g (B, L, H, K)) -> y (B, L, H, V)."""
        return self._run(KDA, (q, k, v, g, beta))

    def selective_scan(self, dt, a, x, b, c) -> torch.Tensor:
        """Mamba (kernels.selective_blocks): dt, x (B, L, D), a (D, Ns), b, c (B, L, Ns) ->
        y (B, L, D) (without the D skip)."""
        return self._run(SELECTIVE, (dt, x, b, c), (a,))

    # --- what a subclass may change (cpattn.mixers.handoff: rows that continue a cached state) --

    def _whole_start(self, zero: torch.Tensor) -> torch.Tensor:
        """The state (B, *state) the whole documents' row starts from: zero."""
        return zero

    def _whole_end(self, state: torch.Tensor) -> None:
        """Sees the state after the whole documents' row (B, *state): its last document's."""

    def _entry_states(self, recurrence: Recurrence, rows: FlatRows, parts: list, m: torch.Tensor,
                      s: torch.Tensor) -> torch.Tensor:
        """The entry states (B, n, *state) of the linked pieces from their summaries m, s
        (B, n, ...; zeros for the pieces that publish none): the state scan. (rows, parts: the
        linked row and its per-block terms.)"""
        return state_scan(m, s, self.piece_map, self.rank, recurrence.kind, self.exchange)

    # --- the two rows -----------------------------------------------------------------------------

    def _run(self, recurrence: Recurrence, inputs: tuple, params: tuple = ()) -> torch.Tensor:
        if self.block is not None:
            recurrence = replace(recurrence, block=self.block)
        whole = recurrence
        if self.block is None:  # (the linked row's block follows its pieces' lengths)
            linked_block = self.piece_map.linked_block(self.rank, recurrence.block)
            recurrence = replace(recurrence, block=linked_block)
        device = inputs[0].device
        dtype = torch.float64 if inputs[0].dtype == torch.float64 else torch.float32
        rows = self.piece_map.flat_rows(self.rank, recurrence.block)
        with torch.autocast(device.type, enabled=False):
            inputs = tuple(t.to(dtype) for t in inputs)
            params = tuple(t.to(dtype) for t in params)
            state, transition = recurrence.shapes(self.batch, *inputs, *params)
            outs = []
            if rows.whole:
                outs.append(self._whole(whole, rows, inputs, params, state))
            if rows.linked or self.piece_map.slots:
                outs.append(self._linked(recurrence, rows, inputs, params, state, transition))
            if not outs:  # (a rank of padding only)
                outs.append(inputs[0].new_zeros((self.batch, 0, *_y_shape(recurrence, inputs))))
            y = torch.cat(outs, 1) if len(outs) > 1 else outs[0]
            return _rows(y, rows.back)

    def _whole(self, recurrence: Recurrence, rows: FlatRows, inputs, params, state) -> torch.Tensor:
        """The whole documents' row: one pass from a zero state, resets at their starts, by
        segments of SEGMENT blocks (each recomputed on its own in backward)."""
        device = inputs[0].device
        resets = torch.zeros(len(rows.whole), dtype=torch.bool, device=device)
        resets[_index(rows.resets, device)] = True
        inputs = tuple(_rows(t, rows.whole) for t in inputs)
        carry = self._whole_start(torch.zeros(state, dtype=inputs[0].dtype, device=device))
        ys, span = [], SEGMENT * recurrence.block
        # (split once: a slice per segment would each give backward a whole-row gradient to add
        # into, quadratic in the row's length)
        segments = zip(resets.split(span), *(t.split(span, 1) for t in inputs))
        for reset, *segment in segments:
            y, carry = self._checkpoint(_whole_segment, recurrence, reset, carry, *segment, *params)
            ys.append(y)
        self._whole_end(carry)
        return torch.cat(ys, 1) if len(ys) > 1 else ys[0]

    def _prepare(self, recurrence: Recurrence, inputs, params) -> list:
        """A row's per-block terms, by segments of SEGMENT blocks (each recomputed on its own
        in backward)."""
        span = SEGMENT * recurrence.block  # (split once, as in _whole)
        return [self._checkpoint(recurrence.prepare, *segment, *params, None, recurrence.block)
                for segment in zip(*(t.split(span, 1) for t in inputs))]

    def _checkpoint(self, fn, *args):
        if self.recompute and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _linked(self, recurrence: Recurrence, rows: FlatRows, inputs, params, state, transition):
        """The linked row's outputs (B, len(rows.linked), ...) (none: still joins the scan)."""
        device, dtype = inputs[0].device, inputs[0].dtype
        n = len(rows.starts)
        zero = torch.zeros(state, dtype=dtype, device=device)
        # The exchange's backward waits for every rank: summaries are in the inputs' graph
        # even when this rank publishes none (0: a sum of no values)
        anchor = sum(t.flatten()[:0].sum() for t in inputs)
        if not rows.linked:  # nothing to run, but the exchange waits for every rank
            empty = zero.new_zeros((self.batch, 0, *state[1:])) + anchor
            m = zero.new_zeros((self.batch, 0, *_m_shape(recurrence, transition))) + anchor
            entry = state_scan(m, empty, self.piece_map, self.rank, recurrence.kind, self.exchange)
            return zero.new_zeros((self.batch, 0, *_y_shape(recurrence, inputs))) + entry.sum()
        parts = self._prepare(recurrence, tuple(_rows(t, rows.linked) for t in inputs), params)
        published = self.piece_map.published(self.rank)
        identity = _identity(recurrence, transition, dtype, device)
        m, s = self._checkpoint(_summaries, parts, zero, identity,
                                tuple(rows.starts[i] for i in published),
                                tuple(rows.ends[i] for i in published))
        m = _scan_m(recurrence, m)
        if len(published) < n:  # (zeros for the pieces that end their document: not read)
            at = _index([published.index(i) if i in published else len(published)
                         for i in range(n)], device)
            m = torch.cat([m, m.new_zeros((self.batch, 1, *m.shape[2:]))], 1).index_select(1, at)
            s = torch.cat([s, s.new_zeros((self.batch, 1, *s.shape[2:]))], 1).index_select(1, at)
        entry = self._entry_states(recurrence, rows, parts, m + anchor, s + anchor)
        # The outputs part by part, each restarted from the entry states of its pieces
        starts = {c: entry[:, i] for i, c in enumerate(rows.starts)}
        carry, ys, first = zero, [], 0
        for part in parts:
            count = _blocks_in(part)
            mine = {c - first: e for c, e in starts.items() if first <= c < first + count}
            y, carry = self._checkpoint(_part_outputs, part, carry, mine)
            ys.append(y)
            first += count
        return (torch.cat(ys, 1) if len(ys) > 1 else ys[0])[:, :len(rows.linked)]


def _summaries(parts: list, zero, identity, starts: tuple, ends: tuple):
    """kernels.summaries of a row's parts."""
    return kernels.summaries(type(parts[0]).cat(parts), zero, identity, starts, ends)


def _part_outputs(part, carry: torch.Tensor, starts: dict):
    """A part of a row from the state `carry`, restarted at its blocks in `starts`: (outputs
    of all its blocks' tokens, the state after it)."""
    states, after = kernels.block_states(part, carry, starts)
    return part.outputs(states, None), after


def _blocks_in(part) -> int:
    return part.intra.shape[2] if isinstance(part, kernels.Blocks) else part.y0.shape[1]


def _whole_segment(recurrence: Recurrence, resets, carry, *args):
    """A segment of the whole documents' row from the state `carry`: (outputs, the state after
    it)."""
    blocks = recurrence.prepare(*args, resets, recurrence.block)
    states, after = kernels.block_states(blocks, carry)
    return blocks.outputs(states, args[0].shape[1]), after


def _identity(recurrence: Recurrence, transition: tuple, dtype, device) -> torch.Tensor:
    """The transition that changes nothing, as kernels.summaries applies it."""
    if recurrence.kind == "matrix":
        eye = torch.eye(transition[-1], dtype=dtype, device=device)
        return eye.expand(*transition, transition[-1])
    if recurrence.kind == "scalar":
        return torch.ones((*transition[:2], 1, 1), dtype=dtype, device=device)
    return torch.ones(transition, dtype=dtype, device=device)


def _scan_m(recurrence: Recurrence, m: torch.Tensor) -> torch.Tensor:
    """Summaries' transitions as the state scan takes them (scalar: (B, n, H))."""
    return m[..., 0, 0] if recurrence.kind == "scalar" else m


def _m_shape(recurrence: Recurrence, transition: tuple) -> tuple:
    if recurrence.kind == "matrix":
        return (*transition[1:], transition[-1])
    return transition[1:2] if recurrence.kind == "scalar" else transition[1:]


def _y_shape(recurrence: Recurrence, inputs: tuple) -> tuple:
    """The output's per-token shape."""
    if recurrence.kind == "diagonal":
        return inputs[0].shape[2:]
    return (*inputs[2].shape[2:],)
