"""The mixers' state scan (cpattn.mixers.state_scan): the tree's schedule, and the cost of both
methods per rank (bytes sent, memory, time) so that the mixers and `python -m cpattn plan` can
choose one.

Every piece of a document split over ranks needs its entry state: the fold, in global order, of
the summaries (M, S) of the pieces before it in its document's *chain* (its pieces in global
order; M the piece's transition, B its end state from zero). Two methods:

- "allgather": every rank gathers every rank's published summaries (one all-gather, backward one
  reduce-scatter) and folds each chain. Bytes and memory per rank grow with W.
- "tree": recursive doubling over each chain (tree_messages): at step t every piece receives the
  fold of the pieces up to 2^t before it from one other piece, point to point. 1 + ceil(log2(L -
  1)) steps for a chain of L pieces; bytes and memory per rank grow with log W. A composition of
  two "matrix" summaries costs a K x K product per head (K^3), which the all-gather's fold
  (M @ state, K^2 V) does not pay.

Sizes (fp32, per batch row): a state |S| = H K V numbers; a transition |M| = H ("scalar"),
H K V ("diagonal") or H K K ("matrix"). The model counts the same messages as the scan
(tree_traffic over the chains' owners) and the buffers the scan allocates; bench/bench_scan.py
checks it against gloo measurements.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from cpattn.plan.model import Link, Machine

METHODS = ("allgather", "tree")
KINDS = ("scalar", "diagonal", "matrix")  # M: broadcast over the state / elementwise / M @ S
FP32 = 4
# Host calls (tensor ops, each Machine.call_overhead) per tree step and per all-gather fold
# step, forward and backward together, and the all-gather's fixed ones: counted on the code (the
# tree's step: index, cat, route, compose, index_copy and their backward; the fold's step: index,
# reshape, apply, add and their backward), about what separates the two at W = 2 on the CPU
# (bench/bench_scan.py).
CALLS_PER_TREE_STEP = 30
CALLS_PER_FOLD_STEP = 6
CALLS_ALLGATHER = 10
# GPU presets give bf16 throughput only; fp32 products (summaries are fp32) run at about 1/15
# of it (H100 SXM: 67 TFLOP/s fp32 against 989 bf16 dense, published figures).
FP32_FRACTION_OF_BF16 = 67 / 989


# --- the tree's schedule ------------------------------------------------------------------------

def tree_steps(length: int) -> int:
    """Steps of the tree scan of a chain of `length` pieces: 1 + ceil(log2(length - 1)), 0 for
    a chain of one piece (nothing before it)."""
    return 0 if length < 2 else 1 + math.ceil(math.log2(length - 1))


def tree_messages(length: int, step: int) -> tuple[tuple[int, int, bool], ...]:
    """The messages of `step` in a chain of `length` pieces, as (sender, receiver, full) chain
    positions. E_c, the fold of the pieces before c, is built by doubling: step 0 sends piece
    c - 1's own summary to c (E_c = it); step t >= 1 sends E_{c-d}, d = 2^(t-1), to c for
    c - d >= 1 (E_c = E_c after E_{c-d}). After step t, E_c covers pieces max(0, c - 2^t) ..
    c - 1. full: the message carries M as well as B, because its receiver composes again later
    (c > 2^step); otherwise only B travels (only B of an earlier fold enters a later B)."""
    if step == 0:
        return tuple((c - 1, c, c > 1) for c in range(1, length))
    d = 1 << (step - 1)
    return tuple((c - d, c, c > 2 * d) for c in range(d + 1, length))


# --- what each rank sends, receives and keeps -----------------------------------------------------

@dataclass(frozen=True)
class ScanTraffic:
    """Per rank, the rows of the scan (a row: one piece's summary or fold for one batch row):

    world; linked: the pieces each rank holds that take part (documents split over ranks);
    slots: summaries each rank publishes in the all-gather (the most of any rank);
    fold_steps: per rank, the all-gather fold's steps (the most predecessors of its pieces);
    tree: per step, per rank (full rows sent, B-only rows sent, full received, B-only received,
    local full, local B-only, peers sent to, peers received from); span: per step, the widest
    rank distance of a message + 1 (which link it takes)."""

    world: int
    linked: tuple
    slots: int
    fold_steps: tuple
    tree: tuple
    span: tuple


def tree_traffic(chains: Sequence[Sequence[int]], world: int) -> ScanTraffic:
    """The traffic of both methods for documents whose chains visit these ranks (chains[d][c]:
    the rank holding piece c of document d; chains of one piece take no part)."""
    chains = [tuple(c) for c in chains if len(c) > 1]
    linked = [0] * world
    published = [0] * world
    fold = [0] * world
    for chain in chains:
        for c, r in enumerate(chain):
            linked[r] += 1
            published[r] += c < len(chain) - 1
            fold[r] = max(fold[r], c)
    steps = max((tree_steps(len(c)) for c in chains), default=0)
    tree, span = [], []
    for t in range(steps):
        rows = [[0] * 6 for _ in range(world)]
        peers_out = [set() for _ in range(world)]
        peers_in = [set() for _ in range(world)]
        widest = 1
        for chain in chains:
            for a, b, full in tree_messages(len(chain), t):
                src, dst = chain[a], chain[b]
                if src == dst:
                    rows[dst][4 if full else 5] += 1
                    continue
                rows[src][0 if full else 1] += 1
                rows[dst][2 if full else 3] += 1
                peers_out[src].add(dst)
                peers_in[dst].add(src)
                widest = max(widest, abs(src - dst) + 1)
        tree.append(tuple(tuple(rows[r]) + (len(peers_out[r]), len(peers_in[r]))
                          for r in range(world)))
        span.append(widest)
    return ScanTraffic(world, tuple(linked), max(published, default=0), tuple(fold),
                       tuple(tree), tuple(span))


def sequence_chains(layout: str, world: int) -> tuple[tuple[int, ...], ...]:
    """The chain of one sequence sharded by `layout` over `world` ranks: contiguous visits the
    ranks in order; zigzag their front halves ascending, then their back halves descending (the
    middle rank's two halves are one piece)."""
    if layout == "contiguous":
        return (tuple(range(world)),)
    if layout == "zigzag":
        return (tuple(range(world)) + tuple(range(world - 2, -1, -1)),)
    raise ValueError(f"cpattn.plan.mixer_scan.sequence_chains: layout={layout!r}: must be "
                     "'contiguous' or 'zigzag'")


# --- the layer and the costs --------------------------------------------------------------------

@dataclass(frozen=True)
class MixerLayer:
    """A state-passing mixer layer as its scan sees it: kind of transition ("scalar" per head,
    "diagonal" like the state, "matrix" K x K per head), heads H (the state's: value heads for
    the gated delta rule), key_dim K and value_dim V (state H x K x V), batch rows, and how many
    such layers the model has (for the memory kept until the backward)."""

    name: str
    kind: str
    heads: int
    key_dim: int
    value_dim: int
    batch: int = 1
    layers: int = 1

    def __post_init__(self):
        checks = [(self.kind in KINDS, "kind", self.kind, f"one of {KINDS}")] + [
            (getattr(self, n) > 0, n, getattr(self, n), "> 0")
            for n in ("heads", "key_dim", "value_dim", "batch", "layers")]
        for ok, name, value, rule in checks:
            if not ok:
                raise ValueError(f"cpattn.plan.mixer_scan.MixerLayer: {name}={value!r}: must be "
                                 f"{rule}")

    def __str__(self) -> str:
        return (f"{self.name}: {self.kind} transitions, {self.heads} heads, K = {self.key_dim}, "
                f"V = {self.value_dim}, batch {self.batch}, {self.layers} such layers")

    @property
    def state_elems(self) -> int:
        """|S| per batch row."""
        return self.heads * self.key_dim * self.value_dim

    @property
    def transition_elems(self) -> int:
        """|M| per batch row."""
        return {"scalar": self.heads, "diagonal": self.state_elems,
                "matrix": self.heads * self.key_dim * self.key_dim}[self.kind]

    @property
    def full_row(self) -> int:
        """Bytes of one summary (M, S), all batch rows."""
        return FP32 * self.batch * (self.transition_elems + self.state_elems)

    @property
    def state_row(self) -> int:
        """Bytes of one state B, all batch rows."""
        return FP32 * self.batch * self.state_elems

    def apply_flops(self) -> float:
        """FLOP of M B (a transition applied to a state), all batch rows."""
        mult = 2 * self.key_dim if self.kind == "matrix" else 1
        return float(self.batch * self.state_elems * mult)

    def compose_flops(self) -> float:
        """FLOP of M2 M1 (matrix: K^3 per head), all batch rows."""
        if self.kind == "matrix":
            return float(self.batch * self.heads * 2 * self.key_dim ** 3)
        return float(self.batch * self.transition_elems)


# Qwen3.5-27B's gated delta rule layers: linear_num_value_heads 48, linear_num_key_heads 16, key
# and value head dims 128 (Modular MAX's Qwen3_5Config defaults for the family; transformers
# 5.24's Qwen3_5TextConfig defaults are a smaller model's), 48 such layers (issue 54's count);
# states are per value head.
LAYERS = {
    "qwen3.5-27b": MixerLayer("Qwen3.5-27B gated delta rule", "matrix", 48, 128, 128, layers=48),
}


@dataclass
class ScanPrediction:
    """One method for one layer on W ranks, per rank, the most of any rank: time (s, forward +
    backward), bytes_sent (forward + backward), peak (bytes alive at once in the forward: the
    buffers the scan allocates), kept (bytes it keeps for the backward, one layer), fits (the
    layers' kept bytes and one peak within the machine's memory)."""

    method: str
    time: float
    bytes_sent: float
    peak: float
    kept: float
    fits: bool = True
    detail: dict = field(default_factory=dict)


def _link(m: Machine, span: int) -> Link:
    return m.link(span)


def _fp32_flops(m: Machine) -> float:
    if "float32" in m.fwd_flops:
        return m.fwd_flops["float32"]
    return FP32_FRACTION_OF_BF16 * max(m.fwd_flops.values())


def _compute_time(m: Machine, flops: float, nbytes: float) -> float:
    """Small products on fp32 summaries: bound by FLOP or by the bytes they touch."""
    return max(flops / _fp32_flops(m), nbytes / m.mem_bandwidth)


def predict_allgather(layer: MixerLayer, traffic: ScanTraffic, m: Machine) -> ScanPrediction:
    """The all-gather: every rank sends its `slots` summaries to the W - 1 others (backward: the
    reduce-scatter of their gradients). It holds its published rows, the gathered W x slots and
    the fold's table (a copy with the identity appended), and keeps per fold step and piece the
    transition it applied (a copy for "matrix"; for the others a view that holds the whole
    gathered row) and the state it applied it to (the last one: the output)."""
    w, full, state = traffic.world, layer.full_row, layer.state_row
    if w < 2 or traffic.slots == 0:
        return ScanPrediction("allgather", 0.0, 0.0, 0.0, 0.0, True, {"steps": 0})
    part = traffic.slots * full
    gathered = w * part
    sent_fwd = (w - 1) * part
    sent_bwd = sent_fwd * m.reduce_scatter_factor
    link = _link(m, w)
    gather = m.collectives.get("all_gather")
    scatter = m.collectives.get("reduce_scatter")
    t_fwd = gather.time(sent_fwd) if gather else link.time(sent_fwd, w - 1)
    t_bwd = scatter.time(sent_fwd) if scatter else link.time(sent_bwd, w - 1)
    rows = max(s * n for s, n in zip(traffic.fold_steps, traffic.linked))
    transition = full - state if layer.kind == "matrix" else full
    fold = _compute_time(m, rows * layer.apply_flops(), rows * (full + state))
    kept = rows * (transition + state)
    peak = part + 2 * (gathered + full) + kept
    host = (CALLS_ALLGATHER + CALLS_PER_FOLD_STEP * max(traffic.fold_steps)) * m.call_overhead
    return ScanPrediction("allgather", t_fwd + t_bwd + 3 * fold + host, sent_fwd + sent_bwd, peak,
                          kept,
                          detail={"steps": 1, "messages": 2 * (w - 1), "gathered": gathered})


def predict_tree(layer: MixerLayer, traffic: ScanTraffic, m: Machine) -> ScanPrediction:
    """The tree: per step, each rank sends its rows to its peers point to point and composes what
    it receives (backward: the gradients travel back the same way). It keeps (what autograd
    saves, counted on this implementation): per piece its output state; per row received at
    step 0 one state; per row composed later, full: two summaries and a transition (its own M,
    the row received, their product); B-only: two summaries. Beyond that it holds its E (M and
    B of each linked piece) twice while a step replaces it, two rows of temporaries and one row
    per row composed so far (the peak's terms fitted to bench/bench_scan.py's measurements)."""
    full, state, w = layer.full_row, layer.state_row, traffic.world
    m_row = full - state
    t_total, sent, peak = 0.0, [0.0] * w, 0.0
    kept = [n * state for n in traffic.linked]
    late = [0] * w
    for t, (step, span) in enumerate(zip(traffic.tree, traffic.span)):
        link = _link(m, span)
        t_step = 0.0
        for r, (fs, ss, fr, sr, fl, sl, po, pi) in enumerate(step):
            out_bytes, in_bytes = fs * full + ss * state, fr * full + sr * state
            sent[r] += out_bytes + in_bytes  # forward out, backward the gradients of what came in
            composes = fr + fl
            flops = composes * (layer.compose_flops() + layer.apply_flops()) + \
                (sr + sl) * layer.apply_flops()
            compute = _compute_time(m, flops, (composes + sr + sl) * (full + m_row))
            comm = max(link.time(out_bytes, po), link.time(in_bytes, pi))
            back = max(link.time(in_bytes, pi), link.time(out_bytes, po))
            t_step = max(t_step, comm + back + 3 * compute)
            if t == 0:
                kept[r] += (fr + sr + fl + sl) * state
            else:
                kept[r] += composes * (2 * full + m_row) + (sr + sl) * 2 * full
                late[r] += fr + sr + fl + sl
            # E before and after, two rows of temporaries, one per row composed so far
            held = (2 * traffic.linked[r] + 2 + late[r]) * full
            peak = max(peak, kept[r] + held)
        t_total += t_step + CALLS_PER_TREE_STEP * m.call_overhead
    return ScanPrediction("tree", t_total, max(sent, default=0.0), peak, max(kept, default=0.0),
                          detail={"steps": len(traffic.tree)})


def predict_scan(layer: MixerLayer, traffic: ScanTraffic, m: Machine) -> list[ScanPrediction]:
    """Both methods for this layer and traffic on machine m, the chosen one first: the fastest
    whose kept bytes over the model's layers plus one peak fit in m.memory, else the one that
    needs the least memory."""
    preds = [predict_allgather(layer, traffic, m), predict_tree(layer, traffic, m)]
    for p in preds:
        p.fits = layer.layers * p.kept + p.peak <= m.memory
    fitting = [p for p in preds if p.fits]
    if fitting:
        first = min(fitting, key=lambda p: p.time)
    else:
        first = min(preds, key=lambda p: layer.layers * p.kept + p.peak)
    return [first] + [p for p in preds if p is not first]


def explain_scan(layer: MixerLayer, preds: Sequence[ScanPrediction], world: int) -> str:
    """One line: the choice and why."""
    first, other = preds[0], preds[1]
    if not first.fits:
        why = "neither fits in memory; the smaller"
    elif not other.fits:
        why = f"{other.method} does not fit ({_gib(layer.layers * other.kept + other.peak)} " \
              f"over {layer.layers} layers)"
    else:
        why = f"{first.time * 1e3:.3g} ms against {other.time * 1e3:.3g} ms"
    return f"state scan of {layer.name} on {world} ranks: {first.method} ({why})"


def scan_table(layer: MixerLayer, preds: Sequence[ScanPrediction]) -> str:
    """The predictions as a text table, per rank and layer."""
    lines = [f"{'scan':<10} {'steps':>5} {'time ms':>9} {'sent MiB':>10} {'peak MiB':>10} "
             f"{'kept MiB':>10} {'x layers GiB':>12} {'fits':>5}"]
    for p in preds:
        lines.append(f"{p.method:<10} {p.detail.get('steps', 0):>5} {p.time * 1e3:>9.3f} "
                     f"{p.bytes_sent / 2**20:>10.1f} {p.peak / 2**20:>10.1f} "
                     f"{p.kept / 2**20:>10.1f} {layer.layers * p.kept / 2**30:>12.2f} "
                     f"{'yes' if p.fits else 'no':>5}")
    return "\n".join(lines)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"
