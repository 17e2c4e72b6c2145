"""Ulysses (all-to-all sequence <-> heads) attention and the hybrid Ulysses-inside, ring-across.

Ulysses: each rank holds a contiguous sequence shard of all heads; one all-to-all gives it the
whole sequence for H / W heads, local attention runs, and a second all-to-all brings the output
back to sequence shards. Communication per rank is ~4 tensors of its shard size, independent of
W, over all-to-all links; it needs H % W == 0.
"""

from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn._agreement import agree_on, score_fields
from cpattn._validation import check_int, check_score_options, check_timeout, error
from cpattn.attention import attention
from cpattn.ring import _attention_args, _group_info, _padded_length, positions, ring_attention


def _kv_heads_for_ranks(heads: int, kv_heads: int, world: int) -> Optional[list]:
    """KV heads to send so that after the all-to-all rank r holds the KV heads of its query heads
    [r * H/W, (r+1) * H/W), with a uniform group size. None: send K/V as they are."""
    per_rank = heads // world
    group = heads // kv_heads
    if kv_heads % world == 0:
        return None  # each rank gets kv_heads / W heads, group size unchanged
    if group % per_rank == 0:
        # all query heads of a rank share one KV head: replicate it W / kv_heads times
        return [(r * per_rank) // group for r in range(world)]
    # otherwise one KV head per query head (group size 1)
    return [h // group for h in range(heads)]


def _scatter_heads(q, k, v, group):
    world = dist.get_world_size(group)
    heads, kv_heads = q.shape[2], k.shape[2]
    idx = _kv_heads_for_ranks(heads, kv_heads, world)
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


def _check_seqlen(what: str, seqlen, padded: int, rule: Callable[[int], int]) -> int:
    """The real sequence length (default: every token is real): `rule(seqlen)` must give
    `padded`, the number of tokens the shards hold in all."""
    if seqlen is None:
        return padded
    n = check_int(what, "seqlen", seqlen, minimum=1)
    if rule(n) != padded:
        raise error(what, "seqlen", n, f"gives {rule(n)} tokens in all once padded (see "
                    f"cpattn.positions), but the shards hold {padded}")
    return n


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


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    prefix_len: int = 0,
    seqlen: Optional[int] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded contiguously (rank r holds tokens
    [r*S/W, (r+1)*S/W)) by all-to-all between sequence and head shards.

    q (B, S/W, H, D), k/v (B, S/W, Hkv, D); H % W == 0. GQA: when Hkv % W == 0 each rank receives
    Hkv / W KV heads; otherwise the KV heads a rank needs are replicated before the all-to-all:
    one per rank when a rank's H/W query heads share one KV head (K/V traffic x W / Hkv), else one
    per query head (K/V traffic x H / Hkv). Returns out (B, S/W, H, Dv) and optionally the LSE
    (B, H, S/W). Differentiable. v may have its own head dim Dv.
    sinks, softcap, alibi_slopes, prefix_len: as cpattn.attention on global positions; each rank
    uses the sinks / slopes of the heads it computes, so the gradient of `sinks` on a rank is
    its heads' share (summed over the group by the usual parameter-gradient all-reduce).
    seqlen: the global sequence length, for any length (default: W times the shard length):
    cpattn.shard(x, layout="contiguous") pads a length-S sequence at its end to a multiple of W
    (cpattn.positions marks the padding with -1); padding rows get out 0 and LSE -inf (with
    sinks: the sink), padding keys are never attended to; cpattn.unshard(..., seqlen=S).
    """
    what = "cpattn.ulysses_attention"
    group, _, world = _group_info(group)
    timeout = check_timeout(what, timeout)

    def check():
        args, fields = _attention_args(what, q, k, v, causal, softmax_scale, window)
        _check_heads(what, q, world)
        cap, prefix = check_score_options(what, softcap, alibi_slopes, prefix_len)
        n = _check_seqlen(what, seqlen, q.shape[1] * world,
                          lambda n: _padded_length(n, "contiguous", world))
        return (*args, cap, prefix, n), [*fields, *score_fields(cap, alibi_slopes, sinks, prefix),
                                         ("seqlen", n)]

    causal, _, softmax_scale, window, softcap, prefix_len, n = agree_on(what, group, timeout,
                                                                       check)
    qh, kh, vh = _scatter_heads(q, k, v, group)
    heads = q.shape[2]
    my_sinks = _my_heads(sinks, heads, group)
    # the whole sequence is here now: attention over its real tokens only, padding rows after
    out_h, lse_h = attention(qh[:, :n], kh[:, :n], vh[:, :n], causal=causal,
                             softmax_scale=softmax_scale, window=window, return_lse=True,
                             softcap=softcap, sinks=my_sinks,
                             alibi_slopes=_my_heads(alibi_slopes, heads, group),
                             prefix_len=prefix_len)
    out_h, lse_h = _pad_rows(out_h, lse_h, qh.shape[1], my_sinks)
    out = comm.all_to_all(out_h, scatter_dim=1, gather_dim=2, group=group)
    if not return_lse:
        return out
    return out, comm.all_to_all(lse_h, scatter_dim=2, gather_dim=1, group=group)


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    ulysses_group=None,
    ring_group=None,
    mesh=None,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    timeout: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    prefix_len: int = 0,
    seqlen: Optional[int] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Ulysses inside `ulysses_group` (size U), ring across `ring_group` (size R), W = U * R.

    Alternatively `mesh`: a 2D DeviceMesh whose dim 0 is the ring and dim 1 is Ulysses.
    Sharding (see cpattn.hybrid_positions / hybrid_shard): the sequence is split over the R ring
    ranks by `layout`; the rank at ring index i and Ulysses index u holds the u-th contiguous
    sub-chunk of ring shard i. H % U == 0. Either group may have size 1.
    sinks, softcap, alibi_slopes, prefix_len: as ulysses_attention (per-head ones sliced to the
    rank's heads, then as ring_attention across the ring).
    seqlen: the global sequence length, for any length (default: W times the shard length):
    hybrid_shard pads as hybrid_positions says; padding rows get out 0 and LSE -inf (with
    sinks: the sink); hybrid_unshard(..., seqlen=S) gives S tokens back.
    """
    if mesh is not None:
        ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    if ulysses_group is None or ring_group is None:
        raise ValueError("cpattn.hybrid_attention: give ulysses_group and ring_group, or a 2D mesh")
    what = "cpattn.hybrid_attention"
    u_world = dist.get_world_size(ulysses_group)
    timeout = check_timeout(what, timeout)
    ring_world = dist.get_world_size(ring_group)

    def check():
        args, fields = _attention_args(what, q, k, v, causal, softmax_scale, window, layout)
        _check_heads(what, q, u_world)
        cap, prefix = check_score_options(what, softcap, alibi_slopes, prefix_len)
        n = _check_seqlen(what, seqlen, q.shape[1] * u_world * ring_world,
                          lambda n: _hybrid_ring_shard(n, layout, ring_world, u_world)[1]
                          * ring_world)
        return (*args, cap, prefix, n), [*fields, *score_fields(cap, alibi_slopes, sinks, prefix),
                                         ("seqlen", n)]

    causal, _, softmax_scale, window, softcap, prefix_len, n = agree_on(what, ulysses_group,
                                                                       timeout, check)
    qh, kh, vh = _scatter_heads(q, k, v, ulysses_group)
    heads = q.shape[2]
    # this rank's ring shard of the sequence padded for the ring, then for Ulysses: the ring
    # gets the first, the Ulysses padding rows come back as 0 / -inf
    ring_shard, _ = _hybrid_ring_shard(n, layout, ring_world, u_world)
    my_sinks = _my_heads(sinks, heads, ulysses_group)
    out_h, lse_h = ring_attention(qh[:, :ring_shard], kh[:, :ring_shard], vh[:, :ring_shard],
                                  group=ring_group, causal=causal, layout=layout,
                                  softmax_scale=softmax_scale, window=window, return_lse=True,
                                  timeout=timeout, softcap=softcap, sinks=my_sinks,
                                  alibi_slopes=_my_heads(alibi_slopes, heads, ulysses_group),
                                  prefix_len=prefix_len, seqlen=n)
    out_h, lse_h = _pad_rows(out_h, lse_h, qh.shape[1], my_sinks)
    out = comm.all_to_all(out_h, scatter_dim=1, gather_dim=2, group=ulysses_group)
    if not return_lse:
        return out
    return out, comm.all_to_all(lse_h, scatter_dim=2, gather_dim=1, group=ulysses_group)


def _hybrid_ring_shard(seqlen: int, layout: str, r_world: int, u_world: int) -> tuple[int, int]:
    """(tokens of a ring shard of the sequence padded to the layout's granularity over the ring,
    that number padded to a multiple of U): hybrid's two paddings."""
    ring_shard = _padded_length(seqlen, layout, r_world) // r_world
    return ring_shard, -(-ring_shard // u_world) * u_world


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
    from cpattn.ring import shard

    idx = hybrid_positions(x.shape[dim], ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout)
    return shard(x, index=idx, dim=dim)


def hybrid_unshard(x_local: torch.Tensor, *, ulysses_group, ring_group, layout: str = "zigzag",
                   dim: int = 1, group=None, seqlen: Optional[int] = None) -> torch.Tensor:
    """Inverse of hybrid_shard over `group` (default: the world, which must hold exactly the
    ranks of the mesh). `seqlen`: the real length (default: W times the shard length); the
    padding slots are dropped. Differentiable."""
    from cpattn.ring import unshard

    world = dist.get_world_size(ulysses_group) * dist.get_world_size(ring_group)
    if seqlen is None:
        seqlen = x_local.shape[dim] * world
    idx = hybrid_positions(seqlen, ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout)
    if idx.numel() != x_local.shape[dim]:
        raise error("cpattn.hybrid_unshard", "seqlen", seqlen, f"gives shards of {idx.numel()} "
                    f"tokens, not {x_local.shape[dim]}")
    return unshard(x_local, group=group, index=idx, seqlen=seqlen, dim=dim)
