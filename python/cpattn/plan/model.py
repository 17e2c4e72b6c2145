"""What the cost model talks about: machines (their links and throughput, the presets), one
attention call (Problem), a way to run it (Candidate), the model's answer (Prediction), and the
cost models of the ways to run attention (CostModel, COST_MODELS: one entry per strategy, plus
"none" and decode's "sharded-cache"), which every list of candidates asks."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
MODES = ("train", "forward", "decode")  # "prefill" is an alias of "forward"


@dataclass(frozen=True)
class Link:
    """One direction of a rank's link: bytes/s it can send while receiving as much, and the
    fixed cost of one message (s)."""

    bandwidth: float
    latency: float

    def time(self, nbytes: float, messages: int = 1) -> float:
        return messages * self.latency + nbytes / self.bandwidth if messages else 0.0


@dataclass(frozen=True)
class Machine:
    """What the model needs to know about the ranks.

    fwd_flops / bwd_flops: attention kernel throughput per rank and dtype, FLOP/s counted as
    4 * D per visited (query, key) pair forward and 10 * D backward, while every rank of the
    group computes at once (so shared cores show up as a lower figure). call_overhead: fixed
    seconds per kernel call. mem_bandwidth: bytes/s of the elementwise work (merges, copies,
    decode's K/V reads). overlap: the fraction of a ring step's communication that runs during
    its compute (1: separate copy engines; lower where the transfer takes CPU time from the
    cores that compute). block: the kernel's (query, key) tile. reduce_scatter_factor: bytes a
    reduce-scatter sends relative to the ideal (W-1) parts (2: gloo runs it as a ring
    all-reduce of the whole buffer). collectives: measured Links of the collectives the
    all-gather and Ulysses strategies call ("all_gather", "reduce_scatter", "all_to_all"; bytes
    = what leaves one rank, the helpers' packing copies included), where calibrate() measured
    them; a collective not listed is modelled from the link.
    """

    name: str
    source: str
    ranks_per_node: int
    intra: Link
    inter: Link
    fwd_flops: dict
    bwd_flops: dict
    call_overhead: float
    mem_bandwidth: float
    memory: float
    overlap: float = 1.0
    block: tuple = (128, 128)
    reduce_scatter_factor: float = 1.0
    collectives: dict = field(default_factory=dict)

    def link(self, span: int) -> Link:
        """The link between members of a group spread over `span` consecutive ranks: inside a
        node iff span <= ranks_per_node."""
        return self.intra if span <= self.ranks_per_node else self.inter

    def flops(self, dtype: str, backward: bool) -> float:
        table = self.bwd_flops if backward else self.fwd_flops
        if dtype not in table:
            raise ValueError(f"cpattn.plan: machine {self.name!r} has no {dtype} throughput "
                             f"(has {sorted(table)})")
        return table[dtype]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "Machine":
        d = json.loads(text)
        d["intra"], d["inter"] = Link(**d["intra"]), Link(**d["inter"])
        d["block"] = tuple(d["block"])
        d["collectives"] = {k: Link(**v) for k, v in d.get("collectives", {}).items()}
        return Machine(**d)


def _gpu(name, source, flops_bf16, nvlink, ib, hbm, memory, ranks_per_node=8):
    # FlashAttention-2-class kernels reach about 70 % of the dense bf16 peak forward and 55 %
    # backward on long sequences (FA2 paper, Dao 2023, figs. on A100/H100): nominal, not measured.
    fwd, bwd = 0.70 * flops_bf16, 0.55 * flops_bf16
    return Machine(
        name=name, source=source, ranks_per_node=ranks_per_node,
        intra=Link(nvlink, 10e-6), inter=Link(ib, 20e-6),
        fwd_flops={"bfloat16": fwd, "float16": fwd},
        bwd_flops={"bfloat16": bwd, "float16": bwd},
        call_overhead=10e-6, mem_bandwidth=hbm, memory=memory, overlap=1.0, block=(128, 128))


PRESETS = {
    "h100-ib": _gpu("h100-ib", "published/nominal: H100 SXM 989 TFLOP/s dense bf16, 80 GB HBM3 "
                    "3.35 TB/s, NVLink 4 450 GB/s per direction, InfiniBand NDR 400 Gb/s per GPU",
                    989e12, 450e9, 50e9, 3.35e12, 80e9),
    "h200-ib": _gpu("h200-ib", "published/nominal: H200 SXM 989 TFLOP/s dense bf16, 141 GB HBM3e "
                    "4.8 TB/s, NVLink 4 450 GB/s per direction, InfiniBand NDR 400 Gb/s per GPU",
                    989e12, 450e9, 50e9, 4.8e12, 141e9),
    "a100-ib": _gpu("a100-ib", "published/nominal: A100 SXM 80 GB 312 TFLOP/s dense bf16, HBM2e "
                    "2.0 TB/s, NVLink 3 300 GB/s per direction, InfiniBand HDR 200 Gb/s per GPU",
                    312e12, 300e9, 25e9, 2.0e12, 80e9),
    # The project's CI machine kind (2 AMD EPYC cores, bench/RESULTS.md), 2 ranks x 1 thread over
    # gloo on loopback TCP: nominal figures of that machine; calibrate() measures yours.
    "cpu-gloo": Machine(
        name="cpu-gloo", source="nominal: 2-core AMD EPYC (AVX-512) CI machine, 1 thread per "
        "rank, gloo over loopback TCP (figures of the order measured there; use calibrate())",
        ranks_per_node=1 << 30, intra=Link(1.0e9, 100e-6), inter=Link(1.0e9, 100e-6),
        fwd_flops={"float32": 60e9, "bfloat16": 90e9, "float16": 55e9},
        bwd_flops={"float32": 45e9, "bfloat16": 55e9, "float16": 40e9},
        call_overhead=50e-6, mem_bandwidth=5e9, memory=12e9, overlap=0.5, block=(64, 128),
        reduce_scatter_factor=2.0),
}


def machine(name_or_path: str) -> Machine:
    """A preset by name, or a JSON file written by calibrate()."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.exists(name_or_path):
        with open(name_or_path) as f:
            return Machine.from_json(f.read())
    raise ValueError(f"cpattn.plan: machine must be one of {sorted(PRESETS)} or a calibration "
                     f"file, got {name_or_path!r}")


@dataclass(frozen=True)
class Problem:
    """One attention call. seqlen: global tokens (with documents: their sum); heads / kv_heads /
    head_dim as q (B, S, H, D), k/v (B, S, Hkv, D); documents: packed document lengths (varlen);
    mode: "train" (forward + backward), "forward" (or "prefill"), "decode" (decode_tokens new
    queries against a cache of seqlen tokens)."""

    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    dtype: str = "bfloat16"
    causal: bool = False
    window: tuple = (-1, -1)
    documents: Optional[tuple] = None
    mode: str = "train"
    decode_tokens: int = 1

    def __post_init__(self):
        mode = "forward" if self.mode == "prefill" else self.mode
        object.__setattr__(self, "mode", mode)
        if self.documents is not None:
            object.__setattr__(self, "documents", tuple(int(n) for n in self.documents))
            object.__setattr__(self, "seqlen", sum(self.documents))
        checks = [
            (mode in MODES, "mode", self.mode, f"one of {MODES} or 'prefill'"),
            (self.dtype in DTYPE_BYTES, "dtype", self.dtype, f"one of {sorted(DTYPE_BYTES)}"),
            (self.seqlen > 0, "seqlen", self.seqlen, "> 0"),
            (self.batch > 0 and self.head_dim > 0, "batch/head_dim",
             (self.batch, self.head_dim), "> 0"),
            (self.kv_heads > 0 and self.heads % self.kv_heads == 0, "heads/kv_heads",
             (self.heads, self.kv_heads), "heads a positive multiple of kv_heads"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise ValueError(f"cpattn.plan.Problem: {name} must be {rule}, got {value!r}")
        object.__setattr__(self, "window", tuple(int(w) for w in self.window))

    @property
    def elem(self) -> int:
        return DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Candidate:
    strategy: str  # none, ring, allgather, ulysses, hybrid, sharded-cache
    layout: str = ""
    ulysses: int = 1
    ring: int = 1
    chunk: int = 0  # allgather: KV heads per gather; ring: KV heads per pass (0: all, one pass)

    @property
    def name(self) -> str:
        """As `python -m cpattn plan` prints it (its cost model's label)."""
        model = COST_MODELS.get(self.strategy)
        return model.label(self) if model is not None else self.strategy


@dataclass
class Prediction:
    """Seconds per call (time = compute + exposed communication + elementwise work), bytes sent
    per rank, peak bytes of attention state per rank (inputs included)."""

    candidate: Candidate
    time: float
    compute: float
    exposed_comm: float
    bytes_sent: float
    peak_memory: float
    fits: bool = True
    detail: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.candidate.name


@dataclass(frozen=True)
class CostModel:
    """The planner's model of one way to run attention (a strategy of cpattn.strategies, whose
    Strategy points here by its name; "none": cpattn.attention on one rank; "sharded-cache":
    decode over a sharded KV cache). Adding a strategy adds one of these (register_cost_model):
    `candidates()`, strategy="auto" and the plots then consider it.

    time(p, machine, world, candidate) -> Prediction; candidates(p, world, layouts) -> the
    Candidates it offers for p on `world` ranks with these layouts (none: it cannot run p);
    label(candidate) -> its name in tables; memory(p, world, layout, chunk, gloo) -> plan.memory's
    dict (None where the time model counts memory itself); checks(candidate, world) -> the spans
    of the rank-agreement checks a call starts with (None: no communication);
    runs_document_plans: it runs packed documents sharded by a DocumentPlan;
    runs_document_subsets: its code runs a plan's documents split over a subset of the ranks
    (whatever the strategy chosen for the others); in_passes(p, candidate) -> the same candidate
    in passes of fewer KV heads, tried when memory is short."""

    name: str
    time: Callable
    candidates: Callable[[Problem, int, Sequence[str]], list]
    label: Callable[[Candidate], str] = lambda c: c.strategy
    memory: Optional[Callable] = None
    checks: Optional[Callable[[Candidate, int], tuple]] = None
    runs_document_plans: bool = False
    runs_document_subsets: bool = False
    in_passes: Optional[Callable[[Problem, Candidate], list]] = None


# Every cost model by name, in the order candidates are listed.
COST_MODELS: dict[str, CostModel] = {}


def register_cost_model(model: CostModel) -> CostModel:
    """Adds (or replaces) `model` in COST_MODELS; returns it."""
    COST_MODELS[model.name] = model
    return model
