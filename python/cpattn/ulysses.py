"""Ulysses (all-to-all sequence <-> heads) attention and the hybrid Ulysses-inside, ring-across.

Ulysses: each rank holds a contiguous sequence shard of all heads; one all-to-all gives it the
whole sequence for H / W heads, local attention runs, and a second all-to-all brings the output
back to sequence shards. Communication per rank is ~4 tensors of its shard size, independent of
W, over all-to-all links; it needs H % W == 0.
"""

from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn._agreement import agree_on
from cpattn._validation import check_timeout, error
from cpattn.attention import attention
from cpattn.ring import _attention_args, _group_info, ring_attention


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
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded contiguously (rank r holds tokens
    [r*S/W, (r+1)*S/W)) by all-to-all between sequence and head shards.

    q (B, S/W, H, D), k/v (B, S/W, Hkv, D); H % W == 0. GQA: when Hkv % W == 0 each rank receives
    Hkv / W KV heads; otherwise the KV heads a rank needs are replicated before the all-to-all:
    one per rank when a rank's H/W query heads share one KV head (K/V traffic x W / Hkv), else one
    per query head (K/V traffic x H / Hkv). Returns out (B, S/W, H, D) and optionally the LSE
    (B, H, S/W). Differentiable.
    """
    what = "cpattn.ulysses_attention"
    group, _, world = _group_info(group)
    timeout = check_timeout(what, timeout)

    def check():
        args, fields = _attention_args(what, q, k, v, causal, softmax_scale, window)
        _check_heads(what, q, world)
        return args, fields

    causal, _, softmax_scale, window = agree_on(what, group, timeout, check)
    qh, kh, vh = _scatter_heads(q, k, v, group)
    out_h, lse_h = attention(qh, kh, vh, causal=causal, softmax_scale=softmax_scale,
                             window=window, return_lse=True)
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
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Ulysses inside `ulysses_group` (size U), ring across `ring_group` (size R), W = U * R.

    Alternatively `mesh`: a 2D DeviceMesh whose dim 0 is the ring and dim 1 is Ulysses.
    Sharding (see cpattn.hybrid_positions / hybrid_shard): the sequence is split over the R ring
    ranks by `layout`; the rank at ring index i and Ulysses index u holds the u-th contiguous
    sub-chunk of ring shard i. H % U == 0. Either group may have size 1.
    """
    if mesh is not None:
        ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    if ulysses_group is None or ring_group is None:
        raise ValueError("cpattn.hybrid_attention: give ulysses_group and ring_group, or a 2D mesh")
    what = "cpattn.hybrid_attention"
    u_world = dist.get_world_size(ulysses_group)
    timeout = check_timeout(what, timeout)

    def check():
        args, fields = _attention_args(what, q, k, v, causal, softmax_scale, window, layout)
        _check_heads(what, q, u_world)
        return args, fields

    causal, _, softmax_scale, window = agree_on(what, ulysses_group, timeout, check)
    qh, kh, vh = _scatter_heads(q, k, v, ulysses_group)
    out_h, lse_h = ring_attention(qh, kh, vh, group=ring_group, causal=causal, layout=layout,
                                  softmax_scale=softmax_scale, window=window, return_lse=True,
                                  timeout=timeout)
    out = comm.all_to_all(out_h, scatter_dim=1, gather_dim=2, group=ulysses_group)
    if not return_lse:
        return out
    return out, comm.all_to_all(lse_h, scatter_dim=2, gather_dim=1, group=ulysses_group)


def hybrid_positions(
    seqlen: int, *, ulysses_group, ring_group, layout: str = "zigzag", device=None
) -> torch.Tensor:
    """Global positions of this rank's tokens under hybrid_attention's sharding."""
    _, r_rank, r_world = _group_info(ring_group)
    _, u_rank, u_world = _group_info(ulysses_group)
    from cpattn.ring import positions

    ring_pos = positions(seqlen, layout=layout, rank=r_rank, world_size=r_world, device=device)
    if ring_pos.numel() % u_world != 0:
        raise ValueError(
            f"cpattn.hybrid_positions: the ring shard length {ring_pos.numel()} is not divisible "
            f"by the Ulysses group size {u_world}"
        )
    return ring_pos.chunk(u_world)[u_rank]


def hybrid_shard(x: torch.Tensor, *, ulysses_group, ring_group, layout: str = "zigzag",
                 dim: int = 1) -> torch.Tensor:
    """This rank's part of the full tensor x under hybrid_attention's sharding."""
    from cpattn.ring import shard

    idx = hybrid_positions(x.shape[dim], ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout)
    return shard(x, index=idx, dim=dim)


def hybrid_unshard(x_local: torch.Tensor, *, ulysses_group, ring_group, layout: str = "zigzag",
                   dim: int = 1, group=None) -> torch.Tensor:
    """Inverse of hybrid_shard over `group` (default: the world, which must hold exactly the
    ranks of the mesh). Differentiable."""
    from cpattn.ring import unshard

    world = dist.get_world_size(ulysses_group) * dist.get_world_size(ring_group)
    seqlen = x_local.shape[dim] * world
    idx = hybrid_positions(seqlen, ulysses_group=ulysses_group, ring_group=ring_group,
                           layout=layout)
    return unshard(x_local, group=group, index=idx, seqlen=seqlen, dim=dim)
