"""Ring attention over a torch.distributed process group, and the layout helpers.

Each rank passes its shard of q, k, v (in `layout` order along the sequence dim) and gets the
exact attention output of its queries over the whole sequence. K/V shards travel around the ring
while the current step computes; results are merged in float32 with their log-sum-exp. The ring
driver, the schedule and the layouts live in C++ (csrc/ops/ring.cpp, csrc/include/cpattn/).
"""

import datetime
import math
import os
import struct
from typing import Optional, Union

import torch
import torch.distributed as dist

LAYOUTS = {"contiguous": 0, "zigzag": 1, "striped": 2}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _default_timeout() -> float:
    return float(os.environ.get("CPATTN_COMM_TIMEOUT", "300"))


def _layout_code(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"cpattn: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    return LAYOUTS[layout]


def _group_info(group) -> tuple:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "cpattn: ring attention needs torch.distributed to be initialised "
            "(dist.init_process_group), or use cpattn.ring_attention_emulated for one process"
        )
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


def positions(
    seqlen: int,
    *,
    group=None,
    layout: str = "zigzag",
    device: Optional[torch.device] = None,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> torch.Tensor:
    """Global positions (int64, (seqlen / W,)) of this rank's tokens, e.g. for RoPE.

    `rank` / `world_size` override the group's (to compute another rank's positions).
    """
    if rank is None or world_size is None:
        _, g_rank, g_world = _group_info(group)
        rank = g_rank if rank is None else rank
        world_size = g_world if world_size is None else world_size
    pos = torch.ops.cpattn.layout_positions(seqlen, world_size, rank, _layout_code(layout))
    return pos.to(device) if device is not None else pos


def shard(
    x: torch.Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    dim: int = 1,
    index: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """This rank's part of the full tensor x along `dim`, in `layout` order.

    `index` (global positions of this rank's tokens) overrides the layout, e.g. for the hybrid
    or varlen shardings.
    """
    if index is None:
        index = positions(x.shape[dim], group=group, layout=layout)
    return x.index_select(dim, index.to(x.device))


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, index, seqlen, group, dim):
        ctx.group, ctx.dim = group, dim
        ctx.save_for_backward(index)
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x_local) for _ in range(world)]
        dist.all_gather(parts, x_local.contiguous(), group=group)
        indices = [torch.empty_like(index) for _ in range(world)]
        dist.all_gather(indices, index, group=group)
        full = x_local.new_zeros((*x_local.shape[:dim], seqlen, *x_local.shape[dim + 1 :]))
        full.index_copy_(dim, torch.cat(indices).to(x_local.device), torch.cat(parts, dim))
        return full

    @staticmethod
    def backward(ctx, grad_full):
        # Every rank holds the full gradient of its own copy; the shard's gradient is the sum.
        (index,) = ctx.saved_tensors
        grad = grad_full.contiguous()
        dist.all_reduce(grad, group=ctx.group)
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
    `index` (this rank's global positions) overrides the layout; then `seqlen` gives the full
    length (default: W times the shard length) and positions not held by any rank are 0.
    """
    group, _, world = _group_info(group)
    if index is None:
        seqlen = x_local.shape[dim] * world
        index = positions(seqlen, group=group, layout=layout)
    elif seqlen is None:
        seqlen = x_local.shape[dim] * world
    return _Unshard.apply(x_local, index.to(torch.int64).cpu(), seqlen, group, dim)


def _validate(q, k, v, group, world, layout_code, causal, window, scale, timeout):
    """All ranks must agree on shapes and options: one small all-gather, checked on every rank."""
    fields = ["batch", "seqlen_local", "heads", "head_dim", "kv_batch", "kv_seqlen_local",
              "kv_heads", "kv_head_dim", "dtype", "layout", "causal", "window_left",
              "window_right", "softmax_scale"]
    scale_bits = struct.unpack("<q", struct.pack("<d", scale))[0]
    mine = torch.tensor(
        [*q.shape, *k.shape, _DTYPES.get(q.dtype, -1), layout_code, int(causal), *window,
         scale_bits],
        dtype=torch.int64,
    )
    backend = dist.get_backend(group)
    device = q.device if backend != "gloo" else torch.device("cpu")
    gathered = [torch.empty_like(mine, device=device) for _ in range(world)]
    work = dist.all_gather(gathered, mine.to(device), group=group, async_op=True)
    if not work.wait(timeout=datetime.timedelta(seconds=timeout)):
        raise RuntimeError(f"cpattn.ring_attention: peers did not answer within {timeout} s")
    table = torch.stack([g.cpu() for g in gathered])
    bad = (table != table[0]).any(0)
    if bad.any():
        names = [fields[i] for i in bad.nonzero().flatten().tolist()]
        detail = "; ".join(
            f"{name}: " + ", ".join(f"rank {r}={table[r, fields.index(name)].item()}"
                                    for r in range(world))
            for name in names
        )
        raise ValueError(f"cpattn.ring_attention: ranks disagree on {', '.join(names)} ({detail})")


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group_name, scale, causal, window, layout_code, timeout):
        out, lse = torch.ops.cpattn.ring_fwd(
            q, k, v, group_name, scale, causal, window[0], window[1], layout_code, timeout
        )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group_name, scale, causal, window[0], window[1], layout_code, timeout)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.cpattn.ring_bwd(
            dout.contiguous(), q, k, v, out, lse, *ctx.args, dlse
        )
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    timeout: Optional[float] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Exact attention over a sequence sharded across the ranks of `group`.

    Args:
        q: this rank's queries (batch, seqlen / W, heads, head_dim), in `layout` order
            (see cpattn.shard / cpattn.positions).
        k, v: this rank's keys / values (batch, seqlen / W, kv_heads, head_dim).
        group: a torch.distributed process group (default: the world).
        causal, window, softmax_scale: as cpattn.attention, on global token positions.
        layout: "contiguous", "zigzag" (balanced for causal) or "striped".
        return_lse: also return the LSE (batch, heads, seqlen / W), float32.
        timeout: seconds to wait for a peer before raising (default $CPATTN_COMM_TIMEOUT or 300).

    Every rank must call it with the same shapes and options; a mismatch raises on every rank.
    """
    group, rank, world = _group_info(group)
    layout_code = _layout_code(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            "cpattn.ring_attention: q, k, v must be (batch, seqlen_local, heads, head_dim), got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    from cpattn.attention import _check_window

    window = _check_window(window)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    timeout = _default_timeout() if timeout is None else float(timeout)
    _validate(q, k, v, group, world, layout_code, causal, window, float(softmax_scale), timeout)
    out, lse = _RingAttention.apply(
        q, k, v, group.group_name, float(softmax_scale), bool(causal), window, layout_code,
        timeout,
    )
    return (out, lse) if return_lse else out


def ring_attention_emulated(
    q: list,
    k: list,
    v: list,
    *,
    causal: bool = False,
    layout: str = "zigzag",
    softmax_scale: Optional[float] = None,
    window: tuple[int, int] = (-1, -1),
) -> tuple[list, list]:
    """The ring on W ranks emulated in this process (one thread each); lists hold one shard per
    rank. Returns (outs, lses). Forward only; for tests and single-device experiments."""
    from cpattn.attention import _check_window

    window = _check_window(window)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q[0].shape[-1])
    outs, lses = torch.ops.cpattn.ring_fwd_emulated(
        q, k, v, float(softmax_scale), bool(causal), window[0], window[1], _layout_code(layout)
    )
    return list(outs), list(lses)
