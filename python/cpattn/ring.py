"""Ring attention over a torch.distributed process group, and the layout helpers.

Each rank passes its shard of q, k, v (in `layout` order along the sequence dim) and gets the
exact attention output of its queries over the whole sequence. K/V shards travel around the ring
while the current step computes; results are merged in float32 with their log-sum-exp. The ring
driver, the schedule and the layouts live in C++ (csrc/ops/ring.cpp, csrc/include/cpattn/).
"""

from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm, plan
from cpattn._agreement import Fields, agree_on, digest_ints, score_fields, tensor_fields
from cpattn._autograd import once_differentiable
from cpattn._layout import (
    DTYPE_NAMES,
    LAYOUTS,
    document_positions,
    kv_heads_for_ranks,
    layout_code,
    padded_length,
    round_up,
    shard_positions,
)
from cpattn._validation import (
    check_bool,
    check_choice,
    check_cu_seqlens,
    check_int,
    check_prefix_per_document,
    check_qkv,
    check_scale,
    check_score_options,
    check_timeout,
    check_window,
    document_lengths,
    error,
)
from cpattn.max_logits import (
    document_placement,
    global_max_logits,
    returned,
    sequence_placement,
)


def _group_info(group) -> tuple:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "cpattn: ring attention needs torch.distributed to be initialised "
            "(dist.init_process_group), or use cpattn.ring_attention_emulated for one process"
        )
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def rank_and_world(group, rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """(rank, world_size): the group's, each overridden when given (e.g. another rank's view)."""
    if rank is None or world_size is None:
        _, g_rank, g_world = _group_info(group)
        rank = g_rank if rank is None else rank
        world_size = g_world if world_size is None else world_size
    return rank, world_size


def positions(
    seqlen: int,
    *,
    group=None,
    layout: str = "zigzag",
    device: Optional[torch.device] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> torch.Tensor:
    """Global positions (int64, (padded / W,)) of this rank's tokens, e.g. for RoPE.

    Any length: a sequence whose length is not a multiple of the layout's granularity (2W for
    zigzag, W otherwise) is padded at its end to the next multiple, `padded`; the padding slots
    of the shard have position -1 (cpattn.shard fills them with zeros, ring_attention with
    seqlen= gives them out 0 and LSE -inf, cpattn.unshard with seqlen= drops them).
    `rank` / `world_size` override the group's (to compute another rank's positions).
    """
    rank, world_size = rank_and_world(group, rank, world_size)
    pos = shard_positions(seqlen, layout, world_size, rank)
    return pos.to(device) if device is not None else pos


def shard(
    x: torch.Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    dim: int = 1,
    index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This rank's part of the full tensor x along `dim`, in `layout` order.

    Any length: x is padded with zeros at the end of `dim` to the layout's granularity (see
    cpattn.positions). `index` (global positions of this rank's tokens, -1 for padding)
    overrides the layout, e.g. for the hybrid or varlen shardings.
    """
    if index is None:
        index = positions(x.shape[dim], group=group, layout=layout)
    index = index.to(x.device)
    if bool((index < 0).any()):
        x = torch.cat([x, x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1:]))], dim)
        index = torch.where(index < 0, x.shape[dim] - 1, index)
    return x.index_select(dim, index)


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, index, seqlen, group, dim):
        ctx.group, ctx.dim = group, dim
        ctx.save_for_backward(index)
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        index = index.to(x_local.device)  # gathered where x is (an NCCL-only group: CUDA)
        indices = [torch.empty_like(index) for _ in range(world)]
        dist.all_gather(indices, index, group=group)
        # Index -1 marks padding held by no position: it lands in an extra slot, dropped below.
        slots = torch.cat(indices).to(x_local.device)
        slots = torch.where(slots < 0, seqlen, slots)
        full = x_local.new_zeros((*x_local.shape[:dim], seqlen + 1, *x_local.shape[dim + 1 :]))
        full.index_copy_(dim, slots, torch.cat(parts, dim))
        return full.narrow(dim, 0, seqlen)

    @staticmethod
    @once_differentiable("cpattn.unshard")
    def backward(ctx, grad_full):
        # Every rank holds the full gradient of its own copy; the shard's gradient is the sum.
        (index,) = ctx.saved_tensors
        grad = grad_full.clone(memory_format=torch.contiguous_format)  # never write into grad_full
        dist.all_reduce(grad, group=ctx.group)
        zero_slot = grad.new_zeros((*grad.shape[: ctx.dim], 1, *grad.shape[ctx.dim + 1 :]))
        grad = torch.cat([grad, zero_slot], ctx.dim)
        index = torch.where(index < 0, grad.shape[ctx.dim] - 1, index)
        return grad.index_select(ctx.dim, index.to(grad.device)), None, None, None, None


def unshard(
    x_local: torch.Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    dim: int = 1,
    index: Optional[torch.Tensor] = None,
    seqlen: Optional[int] = None,
) -> torch.Tensor:
    """All-gathers the shards along `dim` and puts the tokens back in sequence order.

    Differentiable: the gradient of each shard is the sum of the ranks' gradients of its tokens.
    `seqlen`: the full length (default: W times the shard length); a shorter one (any length,
    see cpattn.positions) drops the padding slots, so exactly `seqlen` tokens come back.
    `index` (this rank's global positions, -1 for padding) overrides the layout; positions not
    held by any rank are 0.
    """
    what = "cpattn.unshard"

    def locate(local: int, world: int) -> tuple[torch.Tensor, int, Fields]:
        if index is not None:
            return index.to(torch.int64).cpu(), local * world if seqlen is None else seqlen, []
        check_choice(what, "layout", layout, tuple(LAYOUTS))
        n = local * world if seqlen is None else check_int(what, "seqlen", seqlen, minimum=1)
        pos = positions(n, group=group, layout=layout)
        if pos.numel() != local:
            raise error(what, "seqlen", n, f"gives shards of {pos.numel()} tokens under the "
                        f"{layout} layout over {world} ranks, not {local}")
        return pos, n, [("layout", layout)]

    return _unshard(what, x_local, group, dim, locate)


def _unshard(what: str, x_local, group, dim, locate: Callable) -> torch.Tensor:
    """unshard after validation and the agreement check. locate(local length, world) gives this
    rank's global positions, the full length and more fields the ranks must agree on."""
    group, _, world = _group_info(group)

    def check():
        if not isinstance(x_local, torch.Tensor):
            raise error(what, "x_local", x_local, "must be a torch.Tensor")
        d = check_int(what, "dim", dim)
        if not -x_local.dim() <= d < x_local.dim():
            raise error(what, "dim", dim, f"must index one of x_local's {x_local.dim()} dims")
        d %= x_local.dim()
        index, seqlen, fields = locate(x_local.shape[d], world)
        seqlen = check_int(what, "seqlen", seqlen, minimum=0)
        return (d, index, seqlen), [*tensor_fields("x_local", x_local, ()), ("dim", d),
                                    ("seqlen", seqlen), ("index.numel", index.numel()), *fields]

    d, index, seqlen = agree_on(what, group, check_timeout(what, None), check)
    return _Unshard.apply(x_local, index, seqlen, group, d)


def _attention_args(what, q, k, v, causal, softmax_scale, window, layout="contiguous",
                    varlen=False) -> tuple[tuple, Fields]:
    """Validates the arguments every attention strategy shares. Returns (causal, layout_code,
    softmax_scale, window) normalised, and the signature fields every rank must share."""
    check_qkv(what, q, k, v, varlen=varlen, v_head_dim_free=True)  # v: its own head dim Dv
    causal = check_bool(what, "causal", causal)
    check_choice(what, "layout", layout, tuple(LAYOUTS))
    window = check_window(window, what)
    scale = check_scale(what, softmax_scale, q.shape[-1])
    dims = ("tokens", "heads", "head_dim") if varlen else ("batch", "seqlen", "heads", "head_dim")
    fields = [*tensor_fields("q", q, dims), *tensor_fields("k", k, dims),
              *tensor_fields("v", v, dims), ("causal", causal), ("layout", layout),
              ("window_left", window[0]), ("window_right", window[1]), ("softmax_scale", scale)]
    return (causal, LAYOUTS[layout], scale, window), fields


STRATEGIES = {"ring": 0, "allgather": 1, "auto": 2}


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record a graph through one of `tensors`."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def auto_strategy(q, k, world: int, group, causal: bool, layout: str, window, docs,
                  allgather_chunk: Optional[int], ring_chunk: Optional[int], what: str
                  ) -> plan.Candidate:
    """ring_attention(strategy="auto"): the ring (in passes of ring_chunk KV heads if given; of
    fewer KV heads when memory is short) or the all-gather for this rank's shards q
    (B, S/W, H, D), k (B, S/W, Hkv, D) in `layout`. Call it only after the ranks agreed on the
    shapes, options, documents and on whether gradients are needed."""
    p = plan.Problem(
        seqlen=q.shape[1] * world, heads=q.shape[2], kv_heads=k.shape[2], head_dim=q.shape[3],
        batch=q.shape[0], dtype=DTYPE_NAMES[q.dtype], causal=bool(causal), window=tuple(window),
        documents=None if docs is None else tuple(docs.tolist()),
        mode="train" if needs_grad(q, k) else "forward")
    chunk = allgather_chunk or plan.allgather_chunk(k.shape[2], world)
    cands = [plan.Candidate("ring", layout, chunk=ring_chunk or 0),
             plan.Candidate("allgather", layout, chunk=chunk)]
    return plan.choose(p, world, cands, group, what).candidate


def _sink_grad(ctx, sinks, dout, out, lse, dlse):
    """The gradient of the sinks from this rank's rows: its share, like any parameter gradient
    under context parallelism (the usual gradient all-reduce over the group sums the shares)."""
    if sinks is None or not ctx.needs_input_grad[-1]:
        return None
    return torch.ops.cpattn.sink_bwd(dout, out, lse, sinks, dlse).to(sinks.dtype)


def _head_chunks(q, k, chunk: int) -> list:
    """(query heads, KV heads) slices of each pass over `chunk` KV heads at a time; one pass of
    every head when chunk >= kv heads."""
    if chunk >= k.shape[2]:
        return [(slice(None), slice(None))]
    group_size = q.shape[2] // k.shape[2]
    return [(slice(c0 * group_size, (c0 + chunk) * group_size), slice(c0, c0 + chunk))
            for c0 in range(0, k.shape[2], chunk)]


def _forward_in_passes(q, k, chunk: int, attend: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, S, H, Dv) and lse (B, H, S) from attend(query heads, KV heads) -> (out, lse) of
    each pass over `chunk` KV heads, written pass by pass (no list of parts, no concatenation);
    with one pass, its result."""
    passes = _head_chunks(q, k, chunk)
    if len(passes) == 1:
        return attend(*passes[0])
    out = lse = None
    for qh, kh in passes:
        out_c, lse_c = attend(qh, kh)
        if out is None:
            out = out_c.new_empty((*q.shape[:3], out_c.shape[3]))
            lse = lse_c.new_empty((q.shape[0], q.shape[2], q.shape[1]))
        out[:, :, qh].copy_(out_c)
        lse[:, qh].copy_(lse_c)
        del out_c, lse_c
    return out, lse


class _RingAttention(torch.autograd.Function):
    """The ring (csrc/ops/ring.cpp), in one pass over every head or, with `chunk` < kv heads,
    one pass per chunk of `chunk` KV heads (and their query heads): each pass holds the fp32
    state and the ring buffers of its heads only, and writes its part of the results."""

    @staticmethod
    def forward(ctx, q, k, v, group_name, scale, causal, window, layout_code, timeout, docs,
                softcap, alibi_slopes, prefix_len, chunk, sinks):
        args = (group_name, scale, causal, window[0], window[1], layout_code, timeout)
        out, lse = _forward_in_passes(q, k, chunk, lambda qh, kh: torch.ops.cpattn.ring_fwd(
            q[:, :, qh], k[:, :, kh], v[:, :, kh], *args, doc_lengths=docs, softcap=softcap,
            alibi_slopes=_heads(alibi_slopes, qh), sinks=_heads(sinks, qh), prefix_len=prefix_len,
        ))
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
        ctx.args, ctx.chunk = args, chunk
        ctx.docs, ctx.softcap, ctx.prefix_len = docs, softcap, prefix_len
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        passes = _head_chunks(q, k, ctx.chunk)
        if len(passes) > 1:  # written pass by pass
            dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for qh, kh in passes:
            dq_c, dk_c, dv_c = torch.ops.cpattn.ring_bwd(
                dout if len(passes) == 1 else dout[:, :, qh].contiguous(), q[:, :, qh],
                k[:, :, kh], v[:, :, kh], out[:, :, qh], lse[:, qh], *ctx.args,
                dlse=None if dlse is None else dlse[:, qh], doc_lengths=ctx.docs,
                softcap=ctx.softcap, alibi_slopes=_heads(alibi_slopes, qh),
                prefix_len=ctx.prefix_len,
            )
            if len(passes) == 1:
                dq, dk, dv = dq_c, dk_c, dv_c
                break
            dq[:, :, qh].copy_(dq_c)
            dk[:, :, kh].copy_(dk_c)
            dv[:, :, kh].copy_(dv_c)
            del dq_c, dk_c, dv_c
        dsinks = _sink_grad(ctx, sinks, dout, out, lse, dlse)
        return dq, dk, dv, *([None] * 11), dsinks


def _gather_kv(k, v, group, world):
    """(W, B, S_local, Hkv, D + Dv): every rank's K and V concatenated along the head dim (v may
    have its own head dim), in rank order."""
    kv = torch.cat([k, v], dim=-1)
    kv_all = kv.new_empty((world * kv.shape[0], *kv.shape[1:]))
    comm.all_gather_flat(kv_all, kv, group=group)
    return kv_all.view(world, *kv.shape)


class _GatheredAttention(torch.autograd.Function):
    """All-gather K/V (a chunk of KV heads at a time, so the gathered copy stays bounded), then
    the ring's steps locally; the backward reduce-scatters every shard's dK/dV to its owner."""

    @staticmethod
    def forward(ctx, q, k, v, group, rank, world, scale, causal, window, layout_code, docs,
                chunk, softcap, alibi_slopes, prefix_len, sinks):
        def attend(qh, kh):  # the gathered chunk is freed on return, before the next gather
            kv_all = _gather_kv(k[:, :, kh], v[:, :, kh], group, world)
            return torch.ops.cpattn.gathered_fwd(
                q[:, :, qh], kv_all, rank, scale, causal, window[0], window[1], layout_code,
                doc_lengths=docs, softcap=softcap, alibi_slopes=_heads(alibi_slopes, qh),
                sinks=_heads(sinks, qh), prefix_len=prefix_len,
            )

        out, lse = _forward_in_passes(q, k, chunk, attend)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
        ctx.args = (group, rank, world, scale, causal, window, layout_code, docs, chunk)
        ctx.softcap, ctx.prefix_len = softcap, prefix_len
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.ring_attention(strategy='allgather')")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
        group, rank, world, scale, causal, window, layout_code, docs, chunk = ctx.args
        dout = dout.contiguous()
        one = chunk >= k.shape[2]
        # Written chunk by chunk (no list of parts and no concatenation), except with one chunk.
        dq = None if one else torch.empty_like(q)
        dk, dv = (None, None) if one else (torch.empty_like(k), torch.empty_like(v))
        for qh, kh in _head_chunks(q, k, chunk):
            kv_all = _gather_kv(k[:, :, kh], v[:, :, kh], group, world)  # gathered again: bounded
            dq_c, dkv_all = torch.ops.cpattn.gathered_bwd(
                dout[:, :, qh] if one else dout[:, :, qh].contiguous(), q[:, :, qh], kv_all,
                out[:, :, qh], lse[:, qh], rank, scale, causal, window[0], window[1],
                layout_code, doc_lengths=docs, dlse=None if dlse is None else dlse[:, qh],
                softcap=ctx.softcap, alibi_slopes=_heads(alibi_slopes, qh),
                prefix_len=ctx.prefix_len,
            )
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
        dsinks = _sink_grad(ctx, sinks, dout, out, lse, dlse)
        return (dq, dk, dv, *([None] * 12), dsinks)


class _LocalDocuments(torch.autograd.Function):
    """Attention over packed documents held whole by this process: the all-gather strategy's
    kernels on a "group" of one rank (contiguous layout: no padding)."""

    @staticmethod
    def forward(ctx, q, k, v, docs, scale, causal, window, softcap, alibi_slopes, sinks):
        kv_all = torch.cat([k, v], dim=-1)[None]  # (1, B, T, Hkv, D + Dv)
        out, lse = torch.ops.cpattn.gathered_fwd(
            q, kv_all, 0, scale, causal, window[0], window[1], LAYOUTS["contiguous"],
            doc_lengths=docs, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
        ctx.args = (docs, scale, causal, window, softcap)
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.attention_varlen")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
        docs, scale, causal, window, softcap = ctx.args
        dout = dout.contiguous()
        dq, dkv_all = torch.ops.cpattn.gathered_bwd(
            dout, q, torch.cat([k, v], dim=-1)[None], out, lse, 0, scale, causal, window[0],
            window[1], LAYOUTS["contiguous"], doc_lengths=docs, dlse=dlse, softcap=softcap,
            alibi_slopes=alibi_slopes)
        d = k.shape[-1]
        dk, dv = dkv_all[0, ..., :d].to(k.dtype), dkv_all[0, ..., d:].to(v.dtype)
        return (dq, dk, dv, *([None] * 6), _sink_grad(ctx, sinks, dout, out, lse, dlse))


def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, causal: bool = False,
    softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
    return_lse: bool = False, sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed documents in one process (no communication): q (T, H, D), k / v
    (T, Hkv, D) hold the documents of cu_seqlens (int, D+1, from 0, ending at T) one after the
    other; a document never attends to another. Options as cpattn.attention, on positions
    within each document. Returns out (T, H, Dv) and optionally lse (H, T). Differentiable."""
    what = "cpattn.attention_varlen"
    (causal, _, scale, window), _ = _attention_args(what, q, k, v, causal, softmax_scale, window,
                                                   varlen=True)
    docs, tokens, _ = document_lengths(what, cu_seqlens)
    if tokens != q.shape[0]:
        raise error(what, "cu_seqlens", f"[..., {tokens}]", f"must end at the {q.shape[0]} "
                    "tokens of q")
    softcap, _ = check_score_options(what, softcap, alibi_slopes, 0)
    out, lse = _LocalDocuments.apply(q[None], k[None], v[None], docs, scale, causal, window,
                                     softcap, alibi_slopes, sinks)
    return (out[0], lse[0]) if return_lse else out[0]


def _heads(per_head: Optional[torch.Tensor], heads: slice) -> Optional[torch.Tensor]:
    """The entries of a per-head parameter (sinks, ALiBi slopes) for a slice of query heads."""
    return None if per_head is None else per_head[heads]


def _context_parallel(what, q, k, v, group, causal, layout, softmax_scale, window, timeout,
                      strategy, allgather_chunk, cu_seqlens, sinks=None, softcap=0.0,
                      alibi_slopes=None, prefix_len=0, seqlen=None, ring_chunk=None,
                      return_max_logits=False):
    """Shared by ring_attention and ring_attention_varlen (cu_seqlens given: q, k, v are 3-D):
    validation and the agreement check, then the strategy. Returns 4-D out and lse, and with
    return_max_logits each head's largest logit (cpattn.max_logits).
    `seqlen` (ring_attention): the real length of a sequence padded to the layout's granularity,
    handled as one document of that length."""
    group, rank, world = _group_info(group)
    timeout = check_timeout(what, timeout)

    def check():
        args, fields = _attention_args(what, q, k, v, causal, softmax_scale, window, layout,
                                       varlen=cu_seqlens is not None)
        check_choice(what, "strategy", strategy, tuple(STRATEGIES))
        chunk, r_chunk = (None if c is None else check_int(what, name, c, minimum=1)
                          for name, c in (("allgather_chunk", allgather_chunk),
                                          ("ring_chunk", ring_chunk)))
        docs = prefix_docs = None
        if cu_seqlens is not None:  # the exact boundaries, not a sum: other splits must not pass
            docs, tokens, raw = document_lengths(what, cu_seqlens)
            fields += [("documents", docs.numel()), ("tokens", tokens),
                       ("document_lengths", raw)]
            if isinstance(prefix_len, torch.Tensor):
                prefix_docs = check_prefix_per_document(what, prefix_len, docs)
                fields += [("prefix_per_document", digest_ints(prefix_docs))]
        elif isinstance(prefix_len, torch.Tensor):
            # A prefix per sequence of the batch: the batch runs as packed documents, one per
            # sequence (a sequence's shard is what per-document sharding gives it).
            n = q.shape[1] * world if seqlen is None else check_int(what, "seqlen", seqlen,
                                                                    minimum=1)
            docs = torch.full((q.shape[0],), n, dtype=torch.int64)
            prefix_docs = check_prefix_per_document(what, prefix_len, docs,
                                                    unit="sequence of the batch")
            fields += [("prefix_per_sequence", digest_ints(prefix_docs))]
        cap, prefix = check_score_options(what, softcap, alibi_slopes,
                                          0 if prefix_docs is not None else prefix_len)
        if r_chunk is not None and strategy == "allgather":  # never ignored: it saves memory
            raise error(what, "ring_chunk", r_chunk, 'sets the passes of strategy "ring" (or '
                        '"auto"); the all-gather takes allgather_chunk')
        fields += [("strategy", strategy), ("allgather_chunk", chunk), ("ring_chunk", r_chunk),
                   *score_fields(cap, alibi_slopes, sinks, prefix)]
        if seqlen is not None:
            n = check_int(what, "seqlen", seqlen, minimum=1)
            if padded_length(n, layout, world) != q.shape[1] * world:
                raise error(what, "seqlen", n, f"gives shards of "
                            f"{padded_length(n, layout, world) // world} tokens under the "
                            f"{layout} layout over {world} ranks, not {q.shape[1]}")
            if n != q.shape[1] * world and docs is None:  # padded: a document of length n
                docs = torch.tensor([n], dtype=torch.int64)
            fields += [("seqlen", n)]
        if strategy == "auto":  # the choice may only depend on what the ranks agree on
            fields += [("requires_grad", needs_grad(q, k, v))]
        max_logits = check_bool(what, "return_max_logits", return_max_logits)
        if max_logits and prefix_docs is not None:
            raise error(what, "return_max_logits", True, "is not supported with a prefix per "
                        "sequence or document (prefix_len a tensor)")
        fields += [("return_max_logits", max_logits)]
        return (*args, chunk, r_chunk, docs, prefix_docs, cap, prefix), fields

    (causal, layout_code, scale, window, chunk, ring_chunk, docs, prefix_docs, softcap,
     prefix_len) = agree_on(what, group, timeout, check)
    max_logits = None
    if return_max_logits:  # before q, k, v are reshaped below
        max_logits = _max_logits(q, k, group, world, layout, cu_seqlens, docs, seqlen, scale,
                                 causal, window, prefix_len)
    if cu_seqlens is not None:
        q, k, v = q[None], k[None], v[None]
    elif prefix_docs is not None:  # the batch as packed documents: (B, L, ..) -> (1, B L, ..)
        batch = q.shape[0]
        q, k, v = (t.flatten(0, 1)[None] for t in (q, k, v))
    if strategy == "auto":
        chosen = auto_strategy(q, k, world, group, causal, layout, window, docs, chunk,
                               ring_chunk, what)
        strategy = chosen.strategy
        if strategy == "ring":
            ring_chunk = chosen.chunk or None
    if prefix_docs is not None:  # the ops take the prefixes as a second row of the documents
        docs = torch.stack([docs, prefix_docs])
    if strategy == "ring":
        out, lse = _RingAttention.apply(q, k, v, group.group_name, scale, causal, window,
                                        layout_code, timeout, docs, softcap, alibi_slopes,
                                        prefix_len, ring_chunk or k.shape[2], sinks)
    else:
        chunk = chunk or plan.allgather_chunk(k.shape[2], world)
        out, lse = _GatheredAttention.apply(q, k, v, group, rank, world, scale, causal, window,
                                            layout_code, docs, chunk, softcap, alibi_slopes,
                                            prefix_len, sinks)
    if cu_seqlens is None and prefix_docs is not None:  # back to (B, L, ..) and (B, H, L)
        out = out.view(batch, -1, *out.shape[2:])
        lse = lse.view(lse.shape[1], batch, -1).transpose(0, 1)
    return (out, lse) if max_logits is None else (out, lse, max_logits)


def _max_logits(q, k, group, world, layout, cu_seqlens, docs, seqlen, scale, causal, window,
                prefix_len) -> torch.Tensor:
    """global_max_logits for ring_attention (a sequence, padded to the layout when seqlen is
    given) or ring_attention_varlen (the documents of cu_seqlens)."""
    if cu_seqlens is not None:
        return global_max_logits(q[None], k[None], group, document_placement(docs, layout, world),
                                 scale, causal, window, prefix_len)
    n = q.shape[1] * world if seqlen is None else seqlen
    return global_max_logits(q, k, group, sequence_placement(n, layout, world), scale, causal,
                             window, prefix_len)


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None,
    causal: bool = False, layout: str = "zigzag", softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1), return_lse: bool = False,
    strategy: str = "ring", allgather_chunk: Optional[int] = None, timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, prefix_len: Union[int, torch.Tensor] = 0,
    seqlen: Optional[int] = None, ring_chunk: Optional[int] = None,
    return_max_logits: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Args:
        q: this rank's queries (batch, seqlen / W, heads, head_dim), in `layout` order
            (see cpattn.shard / cpattn.positions).
        k, v: this rank's keys / values (batch, seqlen / W, kv_heads, head_dim); v may have its
            own head dim Dv (MLA-style, e.g. 192 / 128), out then has Dv.
        group: a torch.distributed process group (default: the world).
        causal, window, softmax_scale: as cpattn.attention, on global token positions.
        layout: "contiguous", "zigzag" (balanced for causal) or "striped".
        return_lse: also return the LSE (batch, heads, seqlen / W), float32.
        strategy: "ring" (K/V shards travel while each step computes: overlaps communication,
            memory per rank 1/W) or "allgather" (all-gather K/V, `allgather_chunk` KV heads at a
            time, default Hkv / (4 W), at least 1 (cpattn.plan.allgather_chunk: a gathered chunk
            is at most a quarter of the rank's own K/V); simplest, good for short sequences or
            few KV heads).
            "auto": the cost model (cpattn.plan) picks one of the two for this problem and
            machine, once per distinct problem, the same on every rank (logged at debug level).
        ring_chunk: KV heads per pass of the ring (default: all of them, one pass). Each pass
            runs the ring for its KV heads and their query heads only, so the ring's buffers and
            fp32 state (out, dq, the travelling dK/dV accumulators) shrink by the number of
            passes, for as many times more (smaller) messages. Strategy "ring" or "auto"; with
            "allgather" it raises (that strategy takes allgather_chunk).
        timeout: seconds to wait for a peer before raising (default $CPATTN_COMM_TIMEOUT or 300).
        sinks, softcap, alibi_slopes, prefix_len: as cpattn.attention, on global positions
            (the same values on every rank). A sink joins each row once, after every partial
            result is merged; the LSE returned includes it. The gradient of `sinks` on a rank is
            its own rows' share, like any parameter gradient under context parallelism: the
            usual gradient all-reduce over the group (as for the projection weights) sums it.
            prefix_len may also be an int64 tensor (batch,): one prefix per sequence of the
            batch (0 <= P_b <= seqlen); the batch then runs as packed documents, one per
            sequence (as ring_attention_varlen).
        seqlen: the global sequence length, for any length (default: W times the shard length).
            Shards of a length-S sequence from cpattn.shard are padded at the end to the
            layout's granularity (cpattn.positions); padding rows get out 0 and LSE -inf (with
            sinks: LSE = the sink) and padding keys are never attended to.

        return_max_logits: also return each head's largest logit softmax_scale * q_i . k_j
            over the visible pairs of the whole sequence ((heads,) float32, the same on every
            rank, no gradient; see cpattn.max_logits), last in the returned tuple.

    Every rank must call it with the same shapes and options; a mismatch raises on every rank
    (the agreement check, see cpattn.set_rank_check), as does a bad argument.
    CUDA tensors (bf16 / fp16) shift over cpattn's own NCCL communicator, bootstrapped through
    `group` and cached: call cpattn.destroy_communicators() before destroying the group.
    """
    out, lse, *max_logits = _context_parallel(
        "cpattn.ring_attention", q, k, v, group, causal, layout, softmax_scale, window, timeout,
        strategy, allgather_chunk, None, sinks, softcap, alibi_slopes, prefix_len, seqlen,
        ring_chunk, return_max_logits)
    return returned(out, lse if return_lse else None, max_logits)



def destroy_communicators() -> int:
    """Destroys the NCCL communicators that ring attention on CUDA tensors created (one per
    process group and device, cached across calls); returns how many. Call it before
    dist.destroy_process_group(); the next CUDA ring call makes a new one."""
    return int(torch.ops.cpattn.destroy_communicators())


def _document_lengths(cu_seqlens, what: str) -> torch.Tensor:
    return check_cu_seqlens(what, cu_seqlens).diff()


def ring_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, group=None,
    causal: bool = False, layout: str = "zigzag", softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1), return_lse: bool = False,
    strategy: str = "ring", allgather_chunk: Optional[int] = None, timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, prefix_len: Union[int, torch.Tensor] = 0,
    ring_chunk: Optional[int] = None, return_max_logits: bool = False,
) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Ring (or all-gather) attention over packed documents that never attend across each other.

    cu_seqlens: global document boundaries (int, D+1, from 0), the same on every rank. Each
    document is padded to a multiple of the layout's granularity (2W for zigzag, W otherwise)
    and sharded on its own (per-document zigzag), so documents straddle ranks.
    q (T_local, H, D), k/v (T_local, Hkv, D) come from cpattn.shard_varlen; padding tokens give
    output 0 and LSE -inf. Returns out (T_local, H, D) and optionally lse (H, T_local).
    sinks, softcap, alibi_slopes, ring_chunk: as ring_attention (ALiBi on positions within the
    document);
    prefix_len: an int, the same prefix for every document, or an int64 tensor (D,), one prefix
    per document (0 <= P_d <= its length, 0: none), on positions within the document.
    Padding rows with a sink: LSE = the sink. v may have its own head dim Dv (out then has Dv).
    return_max_logits: as ring_attention (positions within the documents).
    """
    out, lse, *max_logits = _context_parallel(
        "cpattn.ring_attention_varlen", q, k, v, group, causal, layout, softmax_scale, window,
        timeout, strategy, allgather_chunk, cu_seqlens, sinks, softcap, alibi_slopes,
        prefix_len, ring_chunk=ring_chunk, return_max_logits=return_max_logits)
    return returned(out[0], lse[0] if return_lse else None, max_logits)


def positions_varlen(
    cu_seqlens,
    *,
    group=None,
    layout: str = "zigzag",
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For each local token of the varlen sharding: (index into the packed global sequence, or -1
    for padding; position within its document, e.g. for RoPE)."""
    rank, world_size = rank_and_world(group, rank, world_size)
    docs = _document_lengths(cu_seqlens, "cpattn.positions_varlen")
    return document_positions(docs, layout, world_size, rank)


def shard_varlen(x: torch.Tensor, cu_seqlens, *, group=None, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """This rank's tokens of the packed tensor x (documents padded with zeros on the fly)."""
    index, _ = positions_varlen(cu_seqlens, group=group, layout=layout)
    padded = torch.cat([x, x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1 :]))], dim)
    return padded.index_select(dim, torch.where(index < 0, x.shape[dim], index).to(x.device))


def unshard_varlen(x_local: torch.Tensor, cu_seqlens, *, group=None, layout: str = "zigzag",
                   dim: int = 0) -> torch.Tensor:
    """All-gathers a varlen shard back into the packed sequence (padding dropped).
    Differentiable."""
    what = "cpattn.unshard_varlen"

    def locate(local: int, world: int) -> tuple[torch.Tensor, int, Fields]:
        docs = _document_lengths(cu_seqlens, what)
        check_choice(what, "layout", layout, tuple(LAYOUTS))
        index, _ = positions_varlen(cu_seqlens, group=group, layout=layout)
        return index, int(docs.sum()), [("layout", layout), ("cu_seqlens", digest_ints(docs))]

    return _unshard(what, x_local, group, dim, locate)


def pad_documents(x: torch.Tensor, cu_seqlens, multiple: int, dim: int = 0):
    """Pads every document of the packed x with zeros to a multiple of `multiple` tokens.
    Returns (x_padded, cu_seqlens_padded)."""
    docs = _document_lengths(cu_seqlens, "cpattn.pad_documents")
    pieces, lengths, start = [], [], 0
    for n in docs.tolist():
        padded = round_up(n, multiple)
        pieces.append(x.narrow(dim, start, n))
        pieces.append(x.new_zeros((*x.shape[:dim], padded - n, *x.shape[dim + 1 :])))
        lengths.append(padded)
        start += n
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return torch.cat(pieces, dim), cu


def ring_attention_emulated(
    q: list,
    k: list,
    v: list,
    *,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1),
    strategy: str = "ring",
) -> tuple[list, list]:
    """W ranks emulated in this process; lists hold one shard per rank. Returns (outs, lses).

    strategy "ring": one thread per rank exchanging K/V through an in-process mailbox (the same
    driver as real ranks, bitwise the same results; on CUDA tensors each virtual rank computes
    on its own stream and receives on its own comm stream, ordered by events as with NCCL).
    "allgather": every rank's steps against the stacked shards. "ulysses": the all-to-alls done
    by concatenation; Ulysses shards contiguously, so it needs layout="contiguous".
    Forward only; for tests and single-device experiments.
    """
    from cpattn.attention import attention

    what = "cpattn.ring_attention_emulated"
    check_choice(what, "strategy", strategy, ("ring", "allgather", "ulysses"))
    check_choice(what, "layout", layout, tuple(LAYOUTS))
    if strategy == "ulysses" and layout != "contiguous":
        raise ValueError(f"{what}: layout={layout!r}: strategy='ulysses' shards the sequence "
                         "contiguously, so it needs layout='contiguous'")
    window = check_window(window, what)
    softmax_scale = check_scale(what, softmax_scale, q[0].shape[-1])
    args = (float(softmax_scale), bool(causal), window[0], window[1])
    if strategy == "ring":
        outs, lses = torch.ops.cpattn_testing.ring_fwd_emulated(q, k, v, *args, layout_code(layout))
        return list(outs), list(lses)
    world = len(q)
    if strategy == "allgather":
        kv_all = torch.stack([torch.cat([kr, vr], dim=-1) for kr, vr in zip(k, v)])
        results = [torch.ops.cpattn.gathered_fwd(q[r], kv_all, r, *args, layout_code(layout))
                   for r in range(world)]
        return [o for o, _ in results], [lse for _, lse in results]
    if q[0].shape[2] % world != 0:
        raise ValueError(f"{what}: heads={q[0].shape[2]}: strategy='ulysses' needs heads "
                         f"divisible by the number of ranks ({world})")
    full_q, full_k, full_v = (torch.cat(t, dim=1) for t in (q, k, v))
    heads = full_q.shape[2]
    idx = kv_heads_for_ranks(heads, full_k.shape[2], world)
    if idx is not None:
        full_k, full_v = full_k[:, :, idx], full_v[:, :, idx]
    per_rank, kv_per_rank = heads // world, full_k.shape[2] // world
    outs, lses = [], []
    for r in range(world):  # rank r: all tokens, its heads
        qh = slice(r * per_rank, (r + 1) * per_rank)
        kh = slice(r * kv_per_rank, (r + 1) * kv_per_rank)
        out, lse = attention(full_q[:, :, qh], full_k[:, :, kh], full_v[:, :, kh],
                             causal=causal, softmax_scale=softmax_scale, window=window,
                             return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=1)
    return list(out.chunk(world, dim=1)), list(lse.chunk(world, dim=2))
