"""The time model and the ranking: for a problem and a machine, every candidate's time per call,
bytes sent per rank and peak memory per rank, fastest first, the first explained in one line:

    none                    one rank computes everything, no communication
    ring/<layout>           K/V shards travel the ring, each step overlapped with the compute of
                            the shard held; backward sends fp32 dK/dV one step behind, plus a
                            final exposed hop (csrc/ops/ring.cpp)
    allgather/<layout>      K/V all-gathered a chunk of KV heads at a time, not overlapped;
                            backward gathers again and reduce-scatters fp32 dK/dV
    ulysses                 all-to-alls of q, k, v (GQA-replicated as Ulysses does), out and
                            their gradients around one local kernel on the whole sequence
    hybrid UxR              Ulysses within U consecutive ranks, ring across R, for every U*R = W

Times are max over ranks per ring step (the ring is synchronous).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Optional, Sequence

from cpattn.core.flops import attention_flops
from cpattn.plan.memory import (
    input_bytes,
    memory,
    memory_allgather,
    memory_none,
    memory_ring,
    memory_ulysses,
)
from cpattn.plan.model import (
    COST_MODELS,
    Candidate,
    CostModel,
    Link,
    Machine,
    Prediction,
    Problem,
    register_cost_model,
)
from cpattn.plan.work import (
    allgather_chunk,
    compute_steps,
    divisible,
    kv_heads_sent,
    tokens_per_rank,
)


def _combine(compute: float, comm: float, overlap: float) -> float:
    """A step whose transfer runs during its compute: the longer of the two, plus the part of
    the shorter one that does not overlap."""
    return max(compute, comm) + (1.0 - overlap) * min(compute, comm)


def _ring(p: Problem, m: Machine, world: int, layout: str, heads: int, kv_heads: int,
          link: Link, seqlen: Optional[int] = None) -> dict:
    """Time and traffic of the ring driver (csrc/ops/ring.cpp) over `world` ranks."""
    local = tokens_per_rank(p, world, layout) if seqlen is None else seqlen // world
    e = p.elem
    kv = 2 * p.batch * local * kv_heads * p.head_dim * e
    acc = 2 * p.batch * local * kv_heads * p.head_dim * 4
    state = p.batch * local * heads * p.head_dim * 4  # fp32 out / dq of the local queries
    fwd = compute_steps(p, m, world, layout, heads, seqlen).amax(0).tolist()
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
    bwd = compute_steps(p, m, world, layout, heads, seqlen, backward=True).amax(0).tolist()
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


def _agreement(m: Machine, world: int) -> float:
    """The rank-agreement check every call starts with: one small all-gather."""
    return _all_gather_time(m.link(world), 256, world)


def _predict_one(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    model = COST_MODELS.get(c.strategy)
    if model is None:
        raise ValueError(f"cpattn.plan: unknown strategy {c.strategy!r}")
    pred = model.time(p, m, world, c)
    if world > 1 and model.checks is not None:
        check = sum(_agreement(m, span) for span in model.checks(c, world))
        pred.time += check
        pred.exposed_comm += check
    return pred


def _time_none(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    """One rank computes everything, no communication."""
    H, Hkv = p.heads, p.kv_heads
    r = _ring(p, m, 1, "contiguous", H, Hkv, m.intra)
    time_ = r["fwd"] + r.get("bwd", 0.0)
    peak = input_bytes(p, 1) + memory(p, "none", 1)["peak"]
    return Prediction(c, time_, r["compute"], 0.0, 0.0, peak)


def _time_ring(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    """The ring, in passes of c.chunk KV heads (ring_chunk), each a ring."""
    H, Hkv = p.heads, p.kv_heads
    link = m.link(world)
    peak = input_bytes(p, world) + memory(p, c.strategy, world, c.layout, c.chunk)["peak"]
    passes = math.ceil(Hkv / c.chunk) if 0 < c.chunk < Hkv else 1
    r = _ring(p, m, world, c.layout, H // Hkv * min(c.chunk or Hkv, Hkv),
              min(c.chunk or Hkv, Hkv), link)
    time_ = passes * (r["fwd"] + r.get("bwd", 0.0))
    return Prediction(c, time_, passes * r["compute"], passes * r["exposed"],
                      passes * r["sent"], peak)


def _time_allgather(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    """K/V all-gathered c.chunk KV heads at a time, not overlapped; the backward gathers again
    and reduce-scatters fp32 dK/dV."""
    H, Hkv = p.heads, p.kv_heads
    train = p.mode == "train"
    link = m.link(world)
    peak = input_bytes(p, world) + memory(p, c.strategy, world, c.layout, c.chunk)["peak"]
    r = _ring(p, m, world, c.layout, H, Hkv, link)
    chunks = math.ceil(Hkv / c.chunk)
    fwd_c = compute_steps(p, m, world, c.layout, H).sum(1).amax().item()
    kv_chunk = r["kv"] / Hkv * c.chunk
    gather = chunks * _collective_time(m, "all_gather", link, (world - 1) * kv_chunk, world)
    copies = world * r["kv"] / m.mem_bandwidth
    compute = fwd_c + world * r["state"] * 3 / m.mem_bandwidth
    time_, exposed, sent = compute + gather + copies, gather, (world - 1) * r["kv"]
    if train:
        bwd_c = compute_steps(p, m, world, c.layout, H, backward=True).sum(1).amax().item()
        acc_chunk = r["acc"] / Hkv * c.chunk
        rs = chunks * _collective_time(m, "reduce_scatter", link, (world - 1) * acc_chunk,
                                       world, m.reduce_scatter_factor)
        exposed += gather + rs
        compute += bwd_c
        time_ += bwd_c + gather + rs + copies + 2 * world * r["acc"] / m.mem_bandwidth
        sent += (world - 1) * (r["kv"] + r["acc"] * m.reduce_scatter_factor)
    return Prediction(c, time_, compute, exposed, sent, peak)


def _time_across_heads(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    """Ulysses (c.ring 1) and the hybrid: the all-to-alls over c.ulysses ranks around the local
    kernel, or around the ring over c.ring ranks."""
    e, B, D, H, Hkv = p.elem, p.batch, p.head_dim, p.heads, p.kv_heads
    train = p.mode == "train"
    full_q = B * p.seqlen * H * D * e
    u, rr = c.ulysses, c.ring
    kv_sent = kv_heads_sent(H, Hkv, u)
    q_rank = full_q / world  # this rank's q shard (also out, dout, dq)
    kv_rank = 2 * B * (p.seqlen // world) * kv_sent * D * e
    a2a = lambda total: _all_to_all_time(m, total, u, u)  # noqa: E731
    comm = 2 * a2a(q_rank) + a2a(kv_rank)  # q and out, k and v
    sent = (u - 1) / u * (2 * q_rank + kv_rank)
    if rr == 1:
        steps = compute_steps(p, m, 1, "contiguous", H // u)
        compute = steps.sum().item() + 3 * B * p.seqlen * H // u * D * 4 / m.mem_bandwidth
        if train:
            compute += compute_steps(p, m, 1, "contiguous", H // u, backward=True).sum().item()
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
        peak = input_bytes(p, world) + memory_ulysses(p, u)["peak"]
    else:  # the Ulysses all-to-alls over U, then the ring over R on q, k, v by heads
        by_heads = dataclasses.replace(p, heads=H // u, kv_heads=max(1, kv_sent // u))
        ring = memory_ring(by_heads, rr, c.layout)["peak"]
        held = (q_rank + kv_rank) * (2 if train else 1) + q_rank  # + out by sequence
        peak = input_bytes(p, world) + held + ring
    return Prediction(c, time_, compute, comm + ring_exposed, sent + ring_sent, peak)


def _time_sharded_cache(p: Problem, m: Machine, world: int, c: Candidate) -> Prediction:
    """Decode: each rank reads its 1/W of the cache; W partial (out, lse) are all-gathered."""
    B, D, H = p.batch, p.head_dim, p.heads
    full_kv = 2 * B * p.seqlen * p.kv_heads * D * p.elem
    sq = p.decode_tokens
    reads = full_kv / world
    flops = attention_flops(B, H, sq, p.seqlen / world, D) / m.flops(p.dtype, False)
    compute = max(flops, reads / m.mem_bandwidth) + m.call_overhead
    part = B * sq * H * (D + 1) * 4
    comm = _all_gather_time(m.link(world), part, world)
    return Prediction(c, compute + comm, compute, comm, (world - 1) * part,
                      reads + world * part)


def _one_check(c: Candidate, world: int) -> tuple:
    return (world,)


def _none_candidates(p: Problem, world: int, layouts: Sequence[str]) -> list:
    return [Candidate("none")]


def _per_layout_candidates(name: str, chunk: Callable[[Problem, int], int]) -> Callable:
    """The ring's and the all-gather's candidates: one per layout the problem divides into."""
    def offered(p: Problem, world: int, layouts: Sequence[str]) -> list:
        if p.mode == "decode" or world == 1:
            return []
        return [Candidate(name, layout, chunk=chunk(p, world)) for layout in layouts
                if divisible(p, world, layout)]
    return offered


def _across_heads_candidates(hybrid: bool) -> Callable:
    """Ulysses (U = W) or the hybrid (U x R = W, R > 1): one sequence, heads divisible by U."""
    def offered(p: Problem, world: int, layouts: Sequence[str]) -> list:
        if p.mode == "decode" or world == 1 or p.documents is not None:
            return []
        out = []
        for u in range(2, world + 1):
            r = world // u
            if world % u or p.heads % u or (r > 1) != hybrid:
                continue
            # hybrid_positions: the ring shards (zigzag over R) split into U contiguous parts
            ok = p.seqlen % u == 0 if r == 1 else (p.seqlen % (2 * r) == 0
                                                     and (p.seqlen // r) % u == 0)
            if ok:
                out.append(Candidate("hybrid" if hybrid else "ulysses",
                                     "zigzag" if hybrid else "contiguous", u, r))
        return out
    return offered


def _sharded_cache_candidates(p: Problem, world: int, layouts: Sequence[str]) -> list:
    return [Candidate("sharded-cache")] if p.mode == "decode" and world > 1 else []


def _ring_in_passes(p: Problem, c: Candidate) -> list:
    """A one-pass ring in passes of Hkv / 2, Hkv / 4, ..., 1 KV heads."""
    if c.chunk:
        return []
    chunks = sorted({max(1, p.kv_heads >> i) for i in range(1, p.kv_heads.bit_length())},
                    reverse=True)
    return [dataclasses.replace(c, chunk=n) for n in chunks if n < p.kv_heads]


def _ring_label(c: Candidate) -> str:
    return f"ring/{c.layout}/{c.chunk}kv" if c.chunk else f"ring/{c.layout}"


# The built-in cost models, in the order candidates are listed: no context parallelism, the
# strategies of cpattn.strategies.registry (each Strategy finds its model here by name), decode.
register_cost_model(CostModel("none", _time_none, _none_candidates,
                              memory=memory_none))
register_cost_model(CostModel("ring", _time_ring, _per_layout_candidates("ring", lambda p, w: 0),
                              _ring_label, memory_ring, _one_check, runs_document_plans=True,
                              in_passes=_ring_in_passes))
register_cost_model(CostModel(
    "allgather", _time_allgather,
    _per_layout_candidates("allgather", lambda p, w: allgather_chunk(p.kv_heads, w)),
    lambda c: f"allgather/{c.layout}", memory_allgather, _one_check, runs_document_plans=True,
    runs_document_subsets=True))  # (strategies/allgather.py's SubsetGathered)
register_cost_model(CostModel("ulysses", _time_across_heads, _across_heads_candidates(False),
                              memory=memory_ulysses, checks=_one_check))
# (the hybrid's time model counts its memory; its checks: over Ulysses, then the ring's across)
register_cost_model(CostModel("hybrid", _time_across_heads, _across_heads_candidates(True),
                              lambda c: f"hybrid {c.ulysses}x{c.ring}/{c.layout}",
                              checks=lambda c, world: (c.ulysses, world)))
register_cost_model(CostModel("sharded-cache", _time_sharded_cache, _sharded_cache_candidates))


def candidates(p: Problem, world: int, layouts: Sequence[str] = ("zigzag", "contiguous",
                                                                  "striped")) -> list:
    """Every way to run the problem on `world` ranks: each cost model's candidates, in
    COST_MODELS order."""
    return [c for model in COST_MODELS.values() for c in model.candidates(p, world, layouts)]


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
    """The candidates of `cands` in passes of fewer KV heads, where their cost model runs so."""
    return [c2 for c in cands if (model := COST_MODELS[c.strategy]).in_passes is not None
            for c2 in model.in_passes(p, c)]


def table(ranked: Sequence[Prediction]) -> str:
    """The ranked predictions as a markdown table."""
    lines = ["| # | strategy | time (ms) | compute (ms) | exposed comm (ms) | MiB sent per rank "
             "| peak MiB per rank | fits |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(ranked, 1):
        lines.append(f"| {i} | {r.name} | {r.time * 1e3:.4g} | {r.compute * 1e3:.4g} | "
                     f"{r.exposed_comm * 1e3:.3g} | {r.bytes_sent / 2**20:.4g} | "
                     f"{r.peak_memory / 2**20:.5g} | {'yes' if r.fits else 'no'} |")
    return "\n".join(lines)
