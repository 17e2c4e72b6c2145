"""Fake (meta) kernels and autograd for the inference ops (csrc/ops/inference.h)."""

import torch

from cpattn._autograd import refuse_double_backward

ops = torch.ops.cpattn


@torch.library.register_fake("cpattn::merge_attention_states")
def _merge_fake(outs, lses, out_dtype=None):
    torch._check(outs.dim() == 5, lambda: "cpattn: merge_attention_states outs must have 5 dims")
    _, b, s, h, d = outs.shape
    out = outs.new_empty((b, s, h, d), dtype=out_dtype if out_dtype is not None else outs.dtype)
    return out, lses.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake("cpattn::merge_attention_states_bwd")
def _merge_bwd_fake(dout, dlse, outs, lses, lse):
    return outs.new_empty(outs.shape), lses.new_empty(lses.shape)


def _merge_setup_context(ctx, inputs, output):
    outs, lses, _ = inputs
    _, lse = output
    ctx.save_for_backward(outs, lses, lse)


def _merge_backward(ctx, dout, dlse):
    outs, lses, lse = ctx.saved_tensors
    douts, dlses = ops.merge_attention_states_bwd(dout.contiguous(), dlse, outs, lses, lse)
    return douts, dlses, None


torch.library.register_autograd(
    "cpattn::merge_attention_states", _merge_backward, setup_context=_merge_setup_context
)
refuse_double_backward("cpattn::merge_attention_states_bwd", "cpattn.merge_attention_states")


@torch.library.register_fake("cpattn::cache_store_")
def _cache_store_fake(k_cache, v_cache, k, v, start, rank, world, interleave):
    return None


@torch.library.register_fake("cpattn::cache_attention_fwd")
def _cache_attention_fake(
    q, k_cache, v_cache, cache_lens, q_start, rank, world, interleave, softmax_scale, causal,
    out_dtype=None, softcap=0.0, alibi_slopes=None, prefix_len=0,
):
    b, sq, h, _ = q.shape
    out = q.new_empty(q.shape, dtype=out_dtype if out_dtype is not None else q.dtype)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.register_fake("cpattn::prefill_fwd")
def _prefill_fake(
    q, k, v, k_cache, v_cache, cache_lens, group_name, softmax_scale, layout, interleave, timeout_s,
    softcap=0.0, alibi_slopes=None, prefix_len=0, seqlen=0,
):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake("cpattn::cache_positions")
def _cache_positions_fake(n, rank, world, interleave):
    count = ops.cache_local_count(n, rank, world, interleave)
    return torch.empty((count,), dtype=torch.int64)
