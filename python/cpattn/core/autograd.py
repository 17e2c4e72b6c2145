"""The autograd plumbing of cpattn's Functions and ops.

Double backward: raise, never return zeros. Their backward passes run compiled kernels and
collectives that autograd cannot see through, so with create_graph=True the gradients they
return would silently have no second-order part. Registered ops get a backward op whose own
gradient raises (refuse_double_backward); autograd Functions decorate their backward
(once_differentiable). Either raises only when a second-order gradient actually flows through
cpattn, not merely because create_graph=True.

Head groups (the KV heads one pass handles, with their query heads): passes over head groups
written into one output (forward_in_passes, backward_in_passes), shared by the strategies and
invariant mode; the sinks' gradient share (sink_grad) and a Function's backward result
(input_grads).
"""

import functools
from collections.abc import Callable
from typing import Optional

import torch
from torch._C import _functions


def _message(what: str) -> str:
    return (f"{what}: double backward (a gradient of a gradient, create_graph=True) is not "
            "implemented")


def refuse_double_backward(backward_op: str, what: str) -> None:
    """Registers an autograd formula for the backward op `backward_op` (e.g.
    "cpattn::attention_bwd") that raises: its outputs are first-order gradients."""

    def setup_context(ctx, inputs, output) -> None:
        pass

    def backward(ctx, *grads):
        raise RuntimeError(_message(what))

    torch.library.register_autograd(backward_op, backward, setup_context=setup_context)


def once_differentiable(what: str) -> Callable:
    """Decorates an autograd Function's backward(ctx, *grads): it runs without recording a graph,
    and under create_graph=True its gradients carry a node that raises if a second-order
    gradient flows through them (torch's @once_differentiable, with cpattn's message)."""

    def decorate(backward: Callable) -> Callable:
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):
                return outputs
            outputs = outputs if isinstance(outputs, tuple) else (outputs,)
            raise_later = _functions.DelayedError(_message(what).encode(), len(outputs))

            def alias(t):
                if t is None:
                    return None
                return t.detach().requires_grad_(True)

            wrapped = raise_later(*(alias(t) for t in outputs))
            return wrapped if isinstance(wrapped, tuple) else (wrapped,)

        return wrapper

    return decorate


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd will record a graph through one of `tensors`."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def head_groups(q, k, group_size: int) -> list:
    """(query heads, KV heads) slices of each pass over `group_size` KV heads at a time (a head
    group); one pass of every head when group_size >= kv heads."""
    if group_size >= k.shape[2]:
        return [(slice(None), slice(None))]
    per_kv = q.shape[2] // k.shape[2]
    return [(slice(c0 * per_kv, (c0 + group_size) * per_kv), slice(c0, c0 + group_size))
            for c0 in range(0, k.shape[2], group_size)]


def forward_in_passes(q, k, group_size: int, attend: Callable
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, S, H, Dv) and lse (B, H, S) from attend(query heads, KV heads) -> (out, lse) of
    each pass over a head group, written pass by pass (no list of parts, no concatenation);
    with one pass, its result."""
    passes = head_groups(q, k, group_size)
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


def backward_in_passes(q, k, v, group_size: int, backward: Callable
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv from backward(query heads, KV heads) -> (dq, dk, dv) of each pass over a head
    group, written pass by pass (forward_in_passes' counterpart); with one pass, its results
    themselves."""
    passes = head_groups(q, k, group_size)
    if len(passes) == 1:
        return backward(*passes[0])
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for qh, kh in passes:
        dq_c, dk_c, dv_c = backward(qh, kh)
        dq[:, :, qh].copy_(dq_c)
        dk[:, :, kh].copy_(dk_c)
        dv[:, :, kh].copy_(dv_c)
        del dq_c, dk_c, dv_c
    return dq, dk, dv


def sink_grad(ctx, index: int, sinks, dout, out, lse, dlse) -> Optional[torch.Tensor]:
    """The gradient of the sinks (the autograd input at `index`) from this rank's rows: its
    share, like any parameter gradient under context parallelism (the usual gradient all-reduce
    over the group sums the shares)."""
    if sinks is None or not ctx.needs_input_grad[index]:
        return None
    return torch.ops.cpattn.sink_bwd(dout, out, lse, sinks, dlse).to(sinks.dtype)


def input_grads(ctx, *grads) -> tuple:
    """An autograd Function's backward result: `grads` for its first inputs, None for the rest."""
    return (*grads, *([None] * (len(ctx.needs_input_grad) - len(grads))))
