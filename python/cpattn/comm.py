"""Autograd-aware collectives along one tensor dim, for sequence-parallel layers.

Each is differentiable: the backward of an all-gather is a reduce-scatter and vice versa; the
backward of an all-to-all is the all-to-all with the two dims swapped. Chunks follow rank order
within `group` (default: the world).
"""

from typing import Optional

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the flat-tensor collectives; older releases only have the old names.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _world(group) -> int:
    return dist.get_world_size(group)


def _check_divisible(x: torch.Tensor, dim: int, world: int, what: str) -> None:
    if x.shape[dim] % world != 0:
        raise ValueError(
            f"cpattn.comm.{what}: dim {dim} of size {x.shape[dim]} is not divisible by the group "
            f"size {world}"
        )


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((world * src.shape[0], *src.shape[1:]))
    all_gather_flat(out, src, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x, dim, world, "reduce_scatter")
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // world, *src.shape[1:]))
    reduce_scatter_flat(out, src, group=group)
    return out.movedim(0, dim)


def all_to_all_raw(x: torch.Tensor, scatter_dim: int, gather_dim: int, group) -> torch.Tensor:
    """all_to_all outside autograd (for a caller whose own backward does the reverse one)."""
    world = _world(group)
    if world == 1:
        return x
    _check_divisible(x, scatter_dim, world, "all_to_all")
    # (W, part): one copy, none when the parts already lie in rank order (the sequence dim of
    # a batch-1 tensor); the result is a view of what was received where the layout allows it
    # (the sequence dim of a batch-1 tensor), else the one copy of the concatenation.
    parts = x.unflatten(scatter_dim, (world, x.shape[scatter_dim] // world))
    send = parts.movedim(scatter_dim, 0).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)


class _GatherOrScatter(torch.autograd.Function):
    """An all-gather (gather=True) or a reduce-scatter along `dim`; each one's backward is the
    other."""

    @staticmethod
    def forward(ctx, x, dim, group, gather):
        ctx.args = (dim, group, not gather)
        return (_all_gather if gather else _reduce_scatter)(x, dim, group)

    @staticmethod
    def backward(ctx, grad):  # through apply: differentiable again (double backward)
        return _GatherOrScatter.apply(grad, *ctx.args), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim, group):
        ctx.dims, ctx.group = (scatter_dim, gather_dim), group
        return all_to_all_raw(x, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(grad, gather_dim, scatter_dim, ctx.group), None, None, None


def all_gather(x: torch.Tensor, dim: int = 1, group: Optional[dist.ProcessGroup] = None):
    """Concatenates every rank's x along `dim` (rank order). Backward: reduce-scatter."""
    return _GatherOrScatter.apply(x, dim, group, True)


def reduce_scatter(x: torch.Tensor, dim: int = 1, group: Optional[dist.ProcessGroup] = None):
    """Sums x over the ranks and keeps this rank's part along `dim`. Backward: all-gather."""
    return _GatherOrScatter.apply(x, dim, group, False)


def all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, group: Optional[dist.ProcessGroup] = None
):
    """Splits x into W parts along scatter_dim, sends part i to rank i, and concatenates the
    received parts along gather_dim (rank order). E.g. (B, S/W, H, D) -> (B, S, H/W, D) with
    scatter_dim=2, gather_dim=1 (Ulysses)."""
    return _AllToAll.apply(x, scatter_dim, gather_dim, group)


@torch.library.custom_op("cpattn::rows_all_to_all", mutates_args=())
def rows_all_to_all(send: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    group_name: str) -> torch.Tensor:
    """all_to_all_single of rows with uneven splits (in_splits[r] rows of send go to rank r,
    out_splits[r] come from it): one opaque op with an ordered side effect under
    torch.compile, so that a rank which exchanges nothing still calls it (traced as a
    functional collective, such a call was dropped and the ranks went out of step)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    recv = send.new_empty((sum(out_splits), *send.shape[1:]))
    dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits,
                           group=_resolve_process_group(group_name))
    return recv


@rows_all_to_all.register_fake
def _rows_all_to_all_fake(send, out_splits, in_splits, group_name):
    return send.new_empty((sum(out_splits), *send.shape[1:]))


def register_ordered(name: str) -> None:
    """Gives the custom op `name` ("namespace::op") an ordered side effect: torch.compile must
    neither drop its call (a rank whose received rows go unused still takes part in the
    collective) nor move it past another collective."""
    register = getattr(torch.library, "_register_effectful_op", None)
    if register is not None:
        register(name, torch.library.EffectType.ORDERED)
    else:  # older torch
        from torch._higher_order_ops import effects

        namespace, op = name.split("::")
        effects._register_effectful_op(getattr(getattr(torch.ops, namespace), op).default,
                                       effects._EffectType.ORDERED)


register_ordered("cpattn::rows_all_to_all")
