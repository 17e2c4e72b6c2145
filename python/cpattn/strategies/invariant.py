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


_RUNS: dict = {}  # _runs' results by arguments


@torch._dynamo.assume_constant_result  # compiled: run while tracing, its result a constant
def _runs(layout_code: int, world: int, local: int) -> tuple:
    """Per rank, (local begin, length, global begin) of each run of consecutive positions of its
    shard of `local` tokens (the layout's rule: torch.ops.cpattn.layout_positions), cut at the
    same local indices on every rank (zigzag's last rank holds two chunks that follow each
    other, cut like the others'), so that the ranks' j-th runs have one length."""
    key = (layout_code, world, local)
    if key not in _RUNS:
        pos = [torch.ops.cpattn.layout_positions(local * world, world, r, layout_code).tolist()
               for r in range(world)]
        cuts = sorted({i for p in pos for i in range(1, local) if p[i] != p[i - 1] + 1} | {local})
        _RUNS[key] = tuple(tuple((b, e - b, p[b]) for b, e in zip([0, *cuts], cuts))
                           for p in pos)
    return _RUNS[key]


def gather_global(t: torch.Tensor, dim: int, group, rank: int, world: int, layout_code: int
                  ) -> torch.Tensor:
    """Every rank's shard of `t` (its tokens along `dim`, in the layout's order) in global
    order: t's shape with W times the tokens along `dim`. Stored sequence-major, so that the
    ranks' runs of positions that follow each other in rank order (contiguous; zigzag's first
    chunks) are gathered in place; other runs (zigzag's second chunks, in reverse rank order)
    through a buffer. With one rank, t itself."""
    if world == 1:
        return t
    local = t.shape[dim]
    src = t.movedim(dim, 0)
    out = src.new_empty((world * local, *src.shape[1:]))
    runs = _runs(layout_code, world, local)
    for j, (begin, length, _) in enumerate(runs[rank]):  # the ranks' j-th runs: equal lengths
        starts = [runs[r][j][2] for r in range(world)]
        mine = src.narrow(0, begin, length).contiguous()
        if starts == [starts[0] + r * length for r in range(world)]:
            comm.all_gather_flat(out.narrow(0, starts[0], world * length), mine, group=group)
            continue
        gathered = mine.new_empty((world * length, *mine.shape[1:]))
        comm.all_gather_flat(gathered, mine, group=group)
        for r, start in enumerate(starts):
            out.narrow(0, start, length).copy_(gathered.narrow(0, r * length, length))
    return out.movedim(0, dim)


class InvariantAttention(torch.autograd.Function):
    """apply(q, k, v, sinks, options, group, rank, world, layout_code, seqlen, group_size):
    q (B, L, H, D), k / v (B, L, Hkv, D / Dv) this rank's shards (with one rank the whole
    sequence; q may then be shorter, bottom-right aligned), seqlen the real global length (the
    shards' tokens past it are padding), group_size the KV heads gathered at a time."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, options, group, rank, world, layout_code, seqlen,
                group_size):
        def attend(qh, kh):  # the gathered head group is freed on return, before the next one
            k_all, v_all = (gather_global(t[:, :, kh], 1, group, rank, world, layout_code)
                            for t in (k, v))
            o = options.for_heads(qh)
            return torch.ops.cpattn.invariant_fwd(q[:, :, qh], k_all, v_all, rank, world,
                                                  layout_code, seqlen, o.sinks, **o.op_kwargs())

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

        def everyone(t, dim=1):  # every rank's rows of a head group, in global order
            return None if t is None or world == 1 else \
                gather_global(t, dim, group, rank, world, layout_code)

        for qh, kh in head_groups(q, k, group_size):
            o = options.for_heads(qh)
            dout_h, q_h, out_h, lse_h = (t.contiguous() for t in (dout[:, :, qh], q[:, :, qh],
                                                                   out[:, :, qh], lse[:, qh]))
            dlse_h = None if dlse is None else dlse[:, qh].contiguous()
            shifted = None  # the other ranks need dlse - rowsum(dout * out) of these rows, not out
            if world > 1:
                dot = torch.ops.cpattn.row_dot(dout_h, out_h)
                shifted = -dot if dlse_h is None else dlse_h.float() - dot
            dq_c, dk_c, dv_c, dsinks_c = torch.ops.cpattn.invariant_bwd(
                dout_h, q_h, *(gather_global(t[:, :, kh], 1, group, rank, world, layout_code)
                               for t in (k, v)),
                out_h, lse_h, dlse_h, everyone(q_h), everyone(dout_h), everyone(lse_h, 2),
                everyone(shifted, 2), o.sinks, rank, world, layout_code, seqlen,
                **o.op_kwargs())
            dq[:, :, qh].copy_(dq_c)
            dk[:, :, kh].copy_(dk_c)
            dv[:, :, kh].copy_(dv_c)
            if dsinks is not None:
                dsinks[qh].copy_(dsinks_c)
            del dq_c, dk_c, dv_c
        if dsinks is not None:
            dsinks = dsinks.to(sinks.dtype) if ctx.needs_input_grad[3] else None
        return input_grads(ctx, dq, dk, dv, dsinks)
