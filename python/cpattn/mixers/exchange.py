"""The one collective of the mixer primitives: every rank's tensor, stacked in rank order.

An *exchange* is any callable x -> (W, *x.shape) whose gradient sends each slice's gradient back
to the rank it came from (the sum over the ranks). The primitives take it as an argument, so a
single process can stand in for W ranks (tests, the adapters' equivalence probe) with
`stacked`, and the ranks of a process group use `group_exchange`: one all-gather per group (the
Ulysses group then the ring group for the hybrid mesh, so the order is ring rank * U + Ulysses
rank, cpattn.ContextParallel.rank), backward one reduce-scatter per group in reverse. Both are
custom ops with an ordered side effect, so that torch.compile neither drops nor reorders them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from cpattn import comm

Exchange = Callable[[torch.Tensor], torch.Tensor]


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("cpattn::mixer_gather", mutates_args=())
def mixer_gather(x: torch.Tensor, inner: str, outer: str) -> torch.Tensor:
    """(W, *x.shape): x of every rank of the groups' product, in rank order (the group named
    `inner`, then the one named `outer` unless "")."""
    out = x.contiguous()[None]
    for name in _names(inner, outer):
        group = _group(name)
        size = dist.get_world_size(group)
        gathered = out.new_empty((size * out.shape[0], *out.shape[1:]))
        comm.all_gather_flat(gathered, out, group=group)
        out = gathered  # (size, earlier groups' rows, ...): this group's index first
    return out


@mixer_gather.register_fake
def _mixer_gather_fake(x, inner, outer):
    size = 1
    for name in _names(inner, outer):
        size *= dist.get_world_size(_group(name))
    return x.new_empty((size, *x.shape))


@torch.library.custom_op("cpattn::mixer_reduce_scatter", mutates_args=())
def mixer_reduce_scatter(g: torch.Tensor, inner: str, outer: str) -> torch.Tensor:
    """The adjoint of mixer_gather: this rank's slice of the sum over the ranks of g (W, ...)."""
    out = g.contiguous()
    for name in reversed(_names(inner, outer)):
        group = _group(name)
        size = dist.get_world_size(group)
        # out (size * inner, ...): this group's index first (the gather's last group)
        part = out.new_empty((out.shape[0] // size, *out.shape[1:]))
        comm.reduce_scatter_flat(part, out, group=group)
        out = part
    return out[0]


@mixer_reduce_scatter.register_fake
def _mixer_reduce_scatter_fake(g, inner, outer):
    return g.new_empty(g.shape[1:])


def _names(inner: str, outer: str) -> list[str]:
    return [inner] + ([outer] if outer else [])


def _setup(ctx, inputs, output):
    ctx.names = inputs[1:]


def _gather_backward(ctx, grad):
    return mixer_reduce_scatter(grad, *ctx.names), None, None


def _scatter_backward(ctx, grad):
    return mixer_gather(grad, *ctx.names), None, None


torch.library.register_autograd("cpattn::mixer_gather", _gather_backward, setup_context=_setup)
torch.library.register_autograd("cpattn::mixer_reduce_scatter", _scatter_backward,
                                setup_context=_setup)
comm.register_ordered("cpattn::mixer_gather")
comm.register_ordered("cpattn::mixer_reduce_scatter")


def group_exchange(groups: Sequence) -> Exchange:
    """The exchange over the product of `groups` (process groups, the innermost first): for
    (ulysses, ring) the ranks are ordered ring rank * U + Ulysses rank."""
    names = [g.group_name for g in groups if dist.get_world_size(g) > 1]
    if not names:
        return stacked
    inner, outer = names[0], names[1] if len(names) > 1 else ""
    return lambda x: mixer_gather(x, inner, outer)


def stacked(*xs: torch.Tensor) -> torch.Tensor:
    """The exchange of ranks that all live in this process: their tensors stacked (one rank:
    x[None])."""
    return torch.stack(xs)
