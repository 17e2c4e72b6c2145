"""Ulysses attention: all-to-all between sequence and head shards.

Each rank holds a contiguous sequence shard of all heads; one all-to-all gives it the whole
sequence for H / W heads, local attention runs, and a second all-to-all brings the output back
to sequence shards. Communication per rank is ~4 tensors of its shard size, independent of W,
over all-to-all links; it needs H % W == 0. The hybrid (strategies/hybrid.py) runs the ring in
place of the local attention.
"""

from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn.attention import attention, varlen_attention
from cpattn.core.agreement import agree_on
from cpattn.core.autograd import input_grads, once_differentiable
from cpattn.core.device import to_device
from cpattn.core.layout import LAYOUTS, kv_heads_for_ranks, padded_length
from cpattn.core.options import AttentionOptions, checked_call, returned
from cpattn.core.validation import (
    check_bool,
    check_int,
    check_timeout,
    document_lengths,
    error,
    group_info,
)
from cpattn.invariant import InvariantAttention, check_invariant_call
from cpattn.max_logits import document_placement, global_max_logits, sequence_placement
from cpattn.sharding.packing import gathered_order
from cpattn.strategies.base import Strategy


def scatter_heads(q, k, v, group):
    """The all-to-all of q, k, v from sequence shards to head shards (GQA: the KV heads a rank
    needs replicated first when Hkv is not a multiple of the group size)."""
    world = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    repeats = kv_heads_for_ranks(heads, kv_heads, world)
    if repeats is not None:
        k, v = repeat_heads(k, repeats), repeat_heads(v, repeats)
    return tuple(comm.all_to_all(t, scatter_dim=2, gather_dim=1, group=group) for t in (q, k, v))


def repeat_heads(t: torch.Tensor, repeats: int) -> torch.Tensor:
    """t (B, S, H, D) with each head repeated `repeats` times in place (h0 h0 h1 h1 ...): a view
    expanded and copied, so no index or repeat count goes to the device."""
    b, s, h, d = t.shape
    return t.unsqueeze(3).expand(b, s, h, repeats, d).reshape(b, s, h * repeats, d)


def my_heads(heads: int, group) -> slice:
    """The query heads this rank holds after the all-to-all: [r * H/U, (r+1) * H/U)."""
    u_rank, u_world = dist.get_rank(group), dist.get_world_size(group)
    per_rank = heads // u_world
    return slice(u_rank * per_rank, (u_rank + 1) * per_rank)


def pad_rows(out: torch.Tensor, lse: torch.Tensor, length: int,
             sinks: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, L, H, Dv) and lse (B, H, L) padded at the end of the sequence to `length` rows:
    out 0 and LSE -inf (with sinks: the sink, as the ring's padding rows)."""
    extra = length - out.shape[1]
    if extra == 0:
        return out, lse
    b, _, h, _ = out.shape
    pad_lse = (lse.new_full((b, h, extra), float("-inf")) if sinks is None else
               sinks.to(lse.dtype)[None, :, None].expand(b, h, extra))
    return (torch.cat([out, out.new_zeros((b, extra, *out.shape[2:]))], dim=1),
            torch.cat([lse, pad_lse], dim=2))


class _LocalAcrossHeads(torch.autograd.Function):
    """Ulysses' local attention on this rank's heads and the all-to-all of its results back to
    sequence shards, as one autograd node that keeps the output by sequence only (the caller's
    tensor) instead of also by heads: the backward needs out only for rowsum(dout * out) per
    row, which it computes on the sequence shard and sends by heads (H floats per token instead
    of H x Dv). The sinks' gradient likewise comes from the sequence shard: this rank's rows of
    every head (the group's sum is the same as with each rank's heads over every row).
    apply(qh, kh, vh, sinks (every head), real rows, group, options of this rank's heads)."""

    @staticmethod
    def forward(ctx, qh, kh, vh, sinks, real, group, options):
        out_h, lse_h = torch.ops.cpattn.attention_fwd(
            qh[:, :real], kh[:, :real], vh[:, :real], sinks=options.sinks, **options.op_kwargs())
        out_h, lse_h = pad_rows(out_h, lse_h, qh.shape[1], options.sinks)
        out = comm.all_to_all_raw(out_h, 1, 2, group)
        lse = comm.all_to_all_raw(lse_h, 2, 1, group)
        ctx.save_for_backward(qh, kh, vh, lse_h, out, lse, sinks)
        ctx.real, ctx.group, ctx.options = real, group, options
        ctx.set_materialize_grads(False)  # no all-to-all of a zero dlse when lse is unused
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ulysses_attention")
    def backward(ctx, dout, dlse):
        qh, kh, vh, lse_h, out, lse, sinks = ctx.saved_tensors
        real, group = ctx.real, ctx.group
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # (B, H, S/W) by sequence -> (B, H/W, S) by heads, as the LSE's gradient
        dot_h = comm.all_to_all_raw(torch.ops.cpattn.row_dot(dout, out), 1, 2, group)
        dlse_h = None if dlse is None else comm.all_to_all_raw(dlse.contiguous(), 1, 2, group)
        dout_h = comm.all_to_all_raw(dout, 2, 1, group)
        args = (qh[:, :real], kh[:, :real], vh[:, :real], None, lse_h[:, :, :real], None, None)
        rest = dict(dlse=None if dlse_h is None else dlse_h[:, :, :real],
                    row_dot=dot_h[:, :, :real], **ctx.options.op_kwargs())
        if dout_h is not dout and dout_h.shape == qh.shape and dout_h.dtype == qh.dtype:
            # dout by heads is ours (received; on one rank it is the caller's gradient) and
            # needed no more: dq is written over it
            dq = dout_h[:, :real]
            grads = (dq, *torch.ops.cpattn.attention_bwd_in_dout(dq, *args, **rest))
        else:  # one rank (dout is the caller's), Dv != D, or another out dtype
            grads = torch.ops.cpattn.attention_bwd(dout_h[:, :real], *args, **rest)
        del dout_h
        pad = qh.shape[1] - real  # padding rows: no gradient
        dq, dk, dv = (torch.nn.functional.pad(g, (0, 0, 0, 0, 0, pad)) if pad else g
                      for g in grads)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = torch.ops.cpattn.sink_bwd(dout, out, lse, sinks, dlse).to(sinks.dtype)
        return input_grads(ctx, dq, dk, dv, dsinks)


# attend(qh, kh, vh, n, options of this rank's heads) -> (out_h, lse_h)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Optional[int], AttentionOptions],
                  tuple[torch.Tensor, torch.Tensor]]


def across_heads(what: str, q, k, v, group, timeout: float, attend: Optional[Attend],
                 return_lse: bool, options: dict, *, seqlen,
                 rows: Callable[[int], tuple[int, int]], layout: str = "contiguous",
                 fields_of: Optional[Callable[[], list]] = None,
                 fixed: Optional[dict] = None):
    """The Ulysses steps of ulysses_attention and the hybrid: validation and the agreement check
    over `group` (returns the checked options, out and, with return_lse, the LSE, else None),
    the all-to-all to head shards, attend(qh, kh, vh, n, options) -> (out_h, lse_h)
    on this rank's heads (the options' per-head tensors sliced to them) for a sequence of n real
    tokens, and the all-to-all back. attend None: cpattn.attention, with the all-to-all back in
    the same autograd node (_LocalAcrossHeads).
    Any length: rows(n) gives (the length of a head shard once a length-n sequence is padded,
    the rows of it that attend gets); the rows after those come back as padding (0 / -inf).
    fields_of(): more fields of the signature, validated with the rest (varlen's documents).
    fixed: the attention options the caller does not let its caller choose (as
    AttentionOptions.checked)."""
    world = dist.get_world_size(group)

    def check():
        opts, fields = checked_call(what, q, k, v, options, layout, fixed=fixed)
        if q.shape[2] % world != 0:
            raise error(what, "heads", q.shape[2],
                        f"must be divisible by the Ulysses group size ({world})")
        if opts.invariant:
            check_invariant_call(what, q)
            if k.shape[2] % world != 0:  # a replicated KV head's gradient is a sum over ranks
                raise error(what, "kv_heads", k.shape[2], f"must be divisible by the Ulysses "
                            f"group size ({world}) with invariant=True")
        more = fields_of() if fields_of is not None else []  # (varlen: validates cu_seqlens)
        held = q.shape[1] * world  # tokens of a head shard
        n = None
        if seqlen is not None:
            n = check_int(what, "seqlen", seqlen, minimum=1)
            if rows(n)[0] != held:
                raise error(what, "seqlen", n, f"gives head shards of {rows(n)[0]} tokens once "
                            f"padded (see cpattn.positions), but the shards hold {held}")
        return (opts, n), [*fields, ("seqlen", n), *more]

    opts, n = agree_on(what, group, timeout, check)
    qh, kh, vh = scatter_heads(q, k, v, group)
    real = qh.shape[1] if n is None else rows(n)[1]
    mine = opts.for_heads(my_heads(q.shape[2], group))
    if opts.invariant and attend is None:  # each rank's heads over the whole sequence, as one
        # process computes them (the hybrid's attend is the ring, invariant itself)
        def attend(qh, kh, vh, n, o):
            return InvariantAttention.apply(qh, kh, vh, o.sinks, o, None, 0, 1,
                                            LAYOUTS["contiguous"], qh.shape[1], kh.shape[2], None)
    if attend is None:
        out, lse = _LocalAcrossHeads.apply(qh, kh, vh, opts.sinks, real, group, mine)
        return opts, out, lse if return_lse else None
    out_h, lse_h = attend(qh[:, :real], kh[:, :real], vh[:, :real], n, mine)
    out_h, lse_h = pad_rows(out_h, lse_h, qh.shape[1], mine.sinks)
    out = comm.all_to_all(out_h, scatter_dim=1, gather_dim=2, group=group)
    if not return_lse:
        return opts, out, None
    return opts, out, comm.all_to_all(lse_h, scatter_dim=2, gather_dim=1, group=group)


def max_logits_field(what: str, return_max_logits) -> Callable[[], list]:
    return lambda: [("return_max_logits",
                     check_bool(what, "return_max_logits", return_max_logits))]


def boundaries(cu_seqlens) -> list[int]:
    """Checked boundaries (a tensor in eager mode; a list of ints under compile) as ints."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    return [int(x) for x in values]


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
    seqlen: Optional[int] = None, timeout: Optional[float] = None, return_lse: bool = False,
    return_max_logits: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Exact attention over a sequence sharded contiguously (rank r holds tokens
    [r*S/W, (r+1)*S/W)) by all-to-all between sequence and head shards.

    q (B, S/W, H, D), k/v (B, S/W, Hkv, D); H % W == 0. GQA: when Hkv % W == 0 each rank receives
    Hkv / W KV heads; otherwise the KV heads a rank needs are replicated before the all-to-all:
    one per rank when a rank's H/W query heads share one KV head (K/V traffic x W / Hkv), else one
    per query head (K/V traffic x H / Hkv). Returns out (B, S/W, H, Dv) and optionally the LSE
    (B, H, S/W). Differentiable. v may have its own head dim Dv.
    **options: the attention options (cpattn.attention), on global positions; each rank uses
    the sinks / slopes of the heads it computes; the gradient of `sinks` on a rank is its
    tokens' share, every head (summed over the group by the usual parameter-gradient
    all-reduce). The backward keeps the output by sequence only (not also by heads).
    seqlen: the global sequence length, for any length (default: W times the shard length):
    cpattn.shard(x, layout="contiguous") pads a length-S sequence at its end to a multiple of W
    (cpattn.positions marks the padding with -1); padding rows get out 0 and LSE -inf (with
    sinks: the sink), padding keys are never attended to; cpattn.unshard(..., seqlen=S).
    return_max_logits: as cpattn.ring_attention (last in the returned tuple).
    """
    what = "cpattn.ulysses_attention"
    group, _, world = group_info(group)
    timeout = check_timeout(what, timeout, group)
    opts, out, lse = across_heads(what, q, k, v, group, timeout, None, return_lse,
                                  options, seqlen=seqlen,
                                  rows=lambda n: (padded_length(n, "contiguous", world), n),
                                  fields_of=max_logits_field(what, return_max_logits))
    max_logits = []
    if return_max_logits:
        n = q.shape[1] * world if seqlen is None else seqlen
        max_logits = [global_max_logits(q, k, group, sequence_placement(n, "contiguous", world),
                                        opts)]
    return returned(out, lse, max_logits)


def ulysses_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, group=None,
    attend_cu_seqlens=None, timeout: Optional[float] = None, return_lse: bool = False,
    return_max_logits: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Ulysses attention over packed documents that never attend across each other.

    cu_seqlens: global document boundaries (int, D+1, from 0), the same on every rank. q
    (T_local, H, D), k / v (T_local, Hkv, D) come from cpattn.shard_varlen(..., layout=
    "contiguous"): each document padded to a multiple of W and split contiguously. The
    all-to-all gives each rank every token of H / W heads; the documents then attend locally
    (cpattn.attention_varlen) and come back by sequence. Padding tokens: output 0, LSE -inf
    (with sinks: the sink). Options as ulysses_attention but prefix_len, on positions within
    each document.
    Returns out (T_local, H, Dv) and optionally lse (H, T_local), and with return_max_logits
    (as cpattn.ring_attention_varlen) the max logits last.
    attend_cu_seqlens: the pieces that attend apart when finer than the sharding's documents
    (each a part of one document: Llama 4's chunks); default cu_seqlens. Options and
    return_max_logits then act on positions within the pieces.
    """
    what = "cpattn.ulysses_attention_varlen"
    group, _, world = group_info(group)
    pieces = cu_seqlens if attend_cu_seqlens is None else attend_cu_seqlens

    def fields_of():
        docs, _, raw = document_lengths(what, cu_seqlens)
        fields = [("documents", docs.numel()), ("document_lengths", raw),
                  *max_logits_field(what, return_max_logits)()]
        if attend_cu_seqlens is not None:
            _, _, raw_parts = document_lengths(what, attend_cu_seqlens)
            if not set(boundaries(cu_seqlens)) <= set(boundaries(attend_cu_seqlens)):
                raise error(what, "attend_cu_seqlens", "<boundaries>", "must hold every "
                            "boundary of cu_seqlens (pieces of the documents)")
            if return_max_logits:
                raise error(what, "return_max_logits", True, "is not supported with "
                            "attend_cu_seqlens")
            fields += [("attend_lengths", raw_parts)]
        return fields

    def attend(qh, kh, vh, n, mine: AttentionOptions):
        # (1, W T_local, h, D): every rank's shard in rank order -> the packed documents
        cu = boundaries(cu_seqlens)
        lengths = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
        order = to_device(gathered_order(lengths, "contiguous", world), qh.device)  # row of p
        out_p, lse_p = varlen_attention(qh[0, order], kh[0, order], vh[0, order], pieces, mine)
        out = out_p.new_zeros((qh.shape[1], *out_p.shape[1:])).index_copy(0, order, out_p)
        empty = (lse_p.new_full((lse_p.shape[0], qh.shape[1]), float("-inf"))
                 if mine.sinks is None else
                 mine.sinks.to(lse_p.dtype)[:, None].expand(-1, qh.shape[1]))
        return out[None], empty.index_copy(1, order, lse_p)[None]

    timeout = check_timeout(what, timeout, group)
    opts, out, lse = across_heads(what, q[None], k[None], v[None], group, timeout,
                                  attend, return_lse, options, seqlen=None,
                                  rows=lambda n: (n, n), fields_of=fields_of,
                                  fixed={"prefix_len": 0})
    max_logits = []
    if return_max_logits:
        docs, _, _ = document_lengths(what, cu_seqlens)
        placement = document_placement(docs, "contiguous", world)
        max_logits = [global_max_logits(q[None], k[None], group, placement, opts)]
    return returned(out[0], None if lse is None else lse[0], max_logits)


def _attend(cp, q, k, v, **call):
    return ulysses_attention(q, k, v, group=cp.group, **call)


def _attend_varlen(cp, q, k, v, cu_seqlens, **call):
    return ulysses_attention_varlen(q, k, v, cu_seqlens, group=cp.group, **call)


def _emulate(q: list, k: list, v: list, layout: str, opts: AttentionOptions):
    """The all-to-alls done by concatenation: each emulated rank attends every token with its
    heads (GQA K/V heads repeated as Ulysses does for W > Hkv)."""
    world = len(q)
    if q[0].shape[2] % world != 0:
        raise ValueError(f"cpattn.ring_attention_emulated: heads={q[0].shape[2]}: strategy "
                         f"'ulysses' needs heads divisible by the number of ranks ({world})")
    full_q, full_k, full_v = (torch.cat(t, dim=1) for t in (q, k, v))
    heads = full_q.shape[2]
    repeats = kv_heads_for_ranks(heads, full_k.shape[2], world)
    if repeats is not None:
        full_k, full_v = (t.repeat_interleave(repeats, dim=2) for t in (full_k, full_v))
    per_rank, kv_per_rank = heads // world, full_k.shape[2] // world
    outs, lses = [], []
    for r in range(world):  # rank r: all tokens, its heads
        qh = slice(r * per_rank, (r + 1) * per_rank)
        kh = slice(r * kv_per_rank, (r + 1) * kv_per_rank)
        out, lse = attention(full_q[:, :, qh], full_k[:, :, kh], full_v[:, :, kh],
                             causal=opts.causal, softmax_scale=opts.softmax_scale,
                             window=opts.window, return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=1)
    return list(out.chunk(world, dim=1)), list(lse.chunk(world, dim=2))


ULYSSES = Strategy("ulysses", _attend, _attend_varlen, layouts=("contiguous",),
                   layout_rule="shards the sequence contiguously",
                   emulate=_emulate, splits_heads=True)
