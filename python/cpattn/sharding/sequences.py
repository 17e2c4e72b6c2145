"""Sharding: which tokens each rank holds under a layout (contiguous, zigzag, striped), for a
sequence, packed documents or the hybrid mesh; shard and unshard tensors accordingly.

The layout rule itself lives in C++ (csrc/include/cpattn/layout.h, cpattn.core.layout).
"""

from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist

from cpattn.core.agreement import agree_on
from cpattn.core.autograd import once_differentiable
from cpattn.core.device import to_device
from cpattn.core.layout import LAYOUTS, document_positions, padded_length, round_up, shard_positions
from cpattn.core.signature import Fields, digest_ints, tensor_fields
from cpattn.core.validation import (
    check_choice,
    check_cu_seqlens,
    check_int,
    check_timeout,
    error,
    group_info,
)


def rank_and_world(group, rank: Optional[int], world_size: Optional[int]) -> tuple[int, int]:
    """(rank, world_size): the group's, each overridden when given (e.g. another rank's view)."""
    if rank is None or world_size is None:
        _, g_rank, g_world = group_info(group)
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
    return to_device(pos, device) if device is not None else pos


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

    return unshard_by(what, x_local, group, dim, locate)


def unshard_by(what: str, x_local, group, dim, locate: Callable) -> torch.Tensor:
    """unshard after validation and the agreement check. locate(local length, world) gives this
    rank's global positions, the full length and more fields the ranks must agree on."""
    group, _, world = group_info(group)

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

    d, index, seqlen = agree_on(what, group, check_timeout(what, None, group), check)
    return _Unshard.apply(x_local, index, seqlen, group, d)


def document_lengths_of(cu_seqlens, what: str) -> torch.Tensor:
    return check_cu_seqlens(what, cu_seqlens).diff()


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
    docs = document_lengths_of(cu_seqlens, "cpattn.positions_varlen")
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
        docs = document_lengths_of(cu_seqlens, what)
        check_choice(what, "layout", layout, tuple(LAYOUTS))
        index, _ = positions_varlen(cu_seqlens, group=group, layout=layout)
        return index, int(docs.sum()), [("layout", layout), ("cu_seqlens", digest_ints(docs))]

    return unshard_by(what, x_local, group, dim, locate)


def pad_documents(x: torch.Tensor, cu_seqlens, multiple: int, dim: int = 0):
    """Pads every document of the packed x with zeros to a multiple of `multiple` tokens.
    Returns (x_padded, cu_seqlens_padded)."""
    docs = document_lengths_of(cu_seqlens, "cpattn.pad_documents")
    pieces, lengths, start = [], [], 0
    for n in docs.tolist():
        padded = round_up(n, multiple)
        pieces.append(x.narrow(dim, start, n))
        pieces.append(x.new_zeros((*x.shape[:dim], padded - n, *x.shape[dim + 1 :])))
        lengths.append(padded)
        start += n
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    return torch.cat(pieces, dim), cu


def hybrid_ring_shard(seqlen: int, layout: str, r_world: int, u_world: int) -> tuple[int, int]:
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
    _, r_rank, r_world = group_info(ring_group)
    _, u_rank, u_world = group_info(ulysses_group)
    pos = hybrid_shard_positions(seqlen, layout, r_world, u_world, r_rank, u_rank)
    return to_device(pos, device) if device is not None else pos


def hybrid_shard_positions(seqlen: int, layout: str, r_world: int, u_world: int, r_rank: int,
                           u_rank: int) -> torch.Tensor:
    """hybrid_positions of the rank at (r_rank, u_rank) of an R x U mesh (int64, CPU)."""
    ring_pos = shard_positions(seqlen, layout, r_world, r_rank)
    _, padded = hybrid_ring_shard(seqlen, layout, r_world, u_world)
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
