"""All-gather K/V: every rank gathers the whole sequence's K and V (a head group at a time, so
the gathered copy stays bounded), then runs the ring's steps against them locally
(csrc/ops/ring.cpp gathered_forward); the backward reduce-scatters every shard's dK/dV to its
owner. ring_attention(strategy="allgather") and the planner's "allgather" run this."""

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn.core.autograd import (
    forward_in_passes,
    head_groups,
    input_grads,
    once_differentiable,
    sink_grad,
)
from cpattn.core.layout import LAYOUTS, default_head_group, doc_args
from cpattn.core.options import AttentionOptions


def gather_kv(k, v, group, world):
    """(W, B, S_local, Hkv, D + Dv): every rank's K and V concatenated along the head dim (v may
    have its own head dim), in rank order."""
    kv = torch.cat([k, v], dim=-1)
    kv_all = kv.new_empty((world * kv.shape[0], *kv.shape[1:]))
    comm.all_gather_flat(kv_all, kv, group=group)
    return kv_all.view(world, *kv.shape)


def split_kv(kv_all: torch.Tensor, k: torch.Tensor) -> tuple:
    """The gathered K and V (views) of kv_all (W, B, S, Hkv, D + Dv), the ops' k_all and v_all:
    they travel as one buffer, D = k's head dim."""
    d = k.shape[-1]
    return kv_all[..., :d], kv_all[..., d:]


class GatheredAttention(torch.autograd.Function):
    """apply(q, k, v, sinks, options, group, rank, world, layout_code, docs, group_size): docs a
    PackedDocuments or None."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, rank, world, layout_code, docs, group_size):
        def attend(qh, kh):  # the gathered head group is freed on return, before the next gather
            kv_all = gather_kv(k[:, :, kh], v[:, :, kh], group, world)
            o = options.for_heads(qh)
            return torch.ops.cpattn.gathered_fwd(q[:, :, qh], *split_kv(kv_all, k), rank,
                                                 layout_code, *doc_args(docs), o.sinks,
                                                 **o.op_kwargs())

        out, lse = forward_in_passes(q, k, group_size, attend)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (options, group, rank, world, layout_code, docs, group_size)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention(strategy='allgather')")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        options, group, rank, world, layout_code, docs, group_size = ctx.args
        dout = dout.contiguous()
        one = group_size >= k.shape[2]
        # Written head group by head group (no list of parts and no concatenation), unless one.
        dq = None if one else torch.empty_like(q)
        dk, dv = (None, None) if one else (torch.empty_like(k), torch.empty_like(v))
        for qh, kh in head_groups(q, k, group_size):
            kv_all = gather_kv(k[:, :, kh], v[:, :, kh], group, world)  # gathered again: bounded
            dq_c, dkv_all = torch.ops.cpattn.gathered_bwd(
                dout[:, :, qh] if one else dout[:, :, qh].contiguous(), q[:, :, qh],
                *split_kv(kv_all, k), out[:, :, qh], lse[:, qh], rank, layout_code,
                *doc_args(docs), None if dlse is None else dlse[:, qh],
                **options.for_heads(qh).op_kwargs())
            del kv_all
            dkv = dkv_all.new_empty(dkv_all.shape[1:])
            comm.reduce_scatter_flat(dkv, dkv_all.view(-1, *dkv_all.shape[2:]), group=group)
            del dkv_all
            d = k.shape[-1]  # dK and dV side by side along the head dim, as K and V were
            if one:
                dq, dk, dv = (dq_c, dkv[..., :d].to(k.dtype, copy=True),
                              dkv[..., d:].to(v.dtype, copy=True))
            else:
                dq[:, :, qh].copy_(dq_c)
                dk[:, :, kh].copy_(dkv[..., :d])
                dv[:, :, kh].copy_(dkv[..., d:])
                del dq_c, dkv
        return input_grads(ctx, dq, dk, dv, sink_grad(ctx, 3, sinks, dout, out, lse, dlse))


def _exchange(like: torch.Tensor, sends: list, out_splits: list, group) -> torch.Tensor:
    """One all-to-all over the group in which each rank sends only to the ranks it shares a
    document with: sends[dest] = the row blocks for dest, in order; returns the received rows
    (by source rank, in the order the sources sent them)."""
    in_splits = [sum(b.shape[0] for b in blocks) for blocks in sends]
    send = torch.cat([b for blocks in sends for b in blocks]) if any(in_splits) else \
        like.new_empty((0, *like.shape[1:]))
    return comm.rows_all_to_all(send, out_splits, in_splits, group.group_name)


class SubsetGathered(torch.autograd.Function):
    """Documents of a cpattn.DocumentPlan split over a subset of the ranks: each member gets
    the other members' K/V shards of each document (one all-to-all over the group that sends
    nothing between ranks sharing no document), then runs the gathered kernels on each;
    the backward sends each shard's dK/dV back to its owner the same way. Every rank of the
    group calls it (a rank without such a document sends and receives nothing).
    apply(q, k, v, sinks, options, group, layout_code, pieces, docs): q (1, T, H, D) the
    rank's shards of those documents, one after the other; pieces: DocumentPlan.subset_pieces;
    docs: each piece's document as the ops take it (a PackedDocuments: its length, and its
    prefix if any)."""

    @staticmethod
    def _peers(pieces, rank: int, world: int):
        """(blocks this rank sends each rank: (piece, offset, length); blocks it receives
        from each rank: (piece, that rank's index in the piece, length)), in the same order
        on both sides of each pair: the pieces' (the plan's documents) order."""
        sends = [[(p, off, n) for p, (_, members, _, off, n) in enumerate(pieces)
                  if dest != rank and dest in members] for dest in range(world)]
        recvs = [[(p, members.index(src), n) for p, (_, members, _, _, n) in enumerate(pieces)
                  if src != rank and src in members] for src in range(world)]
        return sends, recvs

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, layout_code, pieces, docs):
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        kv = torch.cat([k, v], dim=-1)[0]  # (T, Hkv, D + Dv)
        sends, recvs = SubsetGathered._peers(pieces, rank, world)
        out_splits = [sum(n for _, _, n in blocks) for blocks in recvs]
        recv = _exchange(kv, [[kv[off:off + n] for _, off, n in b] for b in sends], out_splits,
                         group)
        gathered = []
        for _, members, mine, off, n in pieces:
            kv_all = kv.new_empty((len(members), 1, n, *kv.shape[1:]))
            kv_all[mine, 0].copy_(kv[off:off + n])
            gathered.append(kv_all)
        at = 0
        for blocks in recvs:
            for p, j, n in blocks:
                gathered[p][j, 0].copy_(recv[at:at + n])
                at += n
        del recv
        outs, lses = [], []
        for (_, _, mine, off, n), kv_all, doc in zip(pieces, gathered, docs):
            o, s = torch.ops.cpattn.gathered_fwd(q[:, off:off + n], *split_kv(kv_all, k), mine,
                                                 layout_code, *doc_args(doc), sinks,
                                                 **options.op_kwargs())
            outs.append(o)
            lses.append(s)
        if outs:
            out, lse = torch.cat(outs, 1), torch.cat(lses, 2)
        else:
            out = q.new_empty((*q.shape[:3], v.shape[-1]))
            lse = q.new_empty((1, q.shape[2], 0), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, sinks, *gathered)
        ctx.args = (options, group, layout_code, pieces, docs)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention_varlen(DocumentPlan)")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks, *gathered = ctx.saved_tensors
        options, group, layout_code, pieces, docs = ctx.args
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        dout = dout.contiguous()
        dq = torch.empty_like(q)
        dkv = torch.empty((*k.shape[1:3], k.shape[3] + v.shape[3]), dtype=torch.float32,
                          device=k.device)
        dkv_alls = []
        for (_, _, mine, off, n), kv_all, doc in zip(pieces, gathered, docs):
            dq_p, dkv_all = torch.ops.cpattn.gathered_bwd(
                dout[:, off:off + n].contiguous(), q[:, off:off + n], *split_kv(kv_all, k),
                out[:, off:off + n], lse[:, :, off:off + n].contiguous(), mine, layout_code,
                *doc_args(doc),
                None if dlse is None else dlse[:, :, off:off + n].contiguous(),
                **options.op_kwargs())
            dq[:, off:off + n].copy_(dq_p)
            dkv[off:off + n].copy_(dkv_all[mine, 0])
            dkv_alls.append(dkv_all)
        # Each member's dK/dV of the others' shards goes back to their owners (the reverse of
        # the forward's exchange: what was received from a rank is sent back to it).
        sends, recvs = SubsetGathered._peers(pieces, rank, world)
        back = [[dkv_alls[p][j, 0] for p, j, _ in blocks] for blocks in recvs]
        in_splits = [sum(n for _, _, n in blocks) for blocks in sends]
        recv = _exchange(dkv, back, in_splits, group)
        at = 0
        for blocks in sends:
            for _, off, n in blocks:
                dkv[off:off + n] += recv[at:at + n]
                at += n
        d = k.shape[-1]
        dk, dv = dkv[..., :d].to(k.dtype)[None], dkv[..., d:].to(v.dtype)[None]
        if pieces:
            dsinks = sink_grad(ctx, 3, sinks, dout, out, lse, dlse)
        else:  # no rows here
            dsinks = None if sinks is None else torch.zeros_like(sinks)
        return input_grads(ctx, dq, dk, dv, dsinks)


def run_gathered(q, k, v, opts, group, rank, world, layout, timeout, docs, per_gather):
    """One call of the all-gather over this rank's (1 or B, L, H, D) shards (the ring's run
    signature, cpattn.strategies.ring.RingStrategy)."""
    return GatheredAttention.apply(q, k, v, opts.sinks, opts, group, rank, world,
                                   LAYOUTS[layout], docs,
                                   per_gather or default_head_group(k.shape[2], world))


def emulate_gathered(q: list, k: list, v: list, layout: str, opts: AttentionOptions,
                     what: str):
    """Every emulated rank's steps against the stacked shards."""
    k_all, v_all = torch.stack(k), torch.stack(v)
    results = [torch.ops.cpattn.gathered_fwd(q[r], k_all, v_all, r, LAYOUTS[layout],
                                             **opts.op_kwargs()) for r in range(len(q))]
    return [o for o, _ in results], [lse for _, lse in results]
