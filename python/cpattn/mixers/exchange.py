"""The collectives of the mixer primitives: every rank's tensor stacked in rank order, and
point-to-point routes (the tree state scan's steps).

An *exchange* is any callable x -> (W, *x.shape) whose gradient sends each slice's gradient back
to the rank it came from (the sum over the ranks). The primitives take it as an argument, so a
single process can stand in for W ranks (tests, the adapters' equivalence probe) with
`stacked`, and the ranks of a process group use `group_exchange`: one all-gather per group (the
Ulysses group then the ring group for the hybrid mesh, so the order is ring rank * U + Ulysses
rank, cpattn.ContextParallel.rank), backward one reduce-scatter per group in reverse.

`route(exchange, x, edges, rank)` moves slices of a flat tensor between ranks, each edge (src,
dst, numel) one message: point to point over `group_exchange`'s ranks (custom op
cpattn::mixer_route, backward the same route reversed), or, for an exchange that is a plain
callable (one process playing W ranks), picked out of one all-gather. All are custom ops with an
ordered side effect, so that torch.compile neither drops nor reorders them.
"""

from __future__ import annotations

import functools
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
    return GroupExchange(names[0], names[1] if len(names) > 1 else "")


class GroupExchange:
    """The exchange of the ranks of one process group or the product of two (inner, outer; ""
    for none): calling it all-gathers (mixer_gather); `route` sends point to point."""

    def __init__(self, inner: str, outer: str):
        self.inner, self.outer = inner, outer

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return mixer_gather(x, self.inner, self.outer)

    @property
    def group(self):
        """The process group the planner's machine is kept for (the outer one)."""
        return _group(self.outer or self.inner)

    def route(self, x: torch.Tensor, edges: Edges, rank: int, tag: int) -> torch.Tensor:
        """x (n,): this rank's messages (edges with src == rank, in edge order, concatenated);
        returns the messages to this rank (dst == rank) concatenated in edge order."""
        ranks = _global_ranks(self.inner, self.outer)
        send = [(ranks[dst], n) for src, dst, n in edges if src == rank]
        recv = [(ranks[src], n) for src, dst, n in edges if dst == rank]
        if not send and not recv:
            return x[:0]
        group = self.inner if not self.outer else ""  # the product: the default group's ranks
        return mixer_route(x, [p for p, _ in send], [n for _, n in send], [p for p, _ in recv],
                           [n for _, n in recv], group, tag)


# (src rank, dst rank, numel) of each message of one route, the same on every rank
Edges = tuple


def route(exchange: Exchange, x: torch.Tensor, edges: Edges, rank: int,
          tag: int = 0) -> torch.Tensor:
    """Sends point to point (see GroupExchange.route) where the exchange can (`route` method),
    else picks the messages out of one all-gather of every rank's x padded to the longest (one
    process playing W ranks: every rank must call it, as any collective). Differentiable."""
    method = getattr(exchange, "route", None)
    if method is not None:
        return method(x, edges, rank, tag)
    longest, offsets, at = 0, [], {}
    for src, _, n in edges:
        offsets.append(at.get(src, 0))
        at[src] = offsets[-1] + n
        longest = max(longest, at[src])
    padded = torch.cat([x, x.new_zeros(longest - x.shape[0])])
    gathered = exchange(padded)  # (W, longest)
    parts = [gathered[src, o:o + n] for (src, dst, n), o in zip(edges, offsets) if dst == rank]
    return torch.cat(parts + [gathered[rank, :0]])


@torch._dynamo.assume_constant_result  # (a constant under torch.compile, run while tracing)
def _global_ranks(inner: str, outer: str) -> tuple[int, ...]:
    """The global rank of each rank of the groups' product, in exchange order (outer rank *
    inner size + inner rank). One object all-gather over the outer group, the first time."""
    return _product_ranks(inner, outer)


@functools.lru_cache(maxsize=64)
def _product_ranks(inner: str, outer: str) -> tuple[int, ...]:
    members = dist.get_process_group_ranks(_group(inner))
    if not outer:
        return tuple(members)
    every: list = [None] * dist.get_world_size(_group(outer))
    dist.all_gather_object(every, members, group=_group(outer))
    return tuple(r for part in every for r in part)


@torch.library.custom_op("cpattn::mixer_route", mutates_args=())
def mixer_route(x: torch.Tensor, send_peers: list[int], send_sizes: list[int],
                recv_peers: list[int], recv_sizes: list[int], group: str,
                tag: int) -> torch.Tensor:
    """Point to point: x's consecutive slices of send_sizes to the global ranks send_peers; the
    slices of recv_sizes from recv_peers concatenated. group: the process group's name ("" the
    default group)."""
    pg = _group(group) if group else dist.group.WORLD
    x = x.contiguous()
    out = x.new_empty(sum(recv_sizes))
    ops, at = [], 0
    for peer, n in zip(send_peers, send_sizes):
        ops.append(dist.P2POp(dist.isend, x[at:at + n], peer, pg, tag))
        at += n
    at = 0
    for peer, n in zip(recv_peers, recv_sizes):
        ops.append(dist.P2POp(dist.irecv, out[at:at + n], peer, pg, tag))
        at += n
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


@mixer_route.register_fake
def _mixer_route_fake(x, send_peers, send_sizes, recv_peers, recv_sizes, group, tag):
    return x.new_empty(sum(recv_sizes))


def _route_setup(ctx, inputs, output):
    ctx.args, ctx.like = inputs[1:], inputs[0].new_empty(0)


def _route_backward(ctx, grad):
    send_peers, send_sizes, recv_peers, recv_sizes, group, tag = ctx.args
    if grad is None:
        grad = ctx.like.new_zeros(sum(recv_sizes))
    back = mixer_route(grad, recv_peers, recv_sizes, send_peers, send_sizes, group,
                       tag + ROUTE_BACKWARD_TAG)
    return back, None, None, None, None, None, None


ROUTE_BACKWARD_TAG = 1 << 16  # the backward's messages apart from the forward's
torch.library.register_autograd("cpattn::mixer_route", _route_backward,
                                setup_context=_route_setup)
comm.register_ordered("cpattn::mixer_route")


def stacked(*xs: torch.Tensor) -> torch.Tensor:
    """The exchange of ranks that all live in this process: their tensors stacked (one rank:
    x[None])."""
    return torch.stack(xs)
