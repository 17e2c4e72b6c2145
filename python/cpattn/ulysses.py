"""Ulysses (all-to-all sequence <-> heads) attention and the hybrid Ulysses-inside, ring-across.

Ulysses: each rank holds a contiguous sequence shard of all heads; one all-to-all gives it the
whole sequence for H / W heads, local attention runs, and a second all-to-all brings the output
back to sequence shards. Communication per rank is ~4 tensors of its shard size, independent of
W, over all-to-all links; it needs H % W == 0.
"""

import functools
from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn._agreement import agree_on, score_fields
from cpattn._autograd import once_differentiable
from cpattn._layout import (
    kv_heads_for_ranks,
    padded_length,
    round_up,
)
from cpattn._validation import (
    check_bool,
    check_int,
    check_scale,
    check_score_options,
    check_timeout,
    check_window,
    document_lengths,
    error,
)
from cpattn.attention import attention
from cpattn.max_logits import document_placement, global_max_logits, returned, sequence_placement
from cpattn.packing import gathered_order
from cpattn.ring import (
    _attention_args,
    _group_info,
    attention_varlen,
    positions,
    ring_attention,
    ring_attention_varlen,
    shard,
    unshard,
)


def _scatter_heads(q, k, v, group):
    world = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    idx = kv_heads_for_ranks(heads, kv_heads, world)
    if idx is not None:
        index = torch.tensor(idx, device=k.device)
        k, v = k.index_select(2, index), v.index_select(2, index)
    return tuple(comm.all_to_all(t, scatter_dim=2, gather_dim=1, group=group) for t in (q, k, v))


def _check_heads(what: str, q, world: int) -> None:
    if q.shape[2] % world != 0:
        raise error(what, "heads", q.shape[2],
                    f"must be divisible by the Ulysses group size ({world})")


def _my_heads(per_head: Optional[torch.Tensor], heads: int, group) -> Optional[torch.Tensor]:
    """The entries of a per-head parameter (sinks, ALiBi slopes) for the query heads this rank
    holds after the all-to-all: [r * H/U, (r+1) * H/U). Differentiable (slicing)."""
    if per_head is None:
        return None
    u_rank, u_world = dist.get_rank(group), dist.get_world_size(group)
    per_rank = heads // u_world
    return per_head[u_rank * per_rank:(u_rank + 1) * per_rank]


def _pad_rows(out: torch.Tensor, lse: torch.Tensor, length: int,
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
    every head (the group's sum is the same as with each rank's heads over every row)."""

    @staticmethod
    def forward(ctx, qh, kh, vh, sinks, real, group, options):
        heads = qh.shape[2] * dist.get_world_size(group)
        my_sinks = _my_heads(sinks, heads, group)
        out_h, lse_h = attention(qh[:, :real], kh[:, :real], vh[:, :real], return_lse=True,
                                 sinks=my_sinks, **options)
        out_h, lse_h = _pad_rows(out_h, lse_h, qh.shape[1], my_sinks)
        out = comm._all_to_all(out_h, 1, 2, group)
        lse = comm._all_to_all(lse_h, 2, 1, group)
        ctx.save_for_backward(qh, kh, vh, lse_h, out, lse, sinks)
        ctx.real, ctx.group, ctx.options = real, group, options
        ctx.set_materialize_grads(False)  # no all-to-all of a zero dlse when lse is unused
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ulysses_attention")
    def backward(ctx, dout, dlse):
        qh, kh, vh, lse_h, out, lse, sinks = ctx.saved_tensors
        real, group, o = ctx.real, ctx.group, ctx.options
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        # (B, H, S/W) by sequence -> (B, H/W, S) by heads, as the LSE's gradient
        dot_h = comm._all_to_all(torch.ops.cpattn.row_dot(dout, out), 1, 2, group)
        dlse_h = None if dlse is None else comm._all_to_all(dlse.contiguous(), 1, 2, group)
        dout_h = comm._all_to_all(dout, 2, 1, group)
        scale = check_scale("cpattn.ulysses_attention", o["softmax_scale"], qh.shape[-1])
        args = (qh[:, :real], kh[:, :real], vh[:, :real], None, lse_h[:, :, :real], scale,
                o["causal"], o["window"][0], o["window"][1], None, None)
        score = (None if dlse_h is None else dlse_h[:, :, :real], o["softcap"],
                 o["alibi_slopes"], o["prefix_len"], dot_h[:, :, :real])
        if dout_h is not dout and dout_h.shape == qh.shape and dout_h.dtype == qh.dtype:
            # dout by heads is ours (received; on one rank it is the caller's gradient) and
            # needed no more: dq is written over it
            dq = dout_h[:, :real]
            grads = (dq, *torch.ops.cpattn.attention_bwd_in_dout(dq, *args, *score))
        else:  # one rank (dout is the caller's), Dv != D, or another out dtype
            grads = torch.ops.cpattn.attention_bwd(dout_h[:, :real], *args, None, *score)
        del dout_h
        pad = qh.shape[1] - real  # padding rows: no gradient
        dq, dk, dv = (torch.nn.functional.pad(g, (0, 0, 0, 0, 0, pad)) if pad else g
                      for g in grads)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = torch.ops.cpattn.sink_bwd(dout, out, lse, sinks, dlse).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None


def _across_heads(what: str, q, k, v, group, timeout: float, attend: Optional[Callable],
                  return_lse: bool, *, causal, softmax_scale, window, sinks, softcap,
                  alibi_slopes, prefix_len, seqlen, rows: Callable[[int], tuple[int, int]],
                  layout: str = "contiguous", fields_of: Optional[Callable[[], list]] = None):
    """The Ulysses steps of ulysses_attention and hybrid_attention: validation and the agreement
    check over `group`, the all-to-all to head shards, attend(qh, kh, vh, n, **options) ->
    (out_h, lse_h) on this rank's heads (per-head options sliced to them) for a sequence of n
    real tokens, and the all-to-all back. attend None: cpattn.attention, with the all-to-all
    back in the same autograd node (_LocalAcrossHeads).
    Any length: rows(n) gives (the length of a head shard once a length-n sequence is padded,
    the rows of it that attend gets); the rows after those come back as padding (0 / -inf).
    fields_of(): more fields of the signature, validated with the rest (varlen's documents)."""
    world = dist.get_world_size(group)

    def check():
        args, fields = _attention_args(what, q, k, v, causal, softmax_scale, window, layout)
        _check_heads(what, q, world)
        cap, prefix = check_score_options(what, softcap, alibi_slopes, prefix_len)
        more = fields_of() if fields_of is not None else []  # (varlen: validates cu_seqlens)
        held = q.shape[1] * world  # tokens of a head shard
        n = None
        if seqlen is not None:
            n = check_int(what, "seqlen", seqlen, minimum=1)
            if rows(n)[0] != held:
                raise error(what, "seqlen", n, f"gives head shards of {rows(n)[0]} tokens once "
                            f"padded (see cpattn.positions), but the shards hold {held}")
        return (*args, cap, prefix, n), [*fields, *score_fields(cap, alibi_slopes, sinks, prefix),
                                         ("seqlen", n), *more]

    causal, _, softmax_scale, window, softcap, prefix_len, n = agree_on(what, group, timeout,
                                                                       check)
    qh, kh, vh = _scatter_heads(q, k, v, group)
    heads = q.shape[2]
    real = qh.shape[1] if n is None else rows(n)[1]
    if attend is None:
        out, lse = _LocalAcrossHeads.apply(
            qh, kh, vh, sinks, real, group,
            dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
                 alibi_slopes=_my_heads(alibi_slopes, heads, group), prefix_len=prefix_len))
        return (out, lse) if return_lse else out
    my_sinks = _my_heads(sinks, heads, group)
    out_h, lse_h = attend(qh[:, :real], kh[:, :real], vh[:, :real], n, causal=causal,
                          softmax_scale=softmax_scale, window=window, return_lse=True,
                          softcap=softcap, sinks=my_sinks,
                          alibi_slopes=_my_heads(alibi_slopes, heads, group),
                          prefix_len=prefix_len)
    out_h, lse_h = _pad_rows(out_h, lse_h, qh.shape[1], my_sinks)
    out = comm.all_to_all(out_h, scatter_dim=1, gather_dim=2, group=group)
    if not return_lse:
        return out
    return out, comm.all_to_all(lse_h, scatter_dim=2, gather_dim=1, group=group)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, causal: bool = False,
    softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
    return_lse: bool = False, timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, prefix_len: int = 0,
    seqlen: Optional[int] = None, return_max_logits: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Exact attention over a sequence sharded contiguously (rank r holds tokens
    [r*S/W, (r+1)*S/W)) by all-to-all between sequence and head shards.

    q (B, S/W, H, D), k/v (B, S/W, Hkv, D); H % W == 0. GQA: when Hkv % W == 0 each rank receives
    Hkv / W KV heads; otherwise the KV heads a rank needs are replicated before the all-to-all:
    one per rank when a rank's H/W query heads share one KV head (K/V traffic x W / Hkv), else one
    per query head (K/V traffic x H / Hkv). Returns out (B, S/W, H, Dv) and optionally the LSE
    (B, H, S/W). Differentiable. v may have its own head dim Dv.
    sinks, softcap, alibi_slopes, prefix_len: as cpattn.attention on global positions; each rank
    uses the sinks / slopes of the heads it computes; the gradient of `sinks` on a rank is its
    tokens' share, every head (summed over the group by the usual parameter-gradient
    all-reduce). The backward keeps the output by sequence only (not also by heads).
    seqlen: the global sequence length, for any length (default: W times the shard length):
    cpattn.shard(x, layout="contiguous") pads a length-S sequence at its end to a multiple of W
    (cpattn.positions marks the padding with -1); padding rows get out 0 and LSE -inf (with
    sinks: the sink), padding keys are never attended to; cpattn.unshard(..., seqlen=S).
    return_max_logits: as cpattn.ring_attention (last in the returned tuple).
    """
    what = "cpattn.ulysses_attention"
    group, _, world = _group_info(group)
    result = _across_heads(what, q, k, v, group, check_timeout(what, timeout), None,
                           return_lse, causal=causal, softmax_scale=softmax_scale, window=window,
                           sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
                           prefix_len=prefix_len, seqlen=seqlen,
                           rows=lambda n: (padded_length(n, "contiguous", world), n),
                           fields_of=_max_logits_field(what, return_max_logits))
    max_logits = []
    if return_max_logits:
        n = q.shape[1] * world if seqlen is None else seqlen
        max_logits = [global_max_logits(q, k, group, sequence_placement(n, "contiguous", world),
                                        check_scale(what, softmax_scale, q.shape[-1]), causal,
                                        check_window(window, what), prefix_len)]
    out, lse = result if return_lse else (result, None)
    return returned(out, lse, max_logits)


def _max_logits_field(what: str, return_max_logits) -> Callable[[], list]:
    return lambda: [("return_max_logits",
                     check_bool(what, "return_max_logits", return_max_logits))]


def ulysses_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, group=None,
    causal: bool = False, softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1), return_lse: bool = False,
    timeout: Optional[float] = None, sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, return_max_logits: bool = False,
    attend_cu_seqlens=None,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Ulysses attention over packed documents that never attend across each other.

    cu_seqlens: global document boundaries (int, D+1, from 0), the same on every rank. q
    (T_local, H, D), k / v (T_local, Hkv, D) come from cpattn.shard_varlen(..., layout=
    "contiguous"): each document padded to a multiple of W and split contiguously. The
    all-to-all gives each rank every token of H / W heads; the documents then attend locally
    (cpattn.attention_varlen) and come back by sequence. Padding tokens: output 0, LSE -inf
    (with sinks: the sink). Options as ulysses_attention, on positions within each document.
    Returns out (T_local, H, Dv) and optionally lse (H, T_local), and with return_max_logits
    (as cpattn.ring_attention_varlen) the max logits last.
    attend_cu_seqlens: the pieces that attend apart when finer than the sharding's documents
    (each a part of one document: Llama 4's chunks); default cu_seqlens. Options and
    return_max_logits then act on positions within the pieces.
    """
    what = "cpattn.ulysses_attention_varlen"
    group, _, world = _group_info(group)

    pieces = cu_seqlens if attend_cu_seqlens is None else attend_cu_seqlens

    def fields_of():
        docs, _, raw = document_lengths(what, cu_seqlens)
        fields = [("documents", docs.numel()), ("document_lengths", raw),
                  *_max_logits_field(what, return_max_logits)()]
        if attend_cu_seqlens is not None:
            _, _, raw_parts = document_lengths(what, attend_cu_seqlens)
            if not set(_ints(cu_seqlens)) <= set(_ints(attend_cu_seqlens)):
                raise error(what, "attend_cu_seqlens", "<boundaries>", "must hold every "
                            "boundary of cu_seqlens (pieces of the documents)")
            if return_max_logits:
                raise error(what, "return_max_logits", True, "is not supported with "
                            "attend_cu_seqlens")
            fields += [("attend_lengths", raw_parts)]
        return fields

    def attend(qh, kh, vh, n, *, return_lse, prefix_len, sinks, **options):
        # (1, W T_local, h, D): every rank's shard in rank order -> the packed documents
        cu = _ints(cu_seqlens)
        lengths = tuple(b - a for a, b in zip(cu[:-1], cu[1:]))
        order = gathered_order(lengths, "contiguous", world).to(qh.device)  # row of token p
        out_p, lse_p = attention_varlen(qh[0, order], kh[0, order], vh[0, order],
                                        pieces, return_lse=True, sinks=sinks, **options)
        out = out_p.new_zeros((qh.shape[1], *out_p.shape[1:])).index_copy(0, order, out_p)
        empty = (lse_p.new_full((lse_p.shape[0], qh.shape[1]), float("-inf")) if sinks is None
                 else sinks.to(lse_p.dtype)[:, None].expand(-1, qh.shape[1]))
        return out[None], empty.index_copy(1, order, lse_p)[None]

    result = _across_heads(what, q[None], k[None], v[None], group, check_timeout(what, timeout),
                           attend, return_lse, causal=causal, softmax_scale=softmax_scale,
                           window=window, sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
                           prefix_len=0, seqlen=None, rows=lambda n: (n, n), fields_of=fields_of)
    max_logits = []
    if return_max_logits:
        docs, _, _ = document_lengths(what, cu_seqlens)
        placement = document_placement(docs, "contiguous", world)
        max_logits = [global_max_logits(q[None], k[None], group, placement,
                                        check_scale(what, softmax_scale, q.shape[-1]), causal,
                                        check_window(window, what), 0)]
    out, lse = result if return_lse else (result, None)
    return returned(out[0], None if lse is None else lse[0], max_logits)


def hybrid_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, ulysses_group,
    ring_group, layout: str = "zigzag", causal: bool = False,
    softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
    return_lse: bool = False, timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, return_max_logits: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Hybrid attention (Ulysses inside, ring across) over packed documents that never attend
    across each other. Sharding (cpattn.ContextParallel.document_positions): every document
    sharded per document over the R ring ranks (cpattn.shard_varlen's layout), each ring shard
    padded at its end to a multiple of U and cut in U contiguous parts. The Ulysses all-to-all
    gives each rank its ring shard for H / U heads, ring_attention_varlen runs across the ring.
    q (T_local, H, D), k / v (T_local, Hkv, D); returns out (T_local, H, Dv) and optionally lse
    (H, T_local); padding: 0 and -inf (with sinks: the sink); return_max_logits: as
    ring_attention_varlen (last)."""
    what = "cpattn.hybrid_attention_varlen"
    timeout = check_timeout(what, timeout)
    r_world, u_world = dist.get_world_size(ring_group), dist.get_world_size(ulysses_group)

    def fields_of():
        docs, _, raw = document_lengths(what, cu_seqlens)
        held = rows(None)[0] // u_world
        if q.shape[0] != held:
            raise error(what, "q tokens", q.shape[0], f"must be {held}: this rank's part of the "
                        "documents' sharding (cpattn.ContextParallel.document_positions)")
        return [("documents", docs.numel()), ("document_lengths", raw),
                *_max_logits_field(what, return_max_logits)()]

    def rows(_):  # (a head shard's rows, the ring shard's: real) (in check(): agreed)
        cu = _ints(cu_seqlens)
        ring_shard = sum(padded_length(b - a, layout, r_world) // r_world
                         for a, b in zip(cu[:-1], cu[1:]) if b > a)
        return round_up(ring_shard, u_world), ring_shard

    maxima = []

    def attend(qh, kh, vh, n, *, return_lse, **options):  # qh: this rank's ring shard
        out, lse, *best = ring_attention_varlen(
            qh[0], kh[0], vh[0], cu_seqlens, group=ring_group, layout=layout, timeout=timeout,
            return_lse=True, return_max_logits=return_max_logits, **options)
        maxima.extend(best)
        return out[None], lse[None]

    result = _across_heads(what, q[None], k[None], v[None], ulysses_group, timeout, attend,
                           return_lse, causal=causal, softmax_scale=softmax_scale, window=window,
                           sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes, prefix_len=0,
                           seqlen=1, layout=layout, fields_of=fields_of, rows=rows)
    out, lse = result if return_lse else (result, None)
    return _with_heads_maxima(out[0], None if lse is None else lse[0], maxima, ulysses_group)


def _ints(cu_seqlens) -> list[int]:
    """Checked boundaries (a tensor in eager mode; a list of ints under compile) as ints."""
    values = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    return [int(x) for x in values]


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ulysses_group=None, ring_group=None,
    mesh=None, causal: bool = False, layout: str = "zigzag", softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1), return_lse: bool = False, timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, prefix_len: int = 0,
    seqlen: Optional[int] = None, return_max_logits: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Ulysses inside `ulysses_group` (size U), ring across `ring_group` (size R), W = U * R.

    Alternatively `mesh`: a 2D DeviceMesh whose dim 0 is the ring and dim 1 is Ulysses.
    Sharding (see cpattn.hybrid_positions / hybrid_shard): the sequence is split over the R ring
    ranks by `layout`; the rank at ring index i and Ulysses index u holds the u-th contiguous
    sub-chunk of ring shard i. H % U == 0. Either group may have size 1.
    sinks, softcap, alibi_slopes, prefix_len: as ulysses_attention (per-head ones sliced to the
    rank's heads, then as ring_attention across the ring). v may have its own head dim.
    seqlen: the global sequence length, for any length (default: W times the shard length):
    hybrid_shard pads as hybrid_positions says; padding rows get out 0 and LSE -inf (with
    sinks: the sink); hybrid_unshard(..., seqlen=S) gives S tokens back.
    return_max_logits: as cpattn.ring_attention (last in the returned tuple).
    """
    if mesh is not None:
        ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    if ulysses_group is None or ring_group is None:
        raise ValueError("cpattn.hybrid_attention: give ulysses_group and ring_group, or a 2D mesh")
    what = "cpattn.hybrid_attention"
    timeout = check_timeout(what, timeout)
    ring = functools.partial(ring_attention, group=ring_group, layout=layout, timeout=timeout)
    r_world, u_world = dist.get_world_size(ring_group), dist.get_world_size(ulysses_group)

    maxima = []  # the ring's max logits of this rank's heads (over the whole sequence)

    def attend(qh, kh, vh, n, **options):  # this rank's ring shard, padded for the ring only
        out, lse, *best = ring(qh, kh, vh, seqlen=n, return_max_logits=return_max_logits,
                               **options)
        maxima.extend(best)
        return out, lse

    result = _across_heads(what, q, k, v, ulysses_group, timeout, attend, return_lse,
                           causal=causal, softmax_scale=softmax_scale, window=window,
                           sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes,
                           prefix_len=prefix_len, layout=layout, seqlen=seqlen,
                           rows=lambda n: _hybrid_ring_shard(n, layout, r_world, u_world)[::-1],
                           fields_of=_max_logits_field(what, return_max_logits))
    out, lse = result if return_lse else (result, None)
    return _with_heads_maxima(out, lse, maxima, ulysses_group)


def _with_heads_maxima(out, lse, maxima: list, ulysses_group):
    """A hybrid call's out (and lse) with, when asked, the max logits of every head: each
    rank's ring gave its own heads' (over the whole sequence), all-gathered over Ulysses."""
    if maxima:
        maxima = [comm.all_gather(maxima[0], dim=0, group=ulysses_group)]
    return returned(out, lse, maxima)


def _hybrid_ring_shard(seqlen: int, layout: str, r_world: int, u_world: int) -> tuple[int, int]:
    """(tokens of a ring shard of the sequence padded to the layout's granularity over the ring,
    that number padded to a multiple of U): hybrid's two paddings."""
    ring_shard = padded_length(seqlen, layout, r_world) // r_world
    return ring_shard, round_up(ring_shard, u_world)


def hybrid_positions(
    seqlen: int, *, ulysses_group, ring_group, layout: str = "zigzag", device=None
) -> torch.Tensor:
    """Global positions of this rank's tokens under hybrid_attention's sharding.

    Any length: the sequence is padded at its end to the ring layout's granularity (as
    cpattn.positions over the R ring ranks), each ring shard then at its end to a multiple of U;
    padding slots have position -1."""
    _, r_rank, r_world = _group_info(ring_group)
    _, u_rank, u_world = _group_info(ulysses_group)
    ring_pos = positions(seqlen, layout=layout, rank=r_rank, world_size=r_world, device=device)
    _, padded = _hybrid_ring_shard(seqlen, layout, r_world, u_world)
    if padded != ring_pos.numel():
        ring_pos = torch.cat([ring_pos, ring_pos.new_full((padded - ring_pos.numel(),), -1)])
    return ring_pos.chunk(u_world)[u_rank]


def hybrid_shard(x: torch.Tensor, *, ulysses_group, ring_group, layout: str = "zigzag",
                 dim: int = 1) -> torch.Tensor:
    """This rank's part of the full tensor x under hybrid_attention's sharding."""
    idx = hybrid_positions(x.shape[dim], ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout)
    return shard(x, index=idx, dim=dim)


def hybrid_unshard(x_local: torch.Tensor, *, ulysses_group, ring_group, layout: str = "zigzag",
                   dim: int = 1, group=None, seqlen: Optional[int] = None) -> torch.Tensor:
    """Inverse of hybrid_shard over `group` (default: the world, which must hold exactly the
    ranks of the mesh). `seqlen`: the real length (default: W times the shard length); the
    padding slots are dropped. Differentiable."""
    world = dist.get_world_size(ulysses_group) * dist.get_world_size(ring_group)
    if seqlen is None:
        seqlen = x_local.shape[dim] * world
    idx = hybrid_positions(seqlen, ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout)
    if idx.numel() != x_local.shape[dim]:
        raise error("cpattn.hybrid_unshard", "seqlen", seqlen, f"gives shards of {idx.numel()} "
                    f"tokens, not {x_local.shape[dim]}")
    return unshard(x_local, group=group, index=idx, seqlen=seqlen, dim=dim)
