"""Inference with context parallelism: a KV cache sharded over the ranks, prefill of prompt chunks
through the ring, and decode steps that merge per-rank partial attention exactly.

Token t of a sequence is stored by rank (t // interleave) % W only (csrc/include/cpattn/kv_cache.h),
so each rank holds about 1/W of every sequence's K/V. A decode step computes each rank's partial
attention over its shard (with the causal rule on global positions) and merges the W partials with
their log-sum-exp: it communicates outputs and LSEs (B x Sq x H x (D + 1) numbers per layer),
never K/V. Prefill runs the ring over the new chunk (which also fills the owners' caches, at no
extra communication) and, for a chunk after earlier ones, merges in the attention of the chunk's
queries to the cached tokens the same way decode does.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn.comm import all_gather_flat
from cpattn.core.agreement import agree_on
from cpattn.core.device import to_device
from cpattn.core.layout import LAYOUTS, check_chunk, padded_length
from cpattn.core.options import AttentionOptions
from cpattn.core.signature import tensor_fields
from cpattn.core.validation import (
    check_choice,
    check_int,
    check_qkv,
    check_tensor,
    check_timeout,
    error,
    group_info,
)
from cpattn.inference import invariant_cache
from cpattn.inference.kv_cache import KVCacheShard, check_cache_type, pack_partial, unpack_partials
from cpattn.invariant.global_order import gather_global
from cpattn.sharding.sequences import positions

ops = torch.ops.cpattn
COMMS = ("all_gather", "reduce_scatter")


# ---------------------------------------------------------------------------------------------
# Helpers


def merge_attention_states(
    outs: Union[torch.Tensor, Sequence[torch.Tensor]],
    lses: Union[torch.Tensor, Sequence[torch.Tensor]],
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges N partial attention results over disjoint key sets, exactly.

    Args:
        outs: N outputs (batch, seqlen, heads, head_dim), any float dtype, as a sequence or
            stacked (N, batch, seqlen, heads, head_dim).
        lses: their LSEs (batch, heads, seqlen) float32, as a sequence or stacked.
        out_dtype: dtype of the merged out (default: that of outs).

    Returns (out, lse): computed in float32 with the -inf safe merge (a row empty in every part
    stays out 0, lse -inf); out cast once to out_dtype. Differentiable in outs and lses.
    """
    if not isinstance(outs, torch.Tensor):
        outs = torch.stack(list(outs))
    if not isinstance(lses, torch.Tensor):
        lses = torch.stack(list(lses))
    return ops.merge_attention_states(outs, lses, out_dtype)


def _wait(work, on_host: bool, timeout: float, what: str) -> None:
    """Waits for a collective of CPU tensors up to `timeout`. One of GPU tensors is only ordered
    before the current stream's later work (a timed wait would block the host until the device
    is done, every layer); the process group's own watchdog times it out."""
    if not on_host:
        work.wait()
    elif not work.wait(timeout=datetime.timedelta(seconds=timeout)):
        raise RuntimeError(f"{what}: peers did not answer within {timeout} s")


def _all_gather(msg: torch.Tensor, group, world: int, timeout: float, what: str) -> torch.Tensor:
    """(B, ...) on every rank -> (W, B, ...)."""
    recv = msg.new_empty((world * msg.shape[0], *msg.shape[1:]))
    _wait(all_gather_flat(recv, msg.contiguous(), group=group, async_op=True), msg.is_cpu,
          timeout, what)
    return recv.view(world, *msg.shape)


def _all_to_all(send: torch.Tensor, group, timeout: float, what: str) -> torch.Tensor:
    """send[s] goes to rank s; returns recv with recv[s] from rank s."""
    recv = torch.empty_like(send)
    _wait(dist.all_to_all_single(recv, send, group=group, async_op=True), send.is_cpu, timeout,
          what)
    return recv


# ---------------------------------------------------------------------------------------------
# Prefill and decode


def _check_sinks(
    sinks: Optional[torch.Tensor], q: torch.Tensor, what: str
) -> Optional[torch.Tensor]:
    """(heads,) float sink logits, detached (inference is forward only), or None."""
    if sinks is None:
        return None
    heads = q.shape[2]
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != heads or (
            not sinks.is_floating_point()):
        raise error(what, "sinks", sinks, f"must be a float tensor of shape (heads,) = ({heads},)")
    return sinks.detach()


def _causal_options(what: str, q: torch.Tensor, options: dict) -> AttentionOptions:
    """The options of a prefill or decode call (causal, no choice), the sinks detached."""
    opts = AttentionOptions.checked(what, q.shape[-1], {"causal": True}, **options)
    return opts.replace(sinks=_check_sinks(opts.sinks, q, what))


def _finish(out: torch.Tensor, lse: torch.Tensor, sinks: Optional[torch.Tensor],
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """After the last merge (fp32 out): the sinks join each row once; out cast to dtype."""
    if sinks is not None:
        out, lse = out.clone(), lse.clone()
        ops.apply_sinks_(out, lse, sinks)
    return out.to(dtype), lse


# ---------------------------------------------------------------------------------------------
# Invariant mode (invariant=True): the cache's blocks of key tiles (invariant_cache.py).

def _invariant_prefill(q, k, v, cache, group, rank, world, layout, n, timeout, opts, what):
    """prefill_attention(invariant=True): the chunk's K/V gathered and stored by their owners,
    then every rank's blocks for all the chunk's queries, sent to the ranks holding them."""
    code = LAYOUTS[layout]
    start = cache.lengths.tolist()
    k_all, v_all, q_all = (t[:, :n] for t in gather_global([k, v, q], 1, group, rank, world, code))
    cache.append(k_all, v_all)
    parts = invariant_cache.owned_blocks(q_all, cache, start, opts)  # (slots, B, n, H, D + 1)
    # each rank's rows, in its layout order (padding rows: empty)
    index = torch.cat([positions(n, layout=layout, rank=r, world_size=world)
                       for r in range(world)])
    parts = torch.cat([parts, torch.zeros_like(parts[:, :, :1])], 2)
    parts[:, :, -1, :, -1] = float("-inf")
    send = parts.index_select(2, torch.where(index < 0, n, index))
    send = send.unflatten(2, (world, q.shape[1])).permute(2, 0, 1, 3, 4, 5).contiguous()
    recv = _all_to_all(send, group, timeout, what)
    out, lse = invariant_cache.merge_blocks(recv, cache, opts.sinks, q.dtype)
    return out, lse


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCacheShard, *, group=None,
    layout: str = "zigzag", seqlen: Optional[int] = None, timeout: Optional[float] = None,
    return_lse: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Causal attention for a chunk of C prompt tokens per sequence, sharded over the ranks, that
    also stores the chunk's K/V in the owners' cache shards.

    The chunk follows the tokens already in the cache: its token at chunk position c of sequence
    b is at global position cache.lengths[b] + c (use that for RoPE). Chunked prefill (a chunk
    after earlier ones) is exact: the chunk's queries also attend to every cached token.

    Args:
        q: this rank's queries of the chunk (batch, C / W, heads, head_dim) in `layout` order
            (cpattn.shard / cpattn.positions on a length-C chunk).
        k, v: this rank's keys / values of the chunk (batch, C / W, kv_heads, head_dim).
        cache: this rank's KVCacheShard (e.g. cache.sequences(i, i + 1) for one sequence).
        layout: "contiguous", "zigzag" (balanced for causal) or "striped"; C must be a multiple of
            W (2 W for zigzag). Shorter tails go through decode_attention (append, then Sq > 1).
        return_lse: also return the LSE (batch, heads, C / W) float32.
        timeout: seconds to wait for a peer (default $CPATTN_COMM_TIMEOUT, else the
            process group's own timeout).
        **options: the attention options of cpattn.attention but causal (a prefill is causal),
            on global positions (the sequence's, counted from its first cached token). sinks
            join each row once, after the ring's and the cached tokens' partials are merged. A
            prefix that reaches into the chunk needs every sequence of the batch at the same
            cache length. window: (left, right) with the causal rule: query i sees the chunk's
            and the cached keys j with i - left <= j <= i (left = n - 1 for a model's sliding
            window of n tokens).
        seqlen: the chunk's length C, for any length (default: W times the shard length): the
            shards of cpattn.shard on a length-C chunk are padded at its end to the layout's
            granularity (cpattn.positions(C) marks the padding -1); padding rows get out 0 and
            LSE -inf (with sinks: the sink), padding tokens are never attended to nor stored,
            and the cache grows by C.

    Returns this rank's out (batch, C / W, heads, head_dim) in q's dtype. Forward only. Every rank
    must call it with the same shapes and options; a mismatch or a full cache raises on every rank.
    """
    what = "cpattn.prefill_attention"
    group, rank, world = group_info(group)
    timeout = check_timeout(what, timeout, group)

    def check():
        check_qkv(what, q, k, v)
        check_choice(what, "layout", layout, tuple(LAYOUTS))
        check_cache_type(cache, what)
        opts = _causal_options(what, q, options)
        prefix = opts.prefix_len
        padded = q.shape[1] * world
        n = padded if seqlen is None else check_int(what, "seqlen", seqlen, minimum=1)
        if seqlen is None:  # any length: seqlen=
            check_chunk(what, padded, layout, world, per_rank=q.shape[1])
        if padded_length(n, layout, world) != padded:
            raise error(what, "seqlen", n, f"gives shards of "
                        f"{padded_length(n, layout, world) // world} tokens under the {layout} "
                        f"layout over {world} ranks, not {q.shape[1]}")
        if opts.invariant:
            invariant_cache.check_cache(what, q, cache)
        # the ring runs on positions within the chunk: the prefix's end relative to it
        ring_prefix = (prefix - cache.lengths).clamp(min=0).unique().tolist() if prefix else [0]
        if len(ring_prefix) > 1 and not opts.invariant:
            raise error(what, "prefix_len", prefix, "reaches into this chunk at different "
                        "positions of the batch's sequences (their cache lengths differ): "
                        "prefill them one at a time (cache.sequences(i, i + 1))")
        return (opts, ring_prefix[0], n), [
            *tensor_fields("q", q), *tensor_fields("k", k), *tensor_fields("v", v),
            ("layout", layout), *cache.agreement_fields(rank), *opts.agreement_fields(),
            ("seqlen", n)]

    opts, ring_prefix, n = agree_on(what, group, timeout, check)
    cache.check_group(rank, world, what)
    cache.check_query(q, what)
    chunk = q.shape[1] * world  # padded to the layout's granularity: n real tokens
    cache.check_room(n, what)
    if opts.invariant:
        out, lse = _invariant_prefill(q, k, v, cache, group, rank, world, layout, n, timeout,
                                      opts, what)
        return (out, lse) if return_lse else out

    start = cache.lengths.clone()
    parts_out, parts_lse = [], []
    if bool((start > 0).any()):
        # Every query of the chunk may see cached tokens. Each rank attends all the chunk's
        # queries to its shard, then sends each rank the partials of that rank's queries.
        q_all = _all_gather(q, group, world, timeout, what)  # (W, B, C / W, H, D)
        q_all = q_all.transpose(0, 1).reshape(q.shape[0], chunk, *q.shape[2:])
        # in chunk order (row c at position start + c, for ALiBi's distances), then back to the
        # ranks' order for the all-to-all
        order = to_device(torch.cat([positions(chunk, layout=layout, rank=r, world_size=world)
                                     for r in range(world)]), q.device)
        po, pl = ops.cache_attention_fwd(
            q_all.index_select(1, order.argsort()), cache.k, cache.v, start, start, rank, world,
            cache.interleave, torch.float32, **opts.op_kwargs())
        po, pl = po.index_select(1, order), pl.index_select(2, order)
        msg = pack_partial(po, pl).view(q.shape[0], world, q.shape[1], q.shape[2],
                                        q.shape[3] + 1)
        recv = _all_to_all(msg.transpose(0, 1).contiguous(), group, timeout, what)
        parts_out, parts_lse = unpack_partials(recv)
    # the ring on positions within the chunk: ALiBi depends on position differences only
    ring_out, ring_lse = ops.prefill_fwd(
        q, k, v, cache.k, cache.v, start, group.group_name, LAYOUTS[layout], cache.interleave,
        timeout, n, **opts.replace(prefix_len=ring_prefix).op_kwargs())
    cache.lengths += n
    if len(parts_out):
        out, lse = merge_attention_states(
            torch.cat([ring_out[None], parts_out]), torch.cat([ring_lse[None], parts_lse]),
            out_dtype=torch.float32,
        )
        if n != chunk:  # the cached tokens' partials of padding rows: dropped
            padding = to_device(positions(n, layout=layout, rank=rank, world_size=world) < 0,
                                q.device)  # (masked_fill: a boolean index would sync the host)
            out.masked_fill_(padding[None, :, None, None], 0.0)
            lse.masked_fill_(padding[None, None, :], float("-inf"))
    else:
        out, lse = ring_out, ring_lse  # prefill_fwd returns fp32
    out, lse = _finish(out, lse, opts.sinks, q.dtype)
    return (out, lse) if return_lse else out


def decode_attention(
    q: torch.Tensor, cache: KVCacheShard, *, group=None, comm: str = "all_gather",
    timeout: Optional[float] = None, validate: bool = True, return_lse: bool = False,
    **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Exact causal attention of the newest Sq tokens of each sequence over the sharded cache.

    Append the new tokens' K/V first (cache.append, the same on every rank); query row i of
    sequence b then sits at global position cache.lengths[b] - Sq + i and sees the keys at
    positions <= its own (Sq > 1: speculative decoding, or a prompt tail).

    Args:
        q: (batch, Sq, heads, head_dim), the same on every rank, in the cache's dtype.
        cache: this rank's KVCacheShard.
        comm: how the per-rank partial results are merged:
            "all_gather": all-gather every rank's (out, lse), merge locally; out is replicated,
                (batch, Sq, heads, head_dim).
            "reduce_scatter": each rank receives every rank's partials for its heads only and
                merges them: out (batch, Sq, heads / W, head_dim) for heads
                [rank * heads / W, (rank + 1) * heads / W), ready for a tensor-parallel output
                projection. Needs heads % W == 0.
        return_lse: also return the LSE (batch, heads or heads / W, Sq) float32.
        timeout: seconds to wait for a peer (default $CPATTN_COMM_TIMEOUT, else the
            process group's own timeout).
        validate: run the cross-rank agreement check (cpattn.set_rank_check: one small
            all-gather, a mismatch then raises on every rank). It is a second collective per
            call; without it a mismatch is a timeout or a wrong result. The arguments are
            validated locally either way.
        **options: the attention options of cpattn.attention but causal (decode is causal), on
            global positions (query row i at cache.lengths[b] - Sq + i); each rank's partial
            over its keys applies them. sinks join each row once, after the W partials are
            merged, whatever W (with "reduce_scatter", the rank's heads'). With ALiBi or a
            prefix the cache shard is visited in runs of `interleave` tokens. window: (left,
            right) with the causal rule: query row i sees the keys at positions i - left .. i
            (left = n - 1 for a model's sliding window of n tokens); the cache keeps every
            token, the window only masks.

    The partials travel and merge in float32; out is cast to q's dtype once. Forward only.
    A rank whose shard holds none of a sequence's tokens contributes an empty partial (lse -inf).
    """
    what = "cpattn.decode_attention"
    group, rank, world = group_info(group)
    timeout = check_timeout(what, timeout, group)

    def check():
        check_tensor(what, "q", q, ("batch", "seqlen_q", "heads", "head_dim"))
        check_choice(what, "comm", comm, COMMS)
        check_cache_type(cache, what)
        opts = _causal_options(what, q, options)
        if opts.invariant:
            invariant_cache.check_cache(what, q, cache)
        return opts, [*tensor_fields("q", q), ("comm", comm), *cache.agreement_fields(rank),
                      *opts.agreement_fields()]

    opts = agree_on(what, group, timeout, check) if validate else check()[0]
    sinks = opts.sinks
    cache.check_group(rank, world, what)
    cache.check_query(q, what)
    b, sq, h, d = q.shape
    short = (cache.lengths < sq).nonzero().flatten().tolist()
    if short:
        raise ValueError(
            f"{what}: sequence {cache.first_sequence + short[0]} holds "
            f"{int(cache.lengths[short[0]])} tokens, fewer than "
            f"the {sq} queries: append the new tokens' K/V (cache.append) before attending"
        )
    if comm == "reduce_scatter" and h % world != 0:
        raise ValueError(
            f"{what}: comm='reduce_scatter' splits the {h} heads over {world} ranks: heads must be "
            f"a multiple of the world size"
        )

    if opts.invariant:  # every rank's blocks, merged in the tile tree's order
        parts = invariant_cache.owned_blocks(q, cache, (cache.lengths - sq).tolist(), opts)
        if world == 1:
            parts = parts[None]
        elif comm == "all_gather":
            parts = _all_gather(parts, group, world, timeout, what)
        else:  # this rank's heads of every rank's blocks
            send = parts.unflatten(3, (world, h // world)).permute(3, 0, 1, 2, 4, 5).contiguous()
            parts = _all_to_all(send, group, timeout, what)
            if sinks is not None:
                sinks = sinks[rank * h // world:(rank + 1) * h // world]
        out, lse = invariant_cache.merge_blocks(parts, cache, sinks, q.dtype)
        return (out, lse) if return_lse else out
    po, pl = ops.cache_attention_fwd(
        q, cache.k, cache.v, cache.lengths, cache.lengths - sq, rank, world, cache.interleave,
        torch.float32, **opts.op_kwargs())
    if world == 1:
        out, lse = po, pl
    elif comm == "all_gather":
        outs, lses = unpack_partials(_all_gather(pack_partial(po, pl), group, world, timeout,
                                                 what))
        out, lse = merge_attention_states(outs, lses, out_dtype=torch.float32)
    else:
        msg = pack_partial(po, pl).view(b, sq, world, h // world, d + 1)
        outs, lses = unpack_partials(_all_to_all(msg.permute(2, 0, 1, 3, 4).contiguous(), group,
                                                 timeout, what))
        out, lse = merge_attention_states(outs, lses, out_dtype=torch.float32)
        if sinks is not None:
            sinks = sinks[rank * h // world:(rank + 1) * h // world]
    out, lse = _finish(out, lse, sinks, q.dtype)
    return (out, lse) if return_lse else out


def chunk_positions(
    cache: KVCacheShard, chunk: int, *, layout: str = "zigzag", group=None
) -> torch.Tensor:
    """Global positions (int64, (batch, padded chunk / W)) of this rank's tokens of the next
    prefill chunk of length `chunk`: cache.lengths[b] + the layout's positions (e.g. for RoPE);
    any length: -1 for the padding slots (see prefill_attention's seqlen)."""
    local = positions(chunk, group=group, layout=layout, rank=cache.rank,
                      world_size=cache.world_size)
    return torch.where(local[None, :] >= 0, cache.lengths[:, None] + local[None, :], -1)
