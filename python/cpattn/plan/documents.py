"""The time of attention over packed documents sharded by a cpattn.DocumentPlan, and the
ranking of candidate plans (cpattn.shard_documents picks the first)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from cpattn.plan.model import COST_MODELS, Candidate, Machine, Prediction, Problem
from cpattn.plan.predict import predict
from cpattn.plan.work import schedule_work


def _whole_documents_time(lengths, p: Problem, m: Machine) -> float:
    """Kernel seconds of documents held whole by one rank: one varlen call over all of them."""
    if not lengths:
        return 0.0
    seconds = m.call_overhead
    for backward in (False, True) if p.mode == "train" else (False,):
        per_pair = (10 if backward else 4) * p.head_dim * p.batch * p.heads
        for n in lengths:
            tiles = schedule_work(n, 1, "contiguous", p.causal, tuple(p.window), tuple(m.block),
                                  None)[0, 0, 1].item()
            seconds += tiles * per_pair / m.flops(p.dtype, backward)
    return seconds


def predict_documents(plan_, p: Problem, m: Machine) -> Prediction:
    """The time of attention over a cpattn.DocumentPlan: the documents split over every rank by
    the fastest of the strategies that run document plans (as strategy="auto" picks), then on
    each rank its shards of the documents split over a subset (an all-to-all among their ranks, not
    overlapped, and the gathered kernels) and its whole documents (no communication); p gives
    the shapes (its documents are ignored). bytes_sent: the busiest sender's."""
    world, layout = plan_.world, plan_.layout
    link = m.link(world)
    kv_token = 2 * p.batch * p.kv_heads * p.head_dim  # K and V elements of one token
    rest, rest_sent = [], []
    for r in range(world):
        t = _whole_documents_time(plan_.whole_lengths(r), p, m)
        pieces = plan_.subset_pieces(r)
        sent = 0.0
        for d, members, _, _, n in pieces:
            t += _whole_documents_time((plan_.lengths[d],), p, m) / len(members)
            sent += (len(members) - 1) * n * kv_token * p.elem
            if p.mode == "train":  # the fp32 dK/dV of the others' shards go back
                sent += (len(members) - 1) * n * kv_token * 4
        if pieces or plan_.subset_tokens != (0,) * world:  # every rank joins the all-to-all
            t += link.time(sent, 2 if p.mode == "train" else 1)
        rest.append(t)
        rest_sent.append(sent)
    extra, extra_sent = max(rest), max(rest_sent)
    if not plan_.full_split:  # no strategy runs: the subsets' code at most
        subsets = next(m.name for m in COST_MODELS.values() if m.runs_document_subsets)
        return Prediction(Candidate(subsets if plan_.split else "none", layout if plan_.split
                                    else ""), extra, extra, 0.0, extra_sent, 0.0,
                          detail={"plan": plan_})
    split = dataclasses.replace(p, documents=tuple(plan_.lengths[d] for d in plan_.full_split))
    cands = [c for model in COST_MODELS.values() if model.runs_document_plans
             for c in model.candidates(split, world, (layout,))]
    best = min(predict(split, m, world, cands), key=lambda r: r.time)
    return Prediction(best.candidate, best.time + extra, best.compute + extra,
                      best.exposed_comm, best.bytes_sent + extra_sent, best.peak_memory,
                      detail={"plan": plan_})


def plan_documents(plans, machine: Machine, *, heads: int = 32, kv_heads: int = 8,
                   head_dim: int = 128, dtype: Optional[str] = None, training: bool = True
                   ) -> list:
    """Ranks document plans (cpattn.shard_documents' candidates, {split: DocumentPlan}) by
    predicted time per call on `machine`: [(plan, Prediction)], fastest first (ties: fewer
    bytes sent, then the order given). dtype: default bfloat16, or the first the machine was
    measured in (a calibration has only the dtypes it ran)."""
    if dtype is None:
        dtype = "bfloat16" if "bfloat16" in machine.fwd_flops else next(iter(machine.fwd_flops))
    any_plan = next(iter(plans.values()))
    p = Problem(seqlen=sum(any_plan.lengths), heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                dtype=dtype, causal=any_plan.causal, window=any_plan.window,
                mode="train" if training else "forward")
    unique = list(dict.fromkeys(plans.values()))  # equal plans (e.g. nothing to split) once
    scored = [(d, predict_documents(d, p, machine)) for d in unique]
    return sorted(scored, key=lambda dp: (dp[1].time, dp[1].bytes_sent))
