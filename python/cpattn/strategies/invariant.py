"""Invariant mode (invariant=True): out, lse and every gradient bitwise independent of the number of
ranks, the layout and the strategy. Each rank computes exactly what one process computes for its
own query rows (out, lse, dQ) and its own keys (dK, dV), in kernel calls over the whole sequence
whose sums run in an order fixed by global positions (csrc/ops/invariant.cpp). The forward
gathers every rank's K and V, the backward also every rank's q, dout, out and lse, a head group
at a time (as the all-gather strategy), so the memory per rank stays bounded.
cpattn.attention(invariant=True) is the same computation over one rank: the reference."""

import torch

from cpattn import comm
from cpattn._autograd import once_differentiable
from cpattn._validation import error
from cpattn.strategies.common import forward_in_passes, head_groups, input_grads


def check_invariant_call(what: str, q: torch.Tensor, layout: str, world: int) -> None:
    """What invariant=True needs beyond the options: CPU tensors, a layout of position runs."""
    if q.device.type != "cpu":
        raise error(what, "invariant", True, f"runs on CPU tensors only in this version (the "
                    f"CUDA kernels have no fixed-order mode yet), got q on {q.device}")
    if layout == "striped" and world > 1:
        raise error(what, "layout", layout, "is not supported with invariant=True: use "
                    "'contiguous' or 'zigzag' (their shards are runs of consecutive positions)")


def gather(t: torch.Tensor, group, world: int) -> torch.Tensor:
    """(W, *t.shape): every rank's `t`, in rank order; with one rank, t itself as (1, *t.shape)."""
    t = t.contiguous()
    if world == 1:
        return t[None]
    out = t.new_empty((world * t.shape[0], *t.shape[1:]))
    comm.all_gather_flat(out, t, group=group)
    return out.view(world, *t.shape)


class InvariantAttention(torch.autograd.Function):
    """apply(q, k, v, sinks, options, group, rank, world, layout_code, seqlen, group_size):
    q (B, L, H, D), k / v (B, L, Hkv, D / Dv) this rank's shards (with one rank the whole
    sequence; q may then be shorter, bottom-right aligned), seqlen the real global length (the
    shards' tokens past it are padding), group_size the KV heads gathered at a time."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, rank, world, layout_code, seqlen,
                group_size):
        def attend(qh, kh):  # the gathered head group is freed on return, before the next one
            kv_all = gather(torch.cat([k[:, :, kh], v[:, :, kh]], dim=-1), group, world)
            o = options.for_heads(qh)
            return torch.ops.cpattn.invariant_fwd(q[:, :, qh], kv_all, rank, layout_code, seqlen,
                                                  o.sinks, **o.op_kwargs())

        out, lse = forward_in_passes(q, k, group_size, attend)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (options, group, rank, world, layout_code, seqlen, group_size)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention(invariant=True)")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        options, group, rank, world, layout_code, seqlen, group_size = ctx.args
        dout = dout.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dsinks = None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32,
                                                        device=sinks.device)
        for qh, kh in head_groups(q, k, group_size):
            o = options.for_heads(qh)
            kv_all = gather(torch.cat([k[:, :, kh], v[:, :, kh]], dim=-1), group, world)
            rows_all = lse_all = dlse_all = None
            if world > 1:
                rows_all = gather(torch.cat([q[:, :, qh], dout[:, :, qh], out[:, :, qh]], dim=-1),
                                  group, world)
                lse_all = gather(lse[:, qh], group, world)
                dlse_all = None if dlse is None else gather(dlse[:, qh], group, world)
            dq_c, dk_c, dv_c, dsinks_c = torch.ops.cpattn.invariant_bwd(
                dout[:, :, qh].contiguous(), q[:, :, qh], kv_all, out[:, :, qh],
                lse[:, qh].contiguous(), None if dlse is None else dlse[:, qh].contiguous(),
                rows_all, lse_all, dlse_all, o.sinks, rank, layout_code, seqlen,
                **o.op_kwargs())
            del kv_all, rows_all
            dq[:, :, qh].copy_(dq_c)
            dk[:, :, kh].copy_(dk_c)
            dv[:, :, kh].copy_(dv_c)
            if dsinks is not None:
                dsinks[qh].copy_(dsinks_c)
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype) if ctx.needs_input_grad[3] else None
        return input_grads(ctx, dq, dk, dv, dsinks)
