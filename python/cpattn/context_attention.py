"""Attention over a whole sequence held by every rank of a group, with the strategy (or no context
parallelism at all) chosen by the cost model (cpattn.plan), and strategy="auto" of ring_attention.
"""

from typing import Optional, Union

import torch

from cpattn import plan as _plan
from cpattn.attention import attention
from cpattn.core.agreement import agree_on
from cpattn.core.autograd import needs_grad
from cpattn.core.device import to_device
from cpattn.core.layout import DTYPE_NAMES
from cpattn.core.options import checked_call
from cpattn.core.validation import check_timeout, error, group_info
from cpattn.parallel import ContextParallel
from cpattn.sharding.sequences import unshard
from cpattn.strategies.registry import STRATEGIES as REGISTRY


class _Split(torch.autograd.Function):
    """This rank's tokens of a tensor every rank holds whole; backward all-gathers the shards'
    gradients so every rank gets the whole gradient (the loss is the same on every rank)."""

    @staticmethod
    def forward(ctx, x, index, group, dim):
        ctx.args = (index, x.shape[dim], group, dim)
        return x.index_select(dim, to_device(index, x.device))

    @staticmethod
    def backward(ctx, grad):
        index, seqlen, group, dim = ctx.args
        return unshard(grad.contiguous(), group=group, index=index, seqlen=seqlen, dim=dim), \
            None, None, None


class _Gather(torch.autograd.Function):
    """Every rank's shard put together in sequence order; backward keeps this rank's part of
    the (identical on every rank) whole gradient."""

    @staticmethod
    def forward(ctx, x_local, index, seqlen, group, dim):
        ctx.args = (index, dim)
        return unshard(x_local.contiguous(), group=group, index=index, seqlen=seqlen, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        index, dim = ctx.args
        return grad.index_select(dim, index.to(grad.device)), None, None, None, None


_MODELLED = ("causal", "softmax_scale", "window")  # the options taken (others: TypeError)


def context_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group=None, strategy: str = "auto",
    timeout: Optional[float] = None, return_lse: bool = False, **options,
) -> Union[torch.Tensor, tuple]:
    """cpattn.attention over the ranks of `group`, each holding the whole q (B, S, H, D) and k, v
    (B, S, Hkv, D) (the same tensors), returning the whole output (and LSE (B, H, S)) on every
    rank; gradients are whole on every rank too (the loss must be the same on every rank).
    **options: the attention options the cost model knows: causal, softmax_scale, window.

    strategy: "auto" (the cost model picks, no context parallelism included: short sequences
    are not split), "none", "ring/<layout>", "allgather/<layout>", "ulysses" or
    "hybrid UxR/zigzag" (names as in `python -m cpattn plan`). The choice is made once per
    distinct problem, the same on every rank, and logged at debug level ("cpattn.plan").
    """
    what = "cpattn.context_attention"
    group, _, world = group_info(group)
    timeout = check_timeout(what, timeout, group)
    train = needs_grad(q, k, v)

    def check():
        checked, fields = checked_call(what, q, k, v, options, only=_MODELLED)
        if not isinstance(strategy, str):
            raise error(what, "strategy", strategy, "must be a str")
        return checked, [*fields, ("requires_grad", train), ("strategy", strategy)]

    checked = agree_on(what, group, timeout, check)
    causal, scale, window = checked.causal, checked.softmax_scale, checked.window
    p = _plan.Problem(q.shape[1], q.shape[2], k.shape[2], q.shape[3], batch=q.shape[0],
                      dtype=DTYPE_NAMES[q.dtype], causal=bool(causal), window=window,
                      mode="train" if train else "forward")
    cands = _plan.candidates(p, world)
    if strategy == "auto":
        chosen = _plan.choose(p, world, cands, group, "cpattn.context_attention").candidate
    else:
        named = [c for c in cands if c.name == strategy]
        if not named:
            raise ValueError(f"cpattn.context_attention: strategy must be 'auto' or one of "
                             f"{[c.name for c in cands]} for this problem, got {strategy!r}")
        chosen = named[0]

    opts = dict(causal=causal, softmax_scale=scale, window=window, return_lse=True)
    if chosen.strategy == "none":  # no context parallelism
        out, lse = attention(q, k, v, **opts)
    else:
        cp = _settings(chosen, group, timeout)
        seqlen = q.shape[1]
        index = cp.positions(seqlen)
        shards = [_Split.apply(t, index, group, 1) for t in (q, k, v)]
        out, lse = cp.attention(*shards, **opts)
        out = _Gather.apply(out, index, seqlen, group, 1)
        lse = _Gather.apply(lse, index, seqlen, group, 2)
    return (out, lse) if return_lse else out


def _settings(chosen: _plan.Candidate, group, timeout: Optional[float]) -> ContextParallel:
    """The ContextParallel settings that run the planner's candidate over `group`: its strategy,
    layout and groups, and its KV heads per pass or per gather (chunk)."""
    spec = REGISTRY[chosen.strategy]
    chunks = {} if spec.chunk_option is None else {spec.chunk_option: chosen.chunk or None}
    return ContextParallel(spec.split_group(group, chosen), strategy=chosen.strategy,
                           layout=chosen.layout, timeout=timeout, **chunks)
