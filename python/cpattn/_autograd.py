"""Double backward for cpattn's autograd Functions and ops: raise, never return zeros.

Their backward passes run compiled kernels and collectives that autograd cannot see through, so
with create_graph=True the gradients they return would silently have no second-order part.
Registered ops get a backward op whose own gradient raises (refuse_double_backward); autograd
Functions decorate their backward (once_differentiable). Either raises only when a second-order
gradient actually flows through cpattn, not merely because create_graph=True.
"""

import functools
from collections.abc import Callable

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
