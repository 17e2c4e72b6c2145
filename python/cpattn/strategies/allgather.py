"""All-gather K/V: every rank gathers the whole sequence's K and V (a head group at a time, so
the gathered copy stays bounded), then runs the ring's steps against them locally
(csrc/ops/ring.cpp gathered_forward); the backward reduce-scatters every shard's dK/dV to its
owner. ring_attention(strategy="allgather") and the planner's "allgather" run this."""

import torch

from cpattn import comm
from cpattn._autograd import once_differentiable
from cpattn.strategies.common import forward_in_passes, head_groups, input_grads, sink_grad


def gather_kv(k, v, group, world):
    """(W, B, S_local, Hkv, D + Dv): every rank's K and V concatenated along the head dim (v may
    have its own head dim), in rank order."""
    kv = torch.cat([k, v], dim=-1)
    kv_all = kv.new_empty((world * kv.shape[0], *kv.shape[1:]))
    comm.all_gather_flat(kv_all, kv, group=group)
    return kv_all.view(world, *kv.shape)


def default_head_group(kv_heads: int, world: int) -> int:
    """KV heads per gather by default: kv_heads / (4 W), at least one, so a gathered head group
    (its K and V over the whole sequence) is at most a quarter of this rank's own K and V shards
    and the memory per rank falls as 1/W."""
    return max(1, kv_heads // (4 * world))


class GatheredAttention(torch.autograd.Function):
    """apply(q, k, v, sinks, options, group, rank, world, layout_code, doc_lengths, group_size)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, rank, world, layout_code, docs, group_size):
        def attend(qh, kh):  # the gathered head group is freed on return, before the next gather
            kv_all = gather_kv(k[:, :, kh], v[:, :, kh], group, world)
            o = options.for_heads(qh)
            return torch.ops.cpattn.gathered_fwd(q[:, :, qh], kv_all, rank, layout_code, docs,
                                                 o.sinks, **o.op_kwargs())

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
                dout[:, :, qh] if one else dout[:, :, qh].contiguous(), q[:, :, qh], kv_all,
                out[:, :, qh], lse[:, qh], rank, layout_code, docs,
                None if dlse is None else dlse[:, qh], **options.for_heads(qh).op_kwargs())
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
