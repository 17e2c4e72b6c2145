"""The bytes a call allocates per rank: THE model of cpattn's memory (bench/RESULTS.md, "Memory
per rank"; tests/test_memory.py checks it against cpattn.memory.counting()).

It follows the code step by step: each phase is the sum of the tensors alive in it, and a call's
peak is the largest phase. Counted: every at::Tensor a call allocates on top of its inputs (q, k,
v and, for the backward, the gradient of out): outputs, fp32 state, saved tensors, the ring's
buffers, packing copies, conversions. Not counted: the CPU kernels' own buffers (malloc'd: the
"scratch" of the result, the backward's chunk buffers and, unless summed in place, fp32 dK / dV
sums, _kernel_bwd_scratch, as the kernel sizes them) and Python objects. CUDA kernels pack
nothing (their transients are the sub-problem outputs only), so this is an upper bound there.

The CPU backward's grouping of KV heads and its chunk sizes are what the kernel itself decides
(torch.ops.cpattn.cpu_backward_sizes), under the byte budget the process runs with.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Optional

import torch

from cpattn._C import cpu_gemm, cpu_isa, cpu_isa_paths
from cpattn.plan.model import COST_MODELS, DTYPE_BYTES, Problem
from cpattn.plan.work import allgather_chunk, kv_heads_sent, tokens_per_rank


@functools.lru_cache(maxsize=2)
def _brgemm(bf16: bool) -> bool:
    """Whether the CPU kernels take the brgemm path for these operands (bf16 through bf16 dot
    products, else fp32), which packs V transposed in panels and no key pairs of K."""
    return cpu_gemm("bfloat16" if bf16 else "float32").startswith("brgemm")


def _value_rows(n: int, bf16: bool) -> int:
    """Rows of V (of Dp values) as the forward kernel packs n keys (csrc/ops/attention_cpu.cpp):
    n as they are (fp32 micro-kernels), key pairs (bf16 micro-kernels: n rounded up to even), or
    transposed in panels of 128 keys (brgemm path)."""
    if _brgemm(bf16):
        return -(-n // 128) * 128
    return 2 * -(-n // 2) if bf16 else n


def _kernel_fwd(B: int, n: int, h: int, hkv: int, D: int, e: int, bf16: bool) -> int:
    """Bytes alive inside one local forward kernel call (cpattn.attention_fwd on CPU) over n query
    rows and n keys, fp32 output: the output and LSE, and the operand packing (csrc/ops/
    attention_cpu.cpp pack / pair_keys / value_panels): bf16 on a CPU with bf16 dot products keeps
    Q in place and packs K and V (_value_rows); otherwise Q, K and V are packed to fp32."""
    dp = -(-D // 16) * 16
    state = 4 * B * n * h * D + 4 * B * h * n
    if bf16:
        return state + 2 * B * hkv * dp * (n + _value_rows(n, True))
    return state + 4 * B * dp * (h * n + hkv * n + hkv * _value_rows(n, False))


def backward_sizes(B: int, n: int, h: int, hkv: int, D: int, dtype: str, grad: str) -> tuple:
    """(KV heads per call, key splits, query rows per chunk) of the CPU backward kernel over n
    query rows and n keys of contiguous inputs in `dtype` with gradients in `grad`, as the
    kernel decides them (csrc/ops/attention_cpu.cpp groups, csrc/cpu/attention_kernel.h
    key_splits / band_rows for a group's heads)."""
    sizes = torch.ops.cpattn.cpu_backward_sizes(B, n, n, h, hkv, D, getattr(torch, dtype),
                                                getattr(torch, grad))
    return tuple(sizes)


def _kernel_bwd(B: int, n: int, h: int, hkv: int, D: int, dtype: str, grad: str, bf16: bool,
                new: str = "qkv") -> int:
    """Bytes alive inside one local backward kernel call over n query rows and n keys of inputs
    in `dtype` whose gradients are in dtype `grad`: delta, the LSE rows, the gradients it
    allocates (`new`: "qkv" all three; "kv" dk and dv only, dq added into an accumulator; ""
    none: the ring's sub-problems, csrc/ops/ring.cpp backward_step), and one group of KV heads'
    (backward_sizes) packing (bf16: K's key pairs on the micro-kernel path, and K and V unless
    D is a multiple of 16;
    fp32 with D a multiple of 16: none, Q, K, V and dO are read in place; otherwise Q, K, V and
    dO in fp32) and, with batch > 1, its LSE and delta rows."""
    dp = -(-D // 16) * 16
    e, g = DTYPE_BYTES[dtype], DTYPE_BYTES[grad]
    rows = 4 * B * h * n * 2 + g * B * n * D * (h * ("q" in new) + 2 * hkv * ("kv" in new))
    if B > 1:  # the rows of dout and out, not contiguous with batch > 1, are copied for delta
        rows += 2 * e * B * n * h * D
    c = backward_sizes(B, n, h, hkv, D, dtype, grad)[0]
    hc = h // hkv * c
    if B > 1 and c < hkv:
        rows += 4 * B * hc * n * 2
    if bf16:
        pairs = 0 if _brgemm(True) else 2 * -(-n // 2)
        return rows + 2 * B * c * dp * ((2 * n if dp != D else 0) + pairs)
    if e == 4 and dp == D:
        return rows
    return rows + 4 * B * dp * (2 * hc * n + 2 * c * n)


def _kernel_bwd_scratch(B: int, n: int, h: int, hkv: int, D: int, dtype: str, grad: str) -> int:
    """The backward kernel's own buffers (malloc'd, not tensors), all threads together, for n
    query rows and n keys of inputs in `dtype` whose gradients are written in dtype `grad`, in
    one call of a group of KV heads (backward_sizes), as the kernel sizes them
    (torch.ops.cpattn.cpu_backward_buffer_bytes; csrc/cpu/attention_kernel.h
    backward_buffer_bytes): one chunk of query rows of every head packed, the chunk's fp32 dQ per
    split of the key blocks, and the dK and dV sums beyond the gradients. Per-thread blocks of
    about 0.2-0.3 MiB are not counted."""
    return torch.ops.cpattn.cpu_backward_buffer_bytes(B, n, n, h, hkv, D, getattr(torch, dtype),
                                                      getattr(torch, grad))


@functools.lru_cache(maxsize=1)
def bf16_dot() -> bool:
    """Whether this CPU's kernel takes bf16 through bf16 dot products (its packing differs)."""
    # the running instruction set's row (cpattn.build_info()["cpu_isa_paths"]) says how
    return dict(cpu_isa_paths())[cpu_isa()] == "bfloat16"


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
    model = COST_MODELS.get(strategy)
    if model is None or model.memory is None:
        raise ValueError(f"cpattn.plan.memory: no memory model for strategy {strategy!r}")
    return model.memory(p, world, layout, chunk, gloo)


class _Rank(NamedTuple):
    """What every memory model starts from: the problem's sizes on one of W ranks holding L
    tokens each; Q, K: elements of this rank's q and of its k (or v)."""

    B: int
    H: int
    Hkv: int
    D: int
    e: int
    train: bool
    W: int
    L: int
    Q: int
    K: int
    lse: int
    bf: bool  # bf16 through bf16 dot products (the kernels' packing differs)
    cast: bool  # fp32 state converted to the input dtype at the end
    # bf16: dQ's fp32 sums kept split, high halves in the bf16 result and low halves beside,
    # rounded in place (csrc/ops/ring.cpp DqSums): no bf16 copy of an fp32 dQ
    split_dq: bool


def _rank(p: Problem, world: int, L: int) -> _Rank:
    B, H, Hkv, D, e = p.batch, p.heads, p.kv_heads, p.head_dim, p.elem
    return _Rank(B, H, Hkv, D, e, p.mode == "train", world, L, B * L * H * D, B * L * Hkv * D,
                 4 * B * H * L, p.dtype == "bfloat16" and bf16_dot(), e != 4,
                 p.dtype == "bfloat16")


def memory_none(p: Problem, world: int, layout: str = "zigzag", chunk: Optional[int] = None,
                gloo: bool = False) -> dict:
    """cpattn.attention on the whole sequence (one rank: no all-to-all)."""
    return _memory_local({}, p.batch, p.seqlen, p.heads, p.kv_heads, p.head_dim, p.elem,
                         p.mode == "train", p.dtype == "bfloat16" and bf16_dot(), p.dtype)


def memory_ring(p: Problem, world: int, layout: str = "zigzag", chunk: Optional[int] = None,
                gloo: bool = False) -> dict:
    """The ring (csrc/ops/ring.cpp); with chunk < kv heads in passes (_memory_ring_passes)."""
    if chunk and chunk < p.kv_heads:
        return _memory_ring_passes(p, world, layout, chunk)
    B, H, Hkv, D, e, train, W, L, Q, K, lse, bf, cast, split_dq = _rank(
        p, world, tokens_per_rank(p, world, layout))
    ph: dict = {}
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
        ph["bwd: kernel step"] = base + _kernel_bwd(B, n, H, Hkv, D, p.dtype, "float32", bf,
                                                    "kv" if W > 1 else "")
        # the gradients: cast from the fp32 dq and accumulators (split dq: rounded in place,
        # its low halves freed first); in fp32, dq itself and the last hop's (or at W = 1 a
        # copy's) new dk, dv
        grads = ((0 if split_dq else Q) + 2 * K) * e if cast else 2 * K * 4
        ph["bwd: gradients"] = base - split_dq * 2 * Q + grads
        kept = recv + acc + (Q + 2 * K) * e  # the graph freed: gradients and cached buffers
    scratch = train and _kernel_bwd_scratch(B, n, H, Hkv, D, p.dtype, "float32")
    return _result(ph, kept, scratch)


def memory_allgather(p: Problem, world: int, layout: str = "zigzag", chunk: Optional[int] = None,
                      gloo: bool = False) -> dict:
    """The all-gather of K/V, chunk KV heads at a time (strategies/allgather.py)."""
    B, H, Hkv, D, e, train, W, L, Q, K, lse, bf, cast, split_dq = _rank(
        p, world, tokens_per_rank(p, world, layout))
    ph: dict = {}
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
                                  + _kernel_bwd(B, n, hq, c, D, p.dtype, "float32", bf, ""))
        ph["bwd: cast dq"] = (base + W * sc + dout_c + 4 * Qc + dkv_all
                              + (cast and not split_dq) * Qc * e)
        dq_c = Qc * (e if cast else 4)
        ph["bwd: reduce-scatter"] = base + dq_c + (1 + bool(gloo)) * dkv_all + 2 * Kc * 4
        late = max(late, bool(gloo) * dkv_all)
        ph["bwd: cast dk dv"] = base + dq_c + 2 * Kc * 4 + one * 2 * Kc * e
        kept = (Q + 2 * K) * e
    scratch = train and _kernel_bwd_scratch(B, n, hq, c, D, p.dtype, "float32")
    return _result(ph, kept, scratch, late)


def memory_ulysses(p: Problem, world: int, layout: str = "zigzag", chunk: Optional[int] = None,
                    gloo: bool = False) -> dict:
    """Ulysses' all-to-alls around the local kernel (strategies/ulysses.py)."""
    if world == 1:  # one rank: no all-to-all
        return memory_none(p, world, layout, chunk, gloo)
    B, H, Hkv, D, e, train, W, L, Q, K, lse, bf, cast, split_dq = _rank(
        p, world, p.seqlen // world)
    ph: dict = {}
    hs = kv_heads_sent(H, Hkv, W)  # KV heads each rank sends (GQA: replicated)
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
                             + _kernel_bwd(B, S, h, hk, D, p.dtype, p.dtype, bf, "kv"))
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
    scratch = train and _kernel_bwd_scratch(B, S, h, hk, D, p.dtype, p.dtype)
    return _result(ph, kept, scratch, late)


def _memory_ring_passes(p: Problem, world: int, layout: str, chunk: int) -> dict:
    """The ring in passes of `chunk` KV heads (ring_attention(ring_chunk=...)): each pass is the
    ring of its heads (its phases), around it the whole results written pass by pass, the pass's
    k, v heads made contiguous for the ring and, in the backward, its dout heads."""
    q_heads = p.heads // p.kv_heads * chunk
    one = memory_ring(dataclasses.replace(p, heads=q_heads, kv_heads=chunk), world, layout)
    L, e = tokens_per_rank(p, world, layout), p.elem
    Q, K = p.batch * L * p.heads * p.head_dim, p.batch * L * p.kv_heads * p.head_dim
    Qc, Kc = Q // p.heads * q_heads, K // p.kv_heads * chunk
    lse, lse_c = 4 * p.batch * p.heads * L, 4 * p.batch * q_heads * L
    # The pass's own out and LSE (saved, in its phases) are views of the whole ones here.
    fwd = Q * e + lse + 2 * Kc * e
    bwd = (Q - Qc) * e + lse - lse_c + (Q + 2 * K) * e + Qc * e + 2 * Kc * e
    ph = {name: b + (bwd if name.startswith("bwd") else fwd) for name, b in one["phases"].items()}
    grads = (Q + 2 * K - Qc - 2 * Kc) * e if p.mode == "train" else (Q - Qc) * e
    return _result(ph, one["kept"] + grads, one["scratch"])


def input_bytes(p: Problem, world: int) -> int:
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
        ph["bwd: kernel"] = kept + lse + _kernel_bwd(B, S, H, Hkv, D, dtype, dtype, bf)
        kept = (Q + 2 * K) * e
    return _result(ph, kept, train and _kernel_bwd_scratch(B, S, H, Hkv, D, dtype, dtype))


def _result(phases: dict, kept: int, scratch: int, gloo_late: int = 0) -> dict:
    return {"peak": max(phases.values()), "kept": kept, "phases": phases,
            "scratch": int(scratch), "gloo_late": gloo_late}
