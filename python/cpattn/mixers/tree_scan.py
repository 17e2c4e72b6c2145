"""The state scan by recursive doubling over each document's chain of pieces: memory and bytes
per rank grow with log W, where the all-gather of primitives.state_scan grows with W.

A document split over ranks has a chain of *linked* pieces c = 0 .. L-1 in global order. Piece c
needs E_c, the fold (algebra.compose) of the summaries (M, S) of pieces 0 .. c-1; its entry
state is E_c's B. The schedule is cpattn.plan.mixer_scan.tree_messages: step 0 sends each
piece's own summary to the next piece; step t >= 1 sends E_{c-d}, d = 2^(t-1), to piece c, which
composes it under its own (E_c after E_{c-d}). 1 + ceil(log2(L - 1)) steps serve every chain at
once, whatever ranks its pieces sit on (contiguous, zigzag, document plans, several documents, a
rank holding several pieces of one chain); a document's first piece gets zero. A message
carries (M, S), or S alone when its receiver composes nothing later.

Each step is one point-to-point route (mixers.exchange.route, custom op cpattn::mixer_route);
the backward is autograd's: each route's adjoint sends the gradients back the same edges. Every
rank calls every step's route whenever any rank has a message in it (the plan is the same on
every rank, built from the piece map) and keeps every route's output in its graph, so every rank
also takes part in every backward route. With an exchange that is a plain callable (one process
playing W ranks) a route is an all-gather, every message picked out of it: the same arithmetic,
not the same memory.

Which scan state_scan runs: `scan_method` (an exchange's own choice, `with_scan`,
$CPATTN_MIXER_SCAN, else the planner's model, cpattn.plan.mixer_scan).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from cpattn.core.validation import env_mixer_scan
from cpattn.mixers.algebra import apply_transition, compose
from cpattn.mixers.exchange import Exchange, route
from cpattn.mixers.pieces import PieceMap, cached_constant
from cpattn.plan.choose import known_machine
from cpattn.plan.mixer_scan import (
    METHODS,
    MixerLayer,
    ScanTraffic,
    predict_scan,
    tree_messages,
    tree_steps,
    tree_traffic,
)
from cpattn.plan.model import PRESETS, Machine

log = logging.getLogger("cpattn.mixers")


class TreeStep(NamedTuple):
    """One step of one rank (positions index its linked pieces):

    sends: ((dst rank, full sources, B-only sources), ...) in dst order; recvs: ((src rank, full
    targets, B-only targets), ...) in src order (a pair's messages in target order on both
    sides); local: ((source, target, full), ...) messages within the rank; edges: every rank's
    remote messages, ((src, dst, full rows, B-only rows), ...) sorted by (src, dst)."""

    sends: tuple
    recvs: tuple
    local: tuple
    edges: tuple


class TreePlan(NamedTuple):
    """A rank's part of the tree scan: its linked pieces (indices into pieces[rank], in local
    order) and its steps."""

    linked: tuple
    steps: tuple


_constant = cached_constant(64)


def _chains(piece_map: PieceMap) -> list:
    """The chains of the documents split over pieces: (rank, position in its linked pieces)."""
    linked = [[] for _ in range(piece_map.world)]
    chains = [piece_map.chain(d) for d in range(len(piece_map.bounds) - 1)]
    chains = [c for c in chains if len(c) > 1]
    for chain in chains:
        for r, j in chain:
            linked[r].append(j)
    position = {(r, j): i for r in range(piece_map.world)
                for i, j in enumerate(sorted(linked[r]))}
    return [tuple((r, position[(r, j)]) for r, j in c) for c in chains], \
        [tuple(sorted(js)) for js in linked]


@_constant
def tree_plan(piece_map: PieceMap, rank: int) -> TreePlan:
    """rank's part of the tree scan of this piece map (the same steps on every rank)."""
    chains, linked = _chains(piece_map)
    steps = []
    for t in range(max((tree_steps(len(c)) for c in chains), default=0)):
        messages = []  # (src rank, dst rank, dst position, src position, full)
        for chain in chains:
            for a, b, full in tree_messages(len(chain), t):
                (src, i), (dst, k) = chain[a], chain[b]
                messages.append((src, dst, k, i, full))
        messages.sort()
        remote = [msg for msg in messages if msg[0] != msg[1]]
        pairs: dict = {}
        for src, dst, _, _, full in remote:
            rows = pairs.setdefault((src, dst), [0, 0])
            rows[0 if full else 1] += 1
        edges = tuple((src, dst, f, b) for (src, dst), (f, b) in sorted(pairs.items()))

        def grouped(mine, peer_of, pos_of):
            out = {}
            for msg in mine:
                full_rows, state_rows = out.setdefault(peer_of(msg), ([], []))
                (full_rows if msg[4] else state_rows).append(pos_of(msg))
            return tuple((p, tuple(f), tuple(b)) for p, (f, b) in sorted(out.items()))

        sends = grouped([m for m in remote if m[0] == rank], lambda m: m[1], lambda m: m[3])
        recvs = grouped([m for m in remote if m[1] == rank], lambda m: m[0], lambda m: m[2])
        local = tuple((i, k, full) for src, dst, k, i, full in messages if src == dst == rank)
        steps.append(TreeStep(sends, recvs, local, edges))
    return TreePlan(linked[rank], tuple(steps))


@_constant
def scan_traffic(piece_map: PieceMap) -> ScanTraffic:
    """What each rank sends, receives and keeps in both scans of this piece map (the planner's
    input)."""
    chains, _ = _chains(piece_map)
    return tree_traffic([[r for r, _ in c] for c in chains], piece_map.world)


def tree_scan(m: torch.Tensor, s: torch.Tensor, piece_map: PieceMap, rank: int, kind: str,
              exchange: Exchange) -> torch.Tensor:
    """Entry states (B, n, *s.shape[2:]) of rank's n pieces (all its pieces, or only its linked
    ones) from their summaries m (B, n, ...) and s (B, n, ...), as primitives.state_scan, by
    recursive doubling. fp32 in, fp32 out; differentiable."""
    plan = tree_plan(piece_map, rank)
    batch, rows = s.shape[0], s.shape[1]
    m_shape, s_shape = tuple(m.shape[2:]), tuple(s.shape[2:])
    own_m, own_b = m.flatten(2), s.flatten(2)  # (B, n, |M|), (B, n, |S|)
    m_size, s_size = own_m.shape[2], own_b.shape[2]
    pieces = len(piece_map.pieces[rank])
    if rows == pieces:  # the rows are every piece of the rank: keep the linked ones
        index = torch.tensor(plan.linked, dtype=torch.int64, device=s.device)
        own_m, own_b = own_m.index_select(1, index), own_b.index_select(1, index)
    elif rows != len(plan.linked):
        raise ValueError(f"cpattn.mixers.tree_scan: summaries for {rows} pieces on rank {rank}: "
                         f"must be one per piece ({pieces}) or per linked piece "
                         f"({len(plan.linked)})")
    e_m, e_b = torch.zeros_like(own_m), torch.zeros_like(own_b)  # E of each linked piece
    received = []
    for t, step in enumerate(plan.steps):
        src_m, src_b = (own_m, own_b) if t == 0 else (e_m, e_b)
        row_of = {True: m_size + s_size, False: s_size}
        # (B, k, |M| + |S|) or (B, k, |S|) rows -> (k B ...) flat, a pair's full rows first
        chunks = [src_b.reshape(-1)[:0]]  # (in the graph even when it sends nothing)
        for _, full, state in step.sends:
            for positions, is_full in ((full, True), (state, False)):
                if positions:
                    rows_out = _take(src_m, src_b, positions, is_full)
                    chunks.append(rows_out.transpose(0, 1).reshape(-1))
        if step.edges:
            edges = tuple((src, dst, batch * (f * row_of[True] + b * row_of[False]))
                          for src, dst, f, b in step.edges)
            flat = route(exchange, torch.cat(chunks), edges, rank, tag=t)
            received.append(flat)
        arrived = {True: ([], []), False: ([], [])}  # full / B-only: (rows, targets)
        at = 0
        for _, full, state in step.recvs:
            for targets, is_full in ((full, True), (state, False)):
                n = len(targets) * batch * row_of[is_full]
                part = flat[at:at + n].reshape(len(targets), batch, row_of[is_full])
                arrived[is_full][0].append(part.transpose(0, 1))
                arrived[is_full][1].extend(targets)
                at += n
        for source, target, is_full in step.local:
            arrived[is_full][0].append(_take(src_m, src_b, (source,), is_full))
            arrived[is_full][1].append(target)
        e_m, e_b = _update(kind, t == 0, e_m, e_b, arrived, m_shape, s_shape, m_size)
    if rows == pieces and rows != len(plan.linked):
        entry = own_b.new_zeros((batch, rows, s_size)).index_copy(1, index, e_b)
    else:
        entry = e_b
    entry = entry.reshape(batch, rows, *s_shape)
    # every route in this rank's graph: every rank joins every step's backward
    return entry + sum(0 * r.sum() for r in received) if received else entry


def _take(src_m: torch.Tensor, src_b: torch.Tensor, positions: tuple,
          full: bool) -> torch.Tensor:
    """(B, k, |M| + |S|) (full) or (B, k, |S|): the rows at positions of E (or the summaries)."""
    index = torch.tensor(positions, dtype=torch.int64, device=src_b.device)
    b = src_b.index_select(1, index)
    return torch.cat([src_m.index_select(1, index), b], 2) if full else b


def _update(kind: str, first: bool, e_m: torch.Tensor, e_b: torch.Tensor, arrived: dict,
            m_shape: tuple, s_shape: tuple, m_size: int) -> tuple:
    """E (e_m (B, n, |M|), e_b (B, n, |S|)) after one step, given what arrived ({full: (rows
    (B, k, ...) per source, target positions)}): at step 0 each receiver's E is what arrived;
    later, E after it (full: M and B; B-only: B = M_c B_arrived + B_c, the receiver's M no
    longer needed)."""
    batch = e_b.shape[0]
    for is_full, (parts, targets) in arrived.items():
        if not targets:
            continue
        rows = torch.cat(parts, 1)  # (B, k, ...)
        k = rows.shape[1]
        index = torch.tensor(targets, dtype=torch.int64, device=e_b.device)
        in_b = rows[..., m_size:] if is_full else rows
        if first:
            new_b = in_b
            new_m = rows[..., :m_size] if is_full else None
        else:
            own_m = e_m.index_select(1, index).reshape(batch, k, *m_shape)
            own_b = e_b.index_select(1, index).reshape(batch, k, *s_shape)
            first_b = in_b.reshape(batch, k, *s_shape)
            if is_full:
                first_m = rows[..., :m_size].reshape(batch, k, *m_shape)
                new_m, new_b = compose(kind, (own_m, own_b), (first_m, first_b))
                new_m = new_m.reshape(batch, k, -1)
            else:
                new_m, new_b = None, apply_transition(kind, own_m, first_b) + own_b
            new_b = new_b.reshape(batch, k, -1)
        e_b = e_b.index_copy(1, index, new_b)
        if new_m is not None:
            e_m = e_m.index_copy(1, index, new_m)
    return e_m, e_b


# --- which scan ---------------------------------------------------------------------------------

class ScanChoice:
    """An exchange with a fixed scan method ("allgather", "tree" or "auto"): calls and routes go
    to the exchange it wraps."""

    def __init__(self, exchange: Exchange, method: str):
        if method not in (*METHODS, "auto"):
            raise ValueError(f"cpattn.mixers.with_scan: method={method!r}: must be one of "
                             f"{(*METHODS, 'auto')}")
        self.exchange, self.scan = exchange, method
        self.group = getattr(exchange, "group", None)  # (the planner's machine, for "auto")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.exchange(x)

    def route(self, x, edges, rank, tag):
        return route(self.exchange, x, edges, rank, tag)


def with_scan(exchange: Exchange, method: str) -> ScanChoice:
    """The exchange, with state_scan's method fixed ("allgather", "tree", "auto")."""
    return ScanChoice(exchange, method)


@torch._dynamo.assume_constant_result
def scan_method(exchange: Exchange, piece_map: PieceMap, kind: str, m_shape: tuple,
                s_shape: tuple, batch: int, device_type: str) -> str:
    """The method state_scan runs: the exchange's own (with_scan), else $CPATTN_MIXER_SCAN
    ("allgather", "tree", "auto"), else "auto": for an exchange over a process group the
    planner's choice (cpattn.plan.mixer_scan.predict_scan with the group's machine: set_machine's
    or $CPATTN_PLAN_MACHINE's, never a calibration here; without one the preset of the device,
    h100-ib or cpu-gloo), for one process playing W ranks "allgather". The same on every rank
    (every input is)."""
    method = _configured(exchange)
    if method != "auto":
        return method
    group = getattr(exchange, "group", None)
    if group is None:
        return "allgather"
    known = known_machine(group.group_name)
    machine = known or PRESETS["h100-ib" if device_type == "cuda" else "cpu-gloo"]
    return _planned(piece_map, kind, s_shape, batch, machine.to_json())


def _configured(exchange: Exchange) -> str:
    """The method the exchange or $CPATTN_MIXER_SCAN fixes, else "auto"."""
    method = getattr(exchange, "scan", None)
    if method in (None, "auto"):
        env = env_mixer_scan()
        if env is not None and env not in (*METHODS, "auto"):
            raise ValueError(f"cpattn.mixers: $CPATTN_MIXER_SCAN={env!r}: must be one of "
                             f"{(*METHODS, 'auto')}")
        method = env or "auto"
    return method


@torch._dynamo.assume_constant_result  # (reads the process group: a constant when compiled)
def scan_setting(exchange: Exchange) -> str:
    """What decides scan_method's choice on this rank (the method fixed, or "auto" and the
    planner's machine set for the group), for the ranks' agreement: ranks that would run
    different scans must raise, not meet in different collectives. Raises ValueError for a bad
    $CPATTN_MIXER_SCAN."""
    method = _configured(exchange)
    group = getattr(exchange, "group", None)
    known = known_machine(group.group_name) if method == "auto" and group is not None else None
    return method if known is None else f"auto, machine {known.to_json()}"


@_constant
def _planned(piece_map: PieceMap, kind: str, s_shape: tuple, batch: int, machine: str) -> str:
    """predict_scan's choice for one layer of this state shape (H, K, V) on this machine (its
    JSON: a cache key)."""
    heads, key_dim, value_dim = ((1, 1) + tuple(s_shape))[-3:]
    layer = MixerLayer(f"{kind} state {s_shape}", kind, heads, key_dim, value_dim, batch)
    m = Machine.from_json(machine)
    choice = predict_scan(layer, scan_traffic(piece_map), m)[0].method
    log.debug("cpattn.mixers: state scan on %d ranks (%s): %s", piece_map.world, m.name, choice)
    return choice
