"""Which context-parallel strategy to use: a cost model, machine descriptions and the choice.

For a problem (shapes, dtype, mask, documents, training / forward / decode) and a machine (ranks,
links, kernel throughput, memory), `predict` gives every candidate's time per call, bytes sent
per rank and peak memory per rank, and `rank` orders them and explains the first in one line:

    none                    one rank computes everything, no communication
    ring/<layout>           K/V shards travel the ring, each step overlapped with the compute of
                            the shard held; backward sends fp32 dK/dV one step behind, plus a
                            final exposed hop (csrc/ops/ring.cpp)
    allgather/<layout>      K/V all-gathered a chunk of KV heads at a time, not overlapped;
                            backward gathers again and reduce-scatters fp32 dK/dV
    ulysses                 all-to-alls of q, k, v (GQA-replicated as ulysses.py does), out and
                            their gradients around one local kernel on the whole sequence
    hybrid UxR              Ulysses within U consecutive ranks, ring across R, for every U*R = W

The per-(rank, step) work comes from the schedule itself (torch.ops.cpattn.schedule_work, the
rule in csrc/include/cpattn/work.h): visited kernel tiles, so layouts, masks, windows and packed
documents are counted exactly. Times are max over ranks per ring step (the ring is synchronous).

Machines: `calibrate(group)` measures this group (seconds, cached to a file, identical on every
rank), `PRESETS` hold published / nominal figures (marked as such in `Machine.source`).
No torch.distributed is needed except by `calibrate`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from cpattn._flops import attention_flops
from cpattn._layout import LAYOUTS, granularity, kv_heads_for_ranks, round_up

log = logging.getLogger("cpattn.plan")

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
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
            (self.dtype in _DTYPE_BYTES, "dtype", self.dtype, f"one of {sorted(_DTYPE_BYTES)}"),
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
        return _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class Candidate:
    strategy: str  # none, ring, allgather, ulysses, hybrid, sharded-cache
    layout: str = ""
    ulysses: int = 1
    ring: int = 1
    chunk: int = 0  # allgather: KV heads per gather; ring: KV heads per pass (0: all, one pass)

    @property
    def name(self) -> str:
        if self.strategy == "ring" and self.chunk:
            return f"ring/{self.layout}/{self.chunk}kv"
        if self.strategy in ("ring", "allgather"):
            return f"{self.strategy}/{self.layout}"
        if self.strategy == "hybrid":
            return f"hybrid {self.ulysses}x{self.ring}/{self.layout}"
        return self.strategy


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


# ---- work from the schedule -----------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _work(seqlen: int, world: int, layout: str, causal: bool, window: tuple,
          block: tuple, documents: Optional[tuple]) -> torch.Tensor:
    """(world, world, 3) float64: visible pairs, visited tile pairs, kernel calls per
    (rank, step), per batch row and head."""
    docs = torch.tensor(documents, dtype=torch.int64) if documents is not None else None
    w = torch.ops.cpattn.schedule_work(seqlen, world, LAYOUTS[layout], causal, window[0],
                                       window[1], block[0], block[1], docs)
    return w.double()


def _padded(p: Problem, world: int, layout: str) -> int:
    """Tokens per rank (documents padded per document as ring_attention_varlen does)."""
    if p.documents is None:
        return p.seqlen // world
    g = granularity(layout, world)
    return sum(round_up(n, g) for n in p.documents) // world


def _compute_steps(p: Problem, m: Machine, world: int, layout: str, heads: int,
                   seqlen: Optional[int] = None, backward: bool = False) -> torch.Tensor:
    """(world ranks, world steps) kernel seconds."""
    w = _work(seqlen or p.seqlen, world, layout, p.causal, tuple(p.window), tuple(m.block),
              p.documents if seqlen is None else None)
    per_pair = (10 if backward else 4) * p.head_dim * p.batch * heads
    return w[..., 1] * per_pair / m.flops(p.dtype, backward) + w[..., 2] * m.call_overhead


def _divisible(p: Problem, world: int, layout: str) -> bool:
    return p.documents is not None or p.seqlen % granularity(layout, world) == 0


# ---- memory: the bytes a call allocates per rank ------------------------------------------------
# THE model of cpattn's memory (bench/RESULTS.md, "Memory per rank"; tests/test_memory.py checks
# it against cpattn.memory.counting()). It follows the code step by step: each phase is the sum
# of the tensors alive in it, and a call's peak is the largest phase. Counted: every at::Tensor
# a call allocates on top of its inputs (q, k, v and, for the backward, the gradient of out):
# outputs, fp32 state, saved tensors, the ring's buffers, packing copies, conversions. Not
# counted: the CPU kernels' own buffers (malloc'd: the "scratch" of the result, the backward's
# chunk buffers and, unless summed in place, fp32 dK / dV sums, _kernel_bwd_scratch) and Python
# objects.
# CUDA kernels pack nothing (their transients are the sub-problem outputs only), so this is an
# upper bound there.

def _kernel_fwd(B: int, n: int, h: int, hkv: int, D: int, e: int, bf16: bool) -> int:
    """Bytes alive inside one local forward kernel call (cpattn.attention_fwd on CPU) over n query
    rows and n keys, fp32 output: the output and LSE, and the operand packing (csrc/ops/
    attention_cpu.cpp pack / pair_keys): bf16 on a CPU with bf16 dot products keeps Q in place
    and packs K, V and V's key pairs; otherwise Q, K and V are packed to fp32."""
    dp = -(-D // 16) * 16
    state = 4 * B * n * h * D + 4 * B * h * n
    if bf16:
        return state + 2 * B * hkv * dp * (n + 2 * -(-n // 2))
    return state + 4 * B * dp * (h * n + 2 * hkv * n)


_BACKWARD_GROUP_BYTES = 8 << 20  # csrc/ops/attention_cpu.cpp kBackwardGroupBytes


def _sum_bytes(grad: str, D: int) -> int:
    """Bytes per dK / dV value that the backward kernel sums in beyond the gradient
    (csrc/cpu/attention_kernel.h KeyGradSums): none in fp32 gradients, the low halves of the fp32
    sums beside bf16 ones, whole fp32 sums otherwise (and whenever D is not a multiple of 16)."""
    if D % 16:
        return 4
    return {"float32": 0, "bfloat16": 2}.get(grad, 4)


def _backward_group(B: int, n: int, h: int, hkv: int, D: int, e: int, grad: str,
                    bf16: bool) -> int:
    """KV heads per backward kernel call (csrc/ops/attention_cpu.cpp) with gradients in dtype
    `grad`: as many as keep what one call allocates beyond the gradients (bf16: K's key pairs,
    and K and V unless D is a multiple of 16; fp32: copies of operands not read in place; the dK
    / dV sums beyond the gradients, _sum_bytes) within 8 MiB, at least one; all of them when
    that is nothing."""
    dp = -(-D // 16) * 16
    per_head = 0
    if bf16:
        per_head += 2 * B * 2 * -(-n // 2) * dp + (2 * B * 2 * n * dp if dp != D else 0)
    elif e != 4 or dp != D:
        per_head += 4 * B * 2 * dp * (h // hkv * n + n)
    per_head += _sum_bytes(grad, D) * B * n * 2 * dp
    return hkv if per_head == 0 else min(max(_BACKWARD_GROUP_BYTES // per_head, 1), hkv)


def _kernel_bwd(B: int, n: int, h: int, hkv: int, D: int, e: int, grad: str, bf16: bool,
                new: str = "qkv") -> int:
    """Bytes alive inside one local backward kernel call over n query rows and n keys whose
    gradients are in dtype `grad`: delta, the LSE rows, the gradients it allocates (`new`: "qkv"
    all three; "kv" dk and dv only, dq added into an accumulator; "" none: the ring's
    sub-problems, csrc/ops/ring.cpp backward_step), and one group of KV heads'
    (_backward_group) packing (bf16: K's key pairs, and K and V unless D is a multiple of 16;
    fp32 with D a multiple of 16: none, Q, K, V and dO are read in place; otherwise Q, K, V and
    dO in fp32) and, with batch > 1, its LSE and delta rows."""
    dp = -(-D // 16) * 16
    g = _DTYPE_BYTES[grad]
    rows = 4 * B * h * n * 2 + g * B * n * D * (h * ("q" in new) + 2 * hkv * ("kv" in new))
    if B > 1:  # the rows of dout and out, not contiguous with batch > 1, are copied for delta
        rows += 2 * e * B * n * h * D
    c = _backward_group(B, n, h, hkv, D, e, grad, bf16)
    hc = h // hkv * c
    if B > 1 and c < hkv:
        rows += 4 * B * hc * n * 2
    if bf16:
        return rows + 2 * B * c * dp * ((2 * n if dp != D else 0) + 2 * -(-n // 2))
    if e == 4 and dp == D:
        return rows
    return rows + 4 * B * dp * (2 * hc * n + 2 * c * n)


def _kernel_bwd_scratch(B: int, n: int, h: int, hkv: int, D: int, grad: str, bf16: bool,
                        e: Optional[int] = None) -> int:
    """The backward kernel's own buffers (malloc'd, not tensors; csrc/cpu/attention_kernel.h
    backward_chunks), all threads together, for n query rows and n keys whose gradients are
    written in dtype `grad` (inputs of e bytes, default grad's), in one call of a group of KV
    heads (_backward_group): one chunk of cq query rows of every head packed (Q^T, dO^T and Q,
    dO as rows: 16 bytes per element in fp32, 8 in bf16), the chunk's fp32 dQ per split of the
    key blocks (8 / (B Hkv) splits, at least 1), and the dK and dV sums beyond the gradients
    (_sum_bytes). Per-thread blocks of about 0.2-0.3 MiB are not counted."""
    e = _DTYPE_BYTES[grad] if e is None else e
    c = _backward_group(B, n, h, hkv, D, e, grad, bf16)
    h, hkv = h // hkv * c, c
    dp = -(-D // 16) * 16
    splits = -(-8 // (B * hkv))  # key_splits
    share = max(1, splits // 2)
    cq = min(max(2048 * 128 // (B * h * dp * share) // 64 * 64, 64), 512,
             -(-n // 64) * 64)  # chunk_rows
    packed = (8 if bf16 else 16) * B * h * cq * dp
    dq = splits * 4 * B * h * cq * dp
    sums = _sum_bytes(grad, D) * B * n * hkv * 2 * dp
    return packed + dq + sums


def allgather_chunk(kv_heads: int, world: int) -> int:
    """ring_attention(strategy="allgather")'s default KV heads per gather: kv_heads / (4 W), at
    least one, so a gathered chunk (its K and V over the whole sequence) is at most a quarter of
    this rank's own K and V shards and the memory per rank falls as 1/W."""
    return max(1, kv_heads // (4 * world))


@functools.lru_cache(maxsize=1)
def _bf16_dot() -> bool:
    """Whether this CPU's kernel takes bf16 through bf16 dot products (its packing differs)."""
    from cpattn import _C

    return _C.cpu_isa() == "avx512bf16"


def memory(p: Problem, strategy: str, world: int, layout: str = "zigzag",
           chunk: Optional[int] = None, gloo: bool = False) -> dict:
    """Bytes one call of `strategy` ("ring", "allgather", "ulysses"; "none" = cpattn.attention
    on the whole sequence) allocates on one of `world` ranks on top of its inputs, for problem
    p (p.mode "train": forward then backward; otherwise the forward). Returns {"peak": bytes,
    "kept": bytes still alive after the call when the caller keeps only its result (train: the
    gradients, out and the graph freed; forward: out), cached buffers included,
    "phases": {name: bytes alive in that phase}, "scratch": the largest backward kernel call's
    own malloc'd buffers, on top of the peak phase (the RSS sees them), "gloo_late": with gloo,
    the largest of gloo's copies, which may outlive its phase (below)}. The ring's receive
    buffers and fp32 dK/dV accumulators are counted (cached between calls:
    cpattn.release_buffers() frees them).
    chunk: all-gather KV heads per gather (default ring_attention's: allgather_chunk); ring: KV
        heads per pass (ring_chunk; default all of them, one pass).
    gloo: the process group is gloo's (CPU tensors), whose all-gather and reduce-scatter copy the
    whole gathered / reduced buffer (NCCL's do not). Gloo frees that copy, and the buffer an
    all-to-all sends, on its own thread, racing the caller: it may still be alive in the next
    phase (not counted in the phases: "gloo_late")."""
    B, H, Hkv, D, e = p.batch, p.heads, p.kv_heads, p.head_dim, p.elem
    train = p.mode == "train"
    W = world
    L = _padded(p, W, layout) if strategy in ("ring", "allgather") else p.seqlen // W
    Q, K = B * L * H * D, B * L * Hkv * D  # elements of this rank's q and of its k (or v)
    lse = 4 * B * H * L
    bf = p.dtype == "bfloat16" and _bf16_dot()
    cast = e != 4  # fp32 state converted to the input dtype at the end
    # bf16: dQ's fp32 sums kept split, high halves in the bf16 result and low halves beside,
    # rounded in place (csrc/ops/ring.cpp DqSums): no bf16 copy of an fp32 dQ
    split_dq = p.dtype == "bfloat16"
    ph: dict = {}
    if strategy == "ring" and chunk and chunk < Hkv:
        return _memory_ring_passes(p, world, layout, chunk)
    if strategy == "none" or (strategy == "ulysses" and W == 1):  # one rank: no all-to-all
        return _memory_local(ph, B, p.seqlen, H, Hkv, D, e, train, bf, p.dtype)
    if strategy == "ring":
        n = L // 2 if layout == "zigzag" else L  # sub-problems: runs of the local shard
        recv = min(W - 1, 2) * 2 * K * e  # K/V receive buffers (cached)
        ph["fwd: kernel step"] = 4 * Q + lse + recv + _kernel_fwd(B, n, H, Hkv, D, e, bf)
        ph["fwd: cast out"] = 4 * Q + lse + recv + cast * Q * e
        kept = Q * e + recv
        if train:
            acc = (2 if W > 1 else 1) * 2 * K * 4  # fp32 dK/dV accumulators (cached)
            base = kept + lse + 4 * Q + acc  # out and LSE saved, fp32 dq
            # the kernels add into dq and the accumulators; a step after the first adds its first
            # sub-problem's dK/dV into temporaries while the accumulator is in flight
            ph["bwd: kernel step"] = base + _kernel_bwd(B, n, H, Hkv, D, e, "float32", bf,
                                                        "kv" if W > 1 else "")
            # the gradients: cast from the fp32 dq and accumulators (split dq: rounded in place,
            # its low halves freed first); in fp32, dq itself and the last hop's (or at W = 1 a
            # copy's) new dk, dv
            grads = ((0 if split_dq else Q) + 2 * K) * e if cast else 2 * K * 4
            ph["bwd: gradients"] = base - split_dq * 2 * Q + grads
            kept = recv + acc + (Q + 2 * K) * e  # the graph freed: gradients and cached buffers
        return _result(ph, kept, train and _kernel_bwd_scratch(B, n, H, Hkv, D, "float32", bf, e))
    if strategy == "allgather":
        c = chunk or allgather_chunk(Hkv, W)
        one = c >= Hkv
        c = min(c, Hkv)
        hq = c * (H // Hkv)
        Qc, Kc = B * L * hq * D, B * L * c * D
        n = L // 2 if layout == "zigzag" else L
        sc = 2 * Kc * e  # one rank's stacked K/V chunk
        out_all = 0 if one else Q * e + lse  # the result, written chunk by chunk
        tmp = W if gloo else 0  # gloo's copy of the gathered / reduced buffer
        ph["fwd: gather"] = out_all + (W + 1 + tmp) * sc
        ph["fwd: kernel step"] = (out_all + W * sc + 4 * Qc + 4 * B * hq * L
                                  + _kernel_fwd(B, n, hq, c, D, e, bf))
        ph["fwd: cast out"] = out_all + W * sc + 4 * Qc + 4 * B * hq * L + cast * Qc * e
        kept = Q * e
        late = tmp * sc  # gloo's copies, which may outlive their phase
        if train:
            grads = 0 if one else (Q + 2 * K) * e  # written chunk by chunk
            dout_c = 0 if one else Qc * e  # the chunk's dout heads, made contiguous
            base = kept + lse + grads
            dkv_all = W * 2 * Kc * 4
            ph["bwd: gather"] = base + (W + 1 + tmp) * sc
            ph["bwd: kernel step"] = (base + W * sc + dout_c + 4 * Qc + dkv_all
                                      + _kernel_bwd(B, n, hq, c, D, e, "float32", bf, ""))
            ph["bwd: cast dq"] = (base + W * sc + dout_c + 4 * Qc + dkv_all
                                  + (cast and not split_dq) * Qc * e)
            dq_c = Qc * (e if cast else 4)
            ph["bwd: reduce-scatter"] = base + dq_c + (1 + bool(gloo)) * dkv_all + 2 * Kc * 4
            late = max(late, bool(gloo) * dkv_all)
            ph["bwd: cast dk dv"] = base + dq_c + 2 * Kc * 4 + one * 2 * Kc * e
            kept = (Q + 2 * K) * e
        return _result(ph, kept, train and _kernel_bwd_scratch(B, n, hq, c, D, "float32", bf, e),
                       late)
    if strategy == "ulysses":
        hs = _kv_heads_sent(H, Hkv, W)  # KV heads each rank sends (GQA: replicated)
        Ks = B * L * hs * D
        S, h, hk = L * W, H // W, hs // W  # after the all-to-all: the whole sequence, H/W heads
        rep = 2 * Ks * e if hs != Hkv else 0  # replicated K, V before the all-to-all
        # an all-to-all of x: a copy in rank order (none for the sequence dim at batch 1) and
        # the receive buffer, which the result is a view of (a copy for the head dim)
        ph["fwd: all-to-all q"] = rep + 2 * Q * e
        held = Q * e + 2 * Ks * e  # q, k, v by heads (saved for the backward)
        ph["fwd: all-to-all k, v"] = rep + held + Ks * e
        lse_h = 4 * B * h * S
        ph["fwd: kernel"] = held + Q * e + _kernel_fwd(B, S, h, hk, D, e, bf) - 4 * Q  # out in e
        back = Q * e * (1 if B == 1 else 2)  # out by heads -> by sequence: receive, concatenate
        ph["fwd: all-to-all out"] = held + Q * e + lse_h + back + Q * e
        kept = Q * e
        if train:
            # q, k, v by heads, the LSE by heads and by sequence, out by sequence only (the
            # backward sends rowsum(dout * out) by heads: ulysses._LocalAcrossHeads)
            saved = held + 2 * lse_h + Q * e
            ph["bwd: all-to-all dout"] = saved + 2 * Q * e
            # + the row dots by heads and their negation (the op's dlse - row_dot); dq is written
            # over dout by heads (attention_bwd_in_dout)
            ph["bwd: kernel"] = (saved + Q * e + 2 * lse_h
                                 + _kernel_bwd(B, S, h, hk, D, e, p.dtype, bf, "kv"))
            grads_h = (Q + 2 * Ks) * e
            # Once the kernel's autograd node has run, its saved tensors are freed: out (the
            # caller's) and the gradients by heads remain. The engine sends dv, dk, then dq (the
            # forward's order reversed), each by heads freed once sent.
            ph["bwd: all-to-all dk, dv"] = Q * e + grads_h + back * Ks // Q
            ph["bwd: all-to-all dq"] = 2 * Q * e + 2 * Ks * e + back
            if hs != Hkv:  # summed back over the replicas (index_select's backward)
                ph["bwd: unreplicate"] = 2 * Q * e + 2 * Ks * e + 2 * K * e
            kept = (Q + 2 * K) * e
        # gloo: the copy of q (dout) in rank order for the all-to-all to heads may be freed by
        # gloo's thread after the next phase has begun
        late = Q * e if gloo and W > 1 else 0
        return _result(ph, kept, train and _kernel_bwd_scratch(B, S, h, hk, D, p.dtype, bf),
                       late)
    raise ValueError(f"cpattn.plan.memory: unknown strategy {strategy!r}")


def _memory_ring_passes(p: Problem, world: int, layout: str, chunk: int) -> dict:
    """The ring in passes of `chunk` KV heads (ring_attention(ring_chunk=...)): each pass is the
    ring of its heads (its phases), around it the whole results written pass by pass, the pass's
    k, v heads made contiguous for the ring and, in the backward, its dout heads."""
    q_heads = p.heads // p.kv_heads * chunk
    one = memory(dataclasses.replace(p, heads=q_heads, kv_heads=chunk), "ring", world, layout)
    L, e = _padded(p, world, layout), p.elem
    Q, K = p.batch * L * p.heads * p.head_dim, p.batch * L * p.kv_heads * p.head_dim
    Qc, Kc = Q // p.heads * q_heads, K // p.kv_heads * chunk
    lse, lse_c = 4 * p.batch * p.heads * L, 4 * p.batch * q_heads * L
    # The pass's own out and LSE (saved, in its phases) are views of the whole ones here.
    fwd = Q * e + lse + 2 * Kc * e
    bwd = (Q - Qc) * e + lse - lse_c + (Q + 2 * K) * e + Qc * e + 2 * Kc * e
    ph = {name: b + (bwd if name.startswith("bwd") else fwd) for name, b in one["phases"].items()}
    grads = (Q + 2 * K - Qc - 2 * Kc) * e if p.mode == "train" else (Q - Qc) * e
    return _result(ph, one["kept"] + grads, one["scratch"])


def _inputs(p: Problem, world: int) -> int:
    """Bytes of a rank's inputs: q, k, v and, in training, the gradient of out."""
    q = p.batch * (p.seqlen // world) * p.heads * p.head_dim * p.elem
    kv = 2 * p.batch * (p.seqlen // world) * p.kv_heads * p.head_dim * p.elem
    return q + kv + (q if p.mode == "train" else 0)


def _memory_local(ph: dict, B, S, H, Hkv, D, e, train, bf, dtype) -> dict:
    """cpattn.attention over the whole sequence on one rank."""
    Q, K, lse = B * S * H * D, B * S * Hkv * D, 4 * B * H * S
    ph["fwd: kernel"] = Q * e + _kernel_fwd(B, S, H, Hkv, D, e, bf) - 4 * Q  # out in e
    kept = Q * e
    if train:
        ph["bwd: kernel"] = kept + lse + _kernel_bwd(B, S, H, Hkv, D, e, dtype, bf)
        kept = (Q + 2 * K) * e
    return _result(ph, kept, train and _kernel_bwd_scratch(B, S, H, Hkv, D, dtype, bf))


def _result(phases: dict, kept: int, scratch: int, gloo_late: int = 0) -> dict:
    return {"peak": max(phases.values()), "kept": kept, "phases": phases,
            "scratch": int(scratch), "gloo_late": gloo_late}


# ---- the strategies --------------------------------------------------------------------------

def _combine(compute: float, comm: float, overlap: float) -> float:
    """A step whose transfer runs during its compute: the longer of the two, plus the part of
    the shorter one that does not overlap."""
    return max(compute, comm) + (1.0 - overlap) * min(compute, comm)


def _ring(p: Problem, m: Machine, world: int, layout: str, heads: int, kv_heads: int,
          link: Link, seqlen: Optional[int] = None) -> dict:
    """Time and traffic of the ring driver (csrc/ops/ring.cpp) over `world` ranks."""
    local = _padded(p, world, layout) if seqlen is None else seqlen // world
    e = p.elem
    kv = 2 * p.batch * local * kv_heads * p.head_dim * e
    acc = 2 * p.batch * local * kv_heads * p.head_dim * 4
    state = p.batch * local * heads * p.head_dim * 4  # fp32 out / dq of the local queries
    fwd = _compute_steps(p, m, world, layout, heads, seqlen).amax(0).tolist()
    merge = 3 * state / m.mem_bandwidth  # part_out + out read, out written per step
    shift = link.time(kv) if world > 1 else 0.0
    t_fwd = kv / m.mem_bandwidth  # stacking K and V
    compute = exposed = 0.0
    for t, c in enumerate(fwd):
        c += merge if c > 0 else 0.0
        step = _combine(c, shift, m.overlap) if t + 1 < world else c
        compute += c
        exposed += step - c
        t_fwd += step
    res = {"fwd": t_fwd, "compute": compute, "exposed": exposed,
           "sent": (world - 1) * kv, "kv": kv, "acc": acc, "state": state}
    if p.mode != "train":
        return res
    bwd = _compute_steps(p, m, world, layout, heads, seqlen, backward=True).amax(0).tolist()
    t_bwd = 2 * state / m.mem_bandwidth  # dq zeroed and cast
    for t, c in enumerate(bwd):
        c += (3 * acc + state) / m.mem_bandwidth  # partial zeroed, acc added, dq accumulated
        nbytes = (kv if t + 1 < world else 0) + (acc if t > 0 else 0)
        comm = link.time(nbytes, (t + 1 < world) + (t > 0))
        step = _combine(c, comm, m.overlap)
        compute += c
        exposed += step - c
        t_bwd += step
    if world > 1:  # the accumulators' final hop home, nothing left to hide it behind
        final = link.time(acc) + acc / m.mem_bandwidth
        exposed += final
        t_bwd += final
    res.update(bwd=t_bwd, compute=compute, exposed=exposed, sent=2 * (world - 1) * kv + world * acc
               if world > 1 else 0.0)
    return res


def _all_gather_time(link: Link, per_rank: float, world: int) -> float:
    """Ring all-gather / reduce-scatter: W - 1 messages of one rank's part."""
    return link.time((world - 1) * per_rank, world - 1) if world > 1 else 0.0


def _collective_time(m: Machine, name: str, link: Link, nbytes: float, world: int,
                     unmeasured_factor: float = 1.0) -> float:
    """A collective over `world` ranks in which ideally `nbytes` leave each rank: at the rate
    calibrate() measured for it (which absorbs the backend's own overheads), else as W - 1
    messages of `unmeasured_factor` times those bytes on `link`."""
    if world == 1:
        return 0.0
    measured = m.collectives.get(name)
    if measured is not None:
        return measured.time(nbytes)
    return link.time(nbytes * unmeasured_factor, world - 1)


def _all_to_all_time(m: Machine, total: float, world: int, span: int) -> float:
    """All-to-all of `total` bytes per rank over `world` ranks, `span` consecutive ranks wide:
    (W-1)/W of it leaves the rank; the part to other nodes goes over the slower link."""
    if world == 1:
        return 0.0
    if "all_to_all" in m.collectives and span <= m.ranks_per_node:
        return _collective_time(m, "all_to_all", m.intra, total * (world - 1) / world, world)
    if span <= m.ranks_per_node:
        t = m.intra.time(total * (world - 1) / world, world - 1)
    else:
        near, far = m.ranks_per_node - 1, world - m.ranks_per_node
        t = max(m.intra.time(total * near / world, near), m.inter.time(total * far / world, far))
    return t + 2 * total / m.mem_bandwidth  # chunk and concatenate copies


def _kv_heads_sent(heads: int, kv_heads: int, u: int) -> int:
    """KV heads each rank puts into Ulysses' all-to-all: those kv_heads_for_ranks picks."""
    sent = kv_heads_for_ranks(heads, kv_heads, u)
    return kv_heads if sent is None else len(sent)


def _agreement(m: Machine, world: int) -> float:
    """The rank-agreement check every call starts with: one small all-gather."""
    return _all_gather_time(m.link(world), 256, world)


def _predict_one(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    pred = _predict_strategy(p, m, world, c)
    if c.strategy in ("ring", "allgather", "ulysses", "hybrid") and world > 1:
        check = _agreement(m, c.ulysses if c.strategy == "hybrid" else world)
        if c.strategy == "hybrid":
            check += _agreement(m, world)  # and the ring's, across
        pred.time += check
        pred.exposed_comm += check
    return pred


def _predict_strategy(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    e, B, D, H, Hkv = p.elem, p.batch, p.head_dim, p.heads, p.kv_heads
    train = p.mode == "train"
    full_q = B * p.seqlen * H * D * e
    full_kv = 2 * B * p.seqlen * Hkv * D * e
    if c.strategy == "none":
        r = _ring(p, m, 1, "contiguous", H, Hkv, m.intra)
        time_ = r["fwd"] + r.get("bwd", 0.0)
        peak = _inputs(p, 1) + memory(p, "none", 1)["peak"]
        return Prediction(c, time_, r["compute"], 0.0, 0.0, peak)
    if c.strategy in ("ring", "allgather"):
        link = m.link(world)
        peak = _inputs(p, world) + memory(p, c.strategy, world, c.layout, c.chunk)["peak"]
        if c.strategy == "ring":  # in passes of c.chunk KV heads (ring_chunk), each a ring
            passes = math.ceil(Hkv / c.chunk) if 0 < c.chunk < Hkv else 1
            r = _ring(p, m, world, c.layout, H // Hkv * min(c.chunk or Hkv, Hkv),
                      min(c.chunk or Hkv, Hkv), link)
            time_ = passes * (r["fwd"] + r.get("bwd", 0.0))
            return Prediction(c, time_, passes * r["compute"], passes * r["exposed"],
                              passes * r["sent"], peak)
        r = _ring(p, m, world, c.layout, H, Hkv, link)
        chunks = math.ceil(Hkv / c.chunk)
        fwd_c = _compute_steps(p, m, world, c.layout, H).sum(1).amax().item()
        kv_chunk = r["kv"] / Hkv * c.chunk
        gather = chunks * _collective_time(m, "all_gather", link, (world - 1) * kv_chunk, world)
        copies = world * r["kv"] / m.mem_bandwidth
        compute = fwd_c + world * r["state"] * 3 / m.mem_bandwidth
        time_, exposed, sent = compute + gather + copies, gather, (world - 1) * r["kv"]
        if train:
            bwd_c = _compute_steps(p, m, world, c.layout, H, backward=True).sum(1).amax().item()
            acc_chunk = r["acc"] / Hkv * c.chunk
            rs = chunks * _collective_time(m, "reduce_scatter", link, (world - 1) * acc_chunk,
                                           world, m.reduce_scatter_factor)
            exposed += gather + rs
            compute += bwd_c
            time_ += bwd_c + gather + rs + copies + 2 * world * r["acc"] / m.mem_bandwidth
            sent += (world - 1) * (r["kv"] + r["acc"] * m.reduce_scatter_factor)
        return Prediction(c, time_, compute, exposed, sent, peak)
    if c.strategy in ("ulysses", "hybrid"):
        u, rr = c.ulysses, c.ring
        kv_sent = _kv_heads_sent(H, Hkv, u)
        q_rank = full_q / world  # this rank's q shard (also out, dout, dq)
        kv_rank = 2 * B * (p.seqlen // world) * kv_sent * D * e
        a2a = lambda total: _all_to_all_time(m, total, u, u)  # noqa: E731
        comm = 2 * a2a(q_rank) + a2a(kv_rank)  # q and out, k and v
        sent = (u - 1) / u * (2 * q_rank + kv_rank)
        if rr == 1:
            steps = _compute_steps(p, m, 1, "contiguous", H // u)
            compute = steps.sum().item() + 3 * B * p.seqlen * H // u * D * 4 / m.mem_bandwidth
            if train:
                compute += _compute_steps(p, m, 1, "contiguous", H // u, backward=True).sum().item()
            inner, ring_exposed, ring_sent = compute, 0.0, 0.0
        else:
            r = _ring(p, m, rr, c.layout, H // u, kv_sent // u, m.link(world), seqlen=p.seqlen)
            inner = r["fwd"] + r.get("bwd", 0.0)
            compute, ring_exposed, ring_sent = r["compute"], r["exposed"], r["sent"]
        if train:
            comm += 2 * a2a(q_rank) + a2a(kv_rank)  # dout and dq, dk and dv
            sent += (u - 1) / u * (2 * q_rank + kv_rank)
        time_ = inner + comm
        if rr == 1:
            peak = _inputs(p, world) + memory(p, "ulysses", u)["peak"]
        else:  # the Ulysses all-to-alls over U, then the ring over R on q, k, v by heads
            by_heads = dataclasses.replace(p, heads=H // u, kv_heads=max(1, kv_sent // u))
            ring = memory(by_heads, "ring", rr, c.layout)["peak"]
            held = (q_rank + kv_rank) * (2 if train else 1) + q_rank  # + out by sequence
            peak = _inputs(p, world) + held + ring
        return Prediction(c, time_, compute, comm + ring_exposed, sent + ring_sent, peak)
    if c.strategy == "sharded-cache":
        # decode: each rank reads its 1/W of the cache; W partial (out, lse) are all-gathered.
        sq = p.decode_tokens
        reads = full_kv / world
        flops = attention_flops(B, H, sq, p.seqlen / world, D) / m.flops(p.dtype, False)
        compute = max(flops, reads / m.mem_bandwidth) + m.call_overhead
        part = B * sq * H * (D + 1) * 4
        comm = _all_gather_time(m.link(world), part, world)
        return Prediction(c, compute + comm, compute, comm, (world - 1) * part,
                          reads + world * part)
    raise ValueError(f"cpattn.plan: unknown strategy {c.strategy!r}")


def candidates(p: Problem, world: int, layouts: Sequence[str] = ("zigzag", "contiguous",
                                                                  "striped")) -> list:
    """Every strategy that can run the problem on `world` ranks."""
    if p.mode == "decode":
        return [Candidate("none")] + ([Candidate("sharded-cache")] if world > 1 else [])
    out = [Candidate("none")]
    if world == 1:
        return out
    for layout in layouts:
        if _divisible(p, world, layout):
            out.append(Candidate("ring", layout))
            out.append(Candidate("allgather", layout, chunk=allgather_chunk(p.kv_heads, world)))
    if p.documents is None:  # Ulysses and hybrid take one sequence
        for u in range(2, world + 1):
            r = world // u
            if world % u or p.heads % u:
                continue
            # hybrid_positions: the ring shards (zigzag over R) split into U contiguous parts
            ok = p.seqlen % u == 0 if r == 1 else (p.seqlen % (2 * r) == 0
                                                     and (p.seqlen // r) % u == 0)
            if ok:
                out.append(Candidate("hybrid" if r > 1 else "ulysses",
                                     "zigzag" if r > 1 else "contiguous", u, r))
    return out


def _decode_none(p: Problem, m: Machine) -> Prediction:
    full_kv = 2 * p.batch * p.seqlen * p.kv_heads * p.head_dim * p.elem
    flops = attention_flops(p.batch, p.heads, p.decode_tokens, p.seqlen, p.head_dim)
    t = max(flops / m.flops(p.dtype, False), full_kv / m.mem_bandwidth) + m.call_overhead
    return Prediction(Candidate("none"), t, t, 0.0, 0.0, full_kv)


def predict(p: Problem, m: Machine, world: int, cands: Optional[Sequence[Candidate]] = None
            ) -> list:
    """Predictions for every candidate (default: all that can run), in candidate order."""
    if world < 1:
        raise ValueError(f"cpattn.plan.predict: world must be >= 1, got {world}")
    out = []
    for c in cands if cands is not None else candidates(p, world):
        pred = _decode_none(p, m) if (p.mode == "decode" and c.strategy == "none") else \
            _predict_one(p, m, world, c)
        pred.fits = pred.peak_memory <= m.memory
        out.append(pred)
    return out


def rank(preds: Sequence[Prediction]) -> list:
    """Fastest first; candidates that do not fit in memory last."""
    return sorted(preds, key=lambda r: (not r.fits, r.time))


def explain(ranked: Sequence[Prediction]) -> str:
    """One line: the choice and why."""
    best = ranked[0]
    others = [r for r in ranked[1:] if r.fits]
    if best.exposed_comm <= 0.05 * best.time:
        why = "communication hidden or absent"
    else:
        why = f"{100 * best.exposed_comm / best.time:.0f} % of it exposed communication"
    line = f"{best.name}: {best.time * 1e3:.3g} ms per call ({why})"
    if others:
        nxt = others[0]
        line += f", {nxt.time / best.time:.2f}x faster than {nxt.name}"
    none = next((r for r in ranked if r.candidate.strategy == "none"), None)
    if none is not None and none is not best and (not others or none is not others[0]):
        line += f", {none.time / best.time:.2f}x faster than no CP"
    if not best.fits:
        line += "; nothing fits in memory"
    return line


def plan(p: Problem, m: Machine, world: int, cands: Optional[Sequence[Candidate]] = None):
    """(ranked predictions, one-line explanation). When the fastest candidate does not fit in
    memory, the rings among them are also tried in passes of fewer KV heads (ring_chunk: half,
    a quarter, ... of them, down to one), which divide the ring's own memory."""
    preds = predict(p, m, world, cands)
    if preds and not min(preds, key=lambda r: r.time).fits:
        preds += predict(p, m, world, _ring_passes(p, [r.candidate for r in preds]))
    ranked = rank(preds)
    return ranked, explain(ranked)


def _ring_passes(p: Problem, cands: Sequence[Candidate]) -> list:
    """The one-pass rings of `cands` in passes of Hkv / 2, Hkv / 4, ..., 1 KV heads."""
    chunks = sorted({max(1, p.kv_heads >> i) for i in range(1, p.kv_heads.bit_length())},
                    reverse=True)
    return [dataclasses.replace(c, chunk=n) for c in cands
            if c.strategy == "ring" and not c.chunk for n in chunks if n < p.kv_heads]


def table(ranked: Sequence[Prediction]) -> str:
    """The ranked predictions as a markdown table."""
    lines = ["| # | strategy | time (ms) | compute (ms) | exposed comm (ms) | MiB sent per rank "
             "| peak MiB per rank | fits |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(ranked, 1):
        lines.append(f"| {i} | {r.name} | {r.time * 1e3:.4g} | {r.compute * 1e3:.4g} | "
                     f"{r.exposed_comm * 1e3:.3g} | {r.bytes_sent / 2**20:.4g} | "
                     f"{r.peak_memory / 2**20:.5g} | {'yes' if r.fits else 'no'} |")
    return "\n".join(lines)


# ---- calibration -----------------------------------------------------------------------------

def _cache_path(key: str) -> str:
    root = os.environ.get("CPATTN_PLAN_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "cpattn")
    return os.path.join(root, f"machine-{key}.json")


def _timed(fn, repeats: int, sync=None, slowest: bool = False) -> float:
    """Best of `repeats` after a warm-up (the least disturbed run); sync() before each run lines
    the ranks up, so that they compute (and share cores) at the same time. slowest: each run
    ends at a second sync(), when the slowest rank is done: for compute probes, where timing
    each rank's own call ran up to a third fast with 4 ranks on 2 cores (the scheduler lets some
    ranks finish first, and the others then run faster too; a strategy waits for the slowest).
    Collectives need no second sync (they end together), and it would add a barrier's latency."""
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        if slowest:
            sync()
        best = min(best, time.perf_counter() - start)
    return best


def _probe_kernel(device, dtype: torch.dtype, block: tuple, sync) -> tuple:
    """(fwd FLOP/s, bwd FLOP/s, seconds per call) from two sizes of a non-causal problem."""
    from cpattn.attention import attention

    heads, dim = 4, 64
    big = 2048 if device.type == "cpu" else 8192
    results = []
    for seqlen in (big // 4, big):
        q, k, v = (torch.randn(1, seqlen, heads, dim, device=device, dtype=dtype)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        t_fwd = _timed(lambda: attention(q, k, v), 3, sync, slowest=True)
        t_all = _timed(lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout), 3, sync,
                       slowest=True)
        tiles = -(-seqlen // block[0]) * block[0] * (-(-seqlen // block[1]) * block[1])
        results.append((tiles * heads * dim, t_fwd, max(t_all - t_fwd, 1e-9)))
    (w0, f0, b0), (w1, f1, b1) = results
    fwd_rate = 4 * (w1 - w0) / max(f1 - f0, 1e-9)
    bwd_rate = 10 * (w1 - w0) / max(b1 - b0, 1e-9)
    barrier = _timed(sync, 5)  # inside each timing above (slowest=True), not a call's cost
    overhead = max(f0 - barrier - 4 * w0 / fwd_rate, 0.0)
    return fwd_rate, bwd_rate, overhead


def _probe_collectives(group, device, sync) -> dict:
    """{name: (seconds per byte, seconds per call)} of the collectives the all-gather and Ulysses
    strategies call, each timed at two sizes; bytes = what ideally leaves one rank."""
    import torch.distributed as dist

    from cpattn import comm

    world = dist.get_world_size(group)
    probes = {
        "all_gather": lambda x: comm.all_gather_flat(
            x.new_empty(world * x.numel()), x, group=group),
        "reduce_scatter": lambda x: comm.reduce_scatter_flat(
            x.new_empty(x.numel() // world), x, group=group),
        # through the helper Ulysses uses: its chunk / concatenate copies count
        "all_to_all": lambda x: comm.all_to_all(x.view(world, -1), 0, 1, group),
    }
    result = {}
    for name, call in probes.items():
        points = []
        for per_rank in (16 << 10, 1 << 20):  # floats per rank's part
            x = torch.randn(world * per_rank, device=device)
            if name == "all_gather":
                x = x[:per_rank].clone()
            points.append(((world - 1) * per_rank * 4, _timed(lambda: call(x), 3, sync)))
        (n0, t0), (n1, t1) = points
        per_byte = max(t1 - t0, 1e-9) / (n1 - n0)
        result[name] = (per_byte, max(t0 - n0 * per_byte, 1e-7))
    return result


def calibrate(group=None, *, dtypes: Sequence[str] = (), refresh: bool = False,
              memory: Optional[float] = None) -> Machine:
    """Measures this group (a few seconds, every rank at once, so shared cores count) and caches
    the result to ~/.cache/cpattn (or $CPATTN_PLAN_CACHE). Collective: every rank of `group`
    must call it; all get the same Machine (rank 0's cache or the max over ranks of the probes).

    dtypes: those to probe (default: float32 on CPU, bfloat16 and float16 on CUDA).
    """
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    world, me = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else \
        torch.device("cpu")
    if not dtypes:
        dtypes = ("float32",) if device.type == "cpu" else ("bfloat16", "float16")
    import socket

    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    ranks_per_node = max(hosts.count(h) for h in hosts)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key_text = json.dumps([backend, world, ranks_per_node, name, torch.__version__,
                           torch.get_num_threads(), sorted(dtypes)])
    import hashlib

    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    box = [None]
    if me == 0 and not refresh and os.path.exists(_cache_path(key)):
        with open(_cache_path(key)) as f:
            box[0] = f.read()
    src = dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is not None:
        return Machine.from_json(box[0])

    block = (64, 128) if device.type == "cpu" else (128, 128)
    sync = functools.partial(dist.barrier, group=group)
    fwd, bwd, overhead = {}, {}, 0.0
    for dt in dtypes:
        f, b, o = _probe_kernel(device, getattr(torch, dt), block, sync)
        fwd[dt], bwd[dt], overhead = f, b, max(overhead, o)
    # elementwise bandwidth: a 32 MiB copy
    src_t = torch.randn(8 << 20, device=device)
    dst_t = torch.empty_like(src_t)
    mem_bw = 2 * src_t.numel() * 4 / _timed(lambda: dst_t.copy_(src_t), 3, sync, slowest=True)
    # the ring link: one shift of two sizes
    if world > 1:
        small = torch.zeros(1024, device=device)
        big = torch.zeros(2 << 20, device=device)
        ring_shift = torch.ops.cpattn_testing.ring_shift
        shift = lambda t: ring_shift(t, group.group_name, 60.0)  # noqa: E731
        t_small, t_big = _timed(lambda: shift(small), 5), _timed(lambda: shift(big), 3)
        bw = (big.numel() - small.numel()) * 4 / max(t_big - t_small, 1e-9)
        lat = max(t_small - small.numel() * 4 / bw, 1e-7)
        collectives = _probe_collectives(group, device, sync)
    else:
        bw, lat, collectives = 1e12, 1e-6, {}
    names = sorted(collectives)
    # every rank gets the mean over ranks of the seconds per unit (one rank's noise is diluted)
    mine = torch.tensor([1 / fwd[d] for d in dtypes] + [1 / bwd[d] for d in dtypes] +
                        [overhead, 1 / mem_bw, 1 / bw, lat] +
                        [x for name in names for x in collectives[name]], dtype=torch.float64)
    mine = mine.to(device)
    dist.all_reduce(mine, group=group)
    v = (mine / world).cpu().tolist()
    n = len(dtypes)
    link = Link(1 / v[2 * n + 2], v[2 * n + 3])
    measured = {name: Link(1 / v[2 * n + 4 + 2 * i], v[2 * n + 5 + 2 * i])
                for i, name in enumerate(names)}
    if memory is None:
        memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world)
    m = Machine(
        name=f"calibrated-{name}-W{world}", source=f"measured by cpattn.plan.calibrate on "
        f"{time.strftime('%Y-%m-%d %H:%M')} ({backend}, {world} ranks, {ranks_per_node} per node)",
        ranks_per_node=ranks_per_node, intra=link, inter=link,
        fwd_flops={d: 1 / v[i] for i, d in enumerate(dtypes)},
        bwd_flops={d: 1 / v[n + i] for i, d in enumerate(dtypes)},
        call_overhead=v[2 * n], mem_bandwidth=1 / v[2 * n + 1], memory=float(memory),
        # CPU ranks: gloo's TCP transfers take CPU time from the cores that compute
        overlap=0.5 if device.type == "cpu" else 1.0, block=block,
        reduce_scatter_factor=2.0 if backend == "gloo" else 1.0, collectives=measured)
    if me == 0:
        path = _cache_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(m.to_json())
    return m


# ---- strategy="auto" -------------------------------------------------------------------------

_MACHINES: dict = {}
_DECISIONS: dict = {}


def set_machine(m: Optional[Machine], group=None) -> None:
    """The machine strategy="auto" plans with for `group` (None: forget it, calibrate again)."""
    key = _group_key(group)
    if m is None:
        _MACHINES.pop(key, None)
    else:
        _MACHINES[key] = m
    for k in [k for k in _DECISIONS if k[0] == key]:
        del _DECISIONS[k]


def _group_key(group):
    import torch.distributed as dist

    group = group if group is not None else dist.group.WORLD
    return group.group_name


def machine_for(group=None) -> Machine:
    """The machine for `group`: set_machine's, else $CPATTN_PLAN_MACHINE (a preset name or a
    calibration file), else calibrate(group) (collective, cached). The same on every rank."""
    key = _group_key(group)
    if key not in _MACHINES:
        env = os.environ.get("CPATTN_PLAN_MACHINE")
        _MACHINES[key] = machine(env) if env else calibrate(group)
    return _MACHINES[key]


def choose(p: Problem, world: int, cands: Sequence[Candidate], group=None,
           what: str = "cpattn") -> Prediction:
    """The fastest of `cands` for problem p on the ranks of `group`, decided once per distinct
    (group, problem, candidate set) and logged at debug level. Every input must be agreed by all
    ranks (shapes and options validated, machine identical), so the choice is too."""
    key = (_group_key(group), p, tuple(cands))
    if key not in _DECISIONS:
        m = machine_for(group)
        ranked, why = plan(p, m, world, cands)
        _DECISIONS[key] = ranked[0]
        log.debug("%s strategy='auto' on %d ranks (%s): %s", what, world, m.name, why)
    return _DECISIONS[key]
