"""Invariant mode (invariant=True): out, lse and every gradient bitwise independent of the number of
ranks, the layout and the strategy. Each rank computes exactly what one process computes for its
own query rows (out, lse, dQ) and its own keys (dK, dV), in kernel calls whose sums run in an
order fixed by global positions (csrc/ops/invariant.cpp, csrc/include/cpattn/invariant.h). The
forward gathers every rank's K and V of a head group at a time (as the all-gather strategy). The
backward streams every rank's dout, q, K and V a part at a time in global order (with every
rank's lse and dlse - rowsum(dout * out), gathered) and adds this rank's rows against each part's
keys (dQ) and each part's rows against this rank's keys (dK, dV) to fp32 running sums, so that
its memory per rank does not grow with W. Striped shards are moved to the contiguous layout
first. cpattn.attention(invariant=True) is the same computation over one
rank: the reference. docs/invariance.md. The operands in global order: global_order.py."""

from typing import Optional

import torch
import torch.distributed as dist

from cpattn.core.autograd import (
    backward_in_passes,
    forward_in_passes,
    input_grads,
    once_differentiable,
)
from cpattn.core.layout import LAYOUTS, PackedDocuments, doc_args
from cpattn.invariant.global_order import Relayout, gather_global, global_runs, stream_global


def computed_once(layout_code: int, world: int, local: int, docs: Optional[tuple]) -> bool:
    """Whether the backward can compute each block once (_backward_once): without documents,
    every rank's runs start and end at multiples of invariant_row_band() (so each row band is one
    rank's), not compiled (its point-to-point messages are not traced)."""
    if world == 1 or docs is not None or torch.compiler.is_compiling():
        return False
    align = torch.ops.cpattn.invariant_row_band()
    return all(b % align == 0 and n % align == 0 and g % align == 0
               for runs in global_runs(layout_code, world, local, docs) for b, n, g in runs)


# Parts of the keys whose planes _backward_once sends and adds while it computes the next ones: a
# rank whose rows see less of one part runs ahead instead of waiting for the others. Each part in
# flight keeps its planes alive; two were no faster than one here and raised the peak.
_PARTS_IN_FLIGHT = 1


def _backward_once(sums: tuple, mine: tuple, k: torch.Tensor, v: torch.Tensor, group, rank: int,
                   world: int, layout_code: int, seqlen: int, op_kwargs: dict) -> None:
    """Adds every gradient term of this rank's rows and keys to the fp32 running sums (dq_sum,
    dk_sum, dv_sum), each block of rows against keys computed once, on the rows' rank. Every
    rank's K and V stream in global order (stream_global), in parts of invariant_row_band() keys;
    per part each rank adds its rows' dQ terms (invariant_bwd_rows, as invariant_bwd_part does)
    and computes the dK / dV terms of each of its row bands (invariant_row_band() rows) that sees
    the part, a plane each; the part's owner receives the planes (one message per run of a
    rank's bands, one message at a time, so that one is alive) and adds them in global order of
    the bands: the
    order in which one process's kernel adds them. mine: this rank's dout, q, lse and shifted."""
    dq_sum, dk_sum, dv_sum = sums
    align = torch.ops.cpattn.invariant_row_band()
    local, d = k.shape[1], k.shape[3]
    runs = global_runs(layout_code, world, local, None)
    # every rank's row bands in global order: (global begin, rank, local band index)
    bands = sorted((g + i, r, (b + i) // align) for r in range(world) for b, n, g in runs[r]
                    for i in range(0, n, align))
    in_flight: list = []  # (part, this rank's sends, or a part it owns: its planes to add)

    def settle(last: int) -> None:  # completes the sends and additions of parts up to `last`
        while in_flight and in_flight[0][0] <= last:
            _, works, additions, _ = in_flight.pop(0)
            for dk_keys, dv_keys, planes in additions:  # in global order of the bands
                if isinstance(planes, tuple):  # another rank's: received now, one at a time
                    source, count, tag = planes
                    planes = dk_keys.new_empty((count, *dk_keys.shape[:3], d + dv_keys.shape[3]))
                    dist.recv(planes, dist.get_global_rank(group, source), group=group, tag=tag)
                for plane in planes:
                    dk_keys.add_(plane[..., :d])
                    dv_keys.add_(plane[..., d:])
                del planes
            for w in works:
                w.wait()

    step = 0
    for begin, (k_part, v_part) in stream_global([k, v], 1, group, rank, world, layout_code):
        owner, owner_begin = next((r, b + begin - g) for r in range(world)
                                  for b, n, g in runs[r] if g <= begin < g + n)
        for offset in range(0, k_part.shape[1], align):
            n, start = min(align, k_part.shape[1] - offset), begin + offset
            step += 1
            seen = torch.ops.cpattn.invariant_bands_seen(local, start, n, world, layout_code,
                                                          seqlen, None, **op_kwargs).tolist()
            # the bands that see the part, in global order, as runs of one rank's bands
            band_runs: list = []
            for _, r, j in bands:
                if seen[r][j]:
                    if band_runs and band_runs[-1][0] == r:
                        band_runs[-1][1].append(j)
                    else:
                        band_runs.append((r, [j]))
            own = [j for r, js in band_runs if r == rank for j in js]
            planes = dq_sum.new_zeros((len(own), k.shape[0], n, *k.shape[2:3], d + v.shape[3]))
            if own:
                torch.ops.cpattn.invariant_bwd_rows(
                    dq_sum, planes, *mine[:2], k_part.narrow(1, offset, n),
                    v_part.narrow(1, offset, n), *mine[2:], own, start, rank, world, layout_code,
                    seqlen, None, **op_kwargs)
            works, additions, i = [], [], 0
            keys = [s.narrow(1, owner_begin + offset, n) for s in (dk_sum, dv_sum)]
            for t, (r, js) in enumerate(band_runs):
                tag = step * 4096 + t  # the same on both sides: the part and the run of bands
                if r == rank:
                    mine_now = planes[i:i + len(js)]
                    i += len(js)
                    if owner == rank:
                        additions.append((*keys, mine_now))
                    else:
                        works.append(dist.isend(mine_now, dist.get_global_rank(group, owner),
                                                group=group, tag=tag))
                elif owner == rank:
                    additions.append((*keys, (r, len(js), tag)))
            in_flight.append((step, works, additions, planes))  # planes: alive until sent
            settle(step - _PARTS_IN_FLIGHT)
    settle(step)


def _finished(grad_sum: torch.Tensor, softmax_scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A streamed gradient's fp32 sum, scaled once and rounded to the gradient's dtype: the
    multiply in fp32 (the scale rounded to fp32 first) and round to nearest even, as one
    process's sums are finished (op invariant_bwd)."""
    return grad_sum.mul_(softmax_scale).to(dtype)


class InvariantAttention(torch.autograd.Function):
    """apply(q, k, v, sinks, options, group, rank, world, layout_code, seqlen, group_size, docs):
    q (B, L, H, D), k / v (B, L, Hkv, D / Dv) this rank's shards (with one rank the whole
    sequence; q may then be shorter, bottom-right aligned), seqlen the real global length (the
    shards' tokens past it are padding), group_size the KV heads gathered at a time; docs None
    or packed documents (batch 1) as ring_attention_varlen shards them, a PackedDocuments (their
    lengths and prefixes; seqlen is then unused)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, rank, world, layout_code, seqlen,
                group_size, docs):
        lengths = None if docs is None else tuple(docs.lengths.tolist())

        def attend(qh, kh):  # the gathered head group is freed on return, before the next one
            o = options.for_heads(qh)
            k_all, v_all = gather_global([k[:, :, kh], v[:, :, kh]], 1, group, rank, world,
                                         layout_code, lengths)
            return torch.ops.cpattn.invariant_fwd(q[:, :, qh], k_all, v_all, rank, world,
                                                  layout_code, seqlen, *doc_args(docs), o.sinks,
                                                  **o.op_kwargs())

        out, lse = forward_in_passes(q, k, group_size, attend)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (options, group, rank, world, layout_code, seqlen, group_size, docs, lengths)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention(invariant=True)")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        options, group, rank, world, layout_code, seqlen, group_size, docs, lengths = ctx.args
        dout = dout.contiguous()
        dsinks = None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32,
                                                        device=sinks.device)

        def streamed(tensors):  # every rank's tokens of a head group, a part at a time
            return stream_global(tensors, 1, group, rank, world, layout_code, lengths)

        def backward_pass(qh, kh):  # (dsinks: written here, pass by pass)
            o = options.for_heads(qh)
            dout_h, q_h, out_h, lse_h, k_h, v_h = (
                t.contiguous() for t in (dout[:, :, qh], q[:, :, qh], out[:, :, qh], lse[:, qh],
                                         k[:, :, kh], v[:, :, kh]))
            dlse_h = None if dlse is None else dlse[:, qh].contiguous()
            # One algorithm: fp32 running sums in global order, scaled and cast once at the end
            if world == 1:  # the sums of one part, every token: dQ, dK and dV in one call
                dq_c, dk_c, dv_c, dsinks_c = torch.ops.cpattn.invariant_bwd(
                    dout_h, q_h, k_h, v_h, out_h, lse_h, dlse_h, o.sinks, layout_code, seqlen,
                    *doc_args(docs), **o.op_kwargs())
            else:  # the same sums over W ranks: computed once per block, or streamed
                rest = (rank, world, layout_code, seqlen)
                # dlse - rowsum(dout * out) of these rows: what the kernels need of out and
                # dlse (here, and on the other ranks)
                dot = torch.ops.cpattn.row_dot(dout_h, out_h)
                shifted = -dot if dlse_h is None else dlse_h.float() - dot
                once = computed_once(layout_code, world, q_h.shape[1], lengths)
                if not once or o.sinks is not None:  # every rank's rows' lse and shifted
                    lse_all, shifted_all = gather_global([lse_h, shifted], 2, group, rank, world,
                                                         layout_code, lengths)
                dq_sum, dk_sum, dv_sum = (torch.zeros_like(t, dtype=torch.float32)
                                          for t in (q_h, k_h, v_h))
                if once:
                    _backward_once((dq_sum, dk_sum, dv_sum), (dout_h, q_h, lse_h, shifted), k_h,
                                   v_h, group, rank, world, layout_code, seqlen, o.op_kwargs())
                else:
                    mine = (dout_h, q_h, k_h, v_h, lse_h, shifted)
                    for begin, parts in streamed([dout_h, q_h, k_h, v_h]):
                        n = parts[0].shape[1]
                        torch.ops.cpattn.invariant_bwd_part(
                            dq_sum, dk_sum, dv_sum, *mine, *parts, lse_all.narrow(2, begin, n),
                            shifted_all.narrow(2, begin, n), begin, *rest, *doc_args(docs),
                            **o.op_kwargs())
                        del parts  # freed before the stream receives the next broadcast
                dq_c = _finished(dq_sum, o.softmax_scale, q.dtype)
                dk_c, dv_c = _finished(dk_sum, o.softmax_scale, k.dtype), dv_sum.to(v.dtype)
                dsinks_c = None if o.sinks is None else torch.ops.cpattn.invariant_sink_bwd(
                    lse_all, shifted_all, o.sinks, *rest,
                    None if docs is None else docs.lengths)
            if dsinks is not None:
                dsinks[qh].copy_(dsinks_c)
            return dq_c, dk_c, dv_c

        dq, dk, dv = backward_in_passes(q, k, v, group_size, backward_pass)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype) if ctx.needs_input_grad[3] else None
        return input_grads(ctx, dq, dk, dv, dsinks)


def invariant_attention(q, k, v, options, group, rank: int, world: int, layout_code: int,
                        seqlen: int, group_size: int, docs: Optional[PackedDocuments]):
    """InvariantAttention of this rank's shards in any layout: striped shards (not runs of
    consecutive positions) are moved to the contiguous layout and the results back."""
    if world == 1 or layout_code != LAYOUTS["striped"]:
        return InvariantAttention.apply(q, k, v, options.sinks, options, group, rank, world,
                                        layout_code, seqlen, group_size, docs)
    lengths = None if docs is None else tuple(docs.lengths.tolist())
    moves = (group, rank, world, LAYOUTS["striped"], LAYOUTS["contiguous"], lengths)
    back = (*moves[:3], moves[4], moves[3], lengths)
    q, k, v = (Relayout.apply(t, 1, *moves) for t in (q, k, v))
    out, lse = InvariantAttention.apply(q, k, v, options.sinks, options, group, rank, world,
                                        LAYOUTS["contiguous"], seqlen, group_size, docs)
    return Relayout.apply(out, 1, *back), Relayout.apply(lse, 2, *back)
