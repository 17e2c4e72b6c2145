"""Fake (meta) kernels and autograd for every compiled op in torch.ops.cpattn.

The schemas live in C++ (csrc/bindings/registration.cpp); this file only describes output
shapes for tracing (torch.compile, meta tensors) and wires the backward. Imported once, by
cpattn/__init__.py, right after the extension is loaded.
"""

import torch

from cpattn.core.autograd import refuse_double_backward
from cpattn.core.options import OP_OPTION_NAMES

ops = torch.ops.cpattn


def _check_same_device(names: str, *tensors: torch.Tensor) -> None:
    """Mixed devices, e.g. a CPU q with meta k, dispatch to these fake kernels (meta outranks
    CPU) and would silently return an uninitialised tensor: raise like the real kernels do."""
    devices = [t.device for t in tensors]
    torch._check(
        all(d == devices[0] for d in devices),
        lambda: f"cpattn: {names} must be on the same device, got {', '.join(map(str, devices))}",
    )


# Every attention op ends with the attention options (csrc/ops/options.h; Python passes them by
# name, cpattn.core.options.AttentionOptions.op_kwargs). The fakes ignore them: the dispatcher
# may hand them over positionally (those left at their defaults dropped) or by name.


@torch.library.register_fake("cpattn::attention_fwd")
def _attention_fwd_fake(q, k, v, q_offset=None, k_offset=None, out_dtype=None, sinks=None,
                        *options, **named_options):
    _check_same_device("q, k and v", q, k, v)
    b, sq, h, _ = q.shape
    out = q.new_empty(
        (b, sq, h, v.shape[-1]), dtype=out_dtype if out_dtype is not None else q.dtype
    )
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


@torch.library.register_fake("cpattn::attention_bwd")
def _attention_bwd_fake(dout, q, k, v, out, lse, q_offset=None, k_offset=None, grad_dtype=None,
                        dlse=None, row_dot=None, *options, **named_options):
    given = [t for t in (out, row_dot) if t is not None]
    torch._check(len(given) == 1, lambda: "cpattn: attention_bwd needs exactly one of out and "
                 "row_dot")
    _check_same_device("dout, q, k, v, out (or row_dot) and lse", dout, q, k, v, *given, lse)

    def like(t):
        return t.new_empty(t.shape, dtype=grad_dtype if grad_dtype is not None else t.dtype)

    return like(q), like(k), like(v)


@torch.library.register_fake("cpattn::attention_bwd_in_dout")
def _attention_bwd_in_dout_fake(dout, q, k, v, out, lse, q_offset=None, k_offset=None, dlse=None,
                                row_dot=None, *options, **named_options):
    _, dk, dv = _attention_bwd_fake(dout, q, k, v, out, lse, row_dot=row_dot)
    return dk, dv


@torch.library.register_fake("cpattn::merge_state_")
def _merge_state_fake(out, lse, part_out, part_lse):
    _check_same_device("merge out, lse, part_out and part_lse", out, lse, part_out, part_lse)
    return None


@torch.library.register_fake("cpattn::apply_sinks_")
def _apply_sinks_fake(out, lse, sinks):
    _check_same_device("out, lse and sinks", out, lse, sinks)
    return None


@torch.library.register_fake("cpattn::row_dot")
def _row_dot_fake(a, b):
    _check_same_device("a and b", a, b)
    batch, seqlen, heads, _ = a.shape
    return a.new_empty((batch, heads, seqlen), dtype=torch.float32)


@torch.library.register_fake("cpattn::sink_bwd")
def _sink_bwd_fake(dout, out, lse, sinks, dlse=None):
    _check_same_device("dout, out, lse and sinks", dout, out, lse, sinks)
    return sinks.new_empty(sinks.shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, q_offset, k_offset, _, sinks, *options = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks)
    ctx.offsets = (q_offset, k_offset)
    ctx.options = dict(zip(OP_OPTION_NAMES, options))


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, sinks = ctx.saved_tensors
    dout = dout.contiguous()
    dq, dk, dv = ops.attention_bwd(dout, q, k, v, out, lse, *ctx.offsets, dlse=dlse,
                                   **ctx.options)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[6]:
        dsinks = ops.sink_bwd(dout, out, lse, sinks, dlse).to(sinks.dtype)
    return dq, dk, dv, None, None, None, dsinks, *([None] * len(OP_OPTION_NAMES))


torch.library.register_autograd("cpattn::attention_fwd", _backward, setup_context=_setup_context)
refuse_double_backward("cpattn::attention_bwd", "cpattn.attention")


# Context-parallel ops (csrc/ops/ring.cpp): outputs in the inputs' dtypes, LSE float32.


@torch.library.register_fake("cpattn::ring_fwd")
def _ring_fwd_fake(q, k, v, group_name, layout, timeout_s, doc_lengths=None,
                   doc_prefix_lens=None, sinks=None, *options, **named_options):
    _check_same_device("q, k and v", q, k, v)
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake("cpattn::ring_bwd")
def _ring_bwd_fake(dout, q, k, v, out, lse, group_name, layout, timeout_s, doc_lengths=None,
                   doc_prefix_lens=None, dlse=None, *options, **named_options):
    _check_same_device("dout, q, k, v, out and lse", dout, q, k, v, out, lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("cpattn::visible_keys")
def _visible_keys_fake(positions, num_keys, causal, window_left, window_right, prefix_len):
    return positions.new_empty(positions.shape, dtype=torch.int64)


@torch.library.register_fake("cpattn::visible_key_ranges")
def _visible_key_ranges_fake(positions, causal, window_left, window_right, prefix_len):
    return positions.new_empty((positions.shape[0], 3), dtype=torch.int64)


@torch.library.register_fake("cpattn::gathered_fwd")
def _gathered_fwd_fake(q, k_all, v_all, rank, layout, doc_lengths=None, doc_prefix_lens=None,
                       sinks=None, *options, **named_options):
    _check_same_device("q, k_all and v_all", q, k_all, v_all)
    b, s, h, _ = q.shape  # k_all (W, B, S, Hkv, D), v_all (W, B, S, Hkv, Dv)
    return (q.new_empty((b, s, h, v_all.shape[-1])),
            q.new_empty((b, h, s), dtype=torch.float32))


@torch.library.register_fake("cpattn::gathered_bwd")
def _gathered_bwd_fake(dout, q, k_all, v_all, out, lse, rank, layout, doc_lengths=None,
                       doc_prefix_lens=None, dlse=None, *options, **named_options):
    _check_same_device("dout, q, k_all, v_all, out and lse", dout, q, k_all, v_all, out, lse)
    dkv_all = (*k_all.shape[:-1], k_all.shape[-1] + v_all.shape[-1])  # dK, dV side by side
    return q.new_empty(q.shape), k_all.new_empty(dkv_all, dtype=torch.float32)


@torch.library.register_fake("cpattn::attention_varlen_fwd")
def _attention_varlen_fwd_fake(q, k, v, doc_lengths, doc_prefix_lens=None, sinks=None, *options,
                               **named_options):
    _check_same_device("q, k and v", q, k, v)
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake("cpattn::attention_varlen_bwd")
def _attention_varlen_bwd_fake(dout, q, k, v, out, lse, doc_lengths, doc_prefix_lens=None,
                               dlse=None, *options,
                               **named_options):
    _check_same_device("dout, q, k, v, out and lse", dout, q, k, v, out, lse)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.register_fake("cpattn::invariant_fwd")
def _invariant_fwd_fake(q, k, v, rank, world, layout, seqlen, doc_lengths=None,
                        doc_prefix_lens=None, sinks=None, *options, **named_options):
    _check_same_device("q, k and v", q, k, v)
    b, s, h, _ = q.shape
    return q.new_empty((b, s, h, v.shape[-1])), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake("cpattn::invariant_bwd")
def _invariant_bwd_fake(dout, q, k, v, out, lse, dlse, sinks, layout, seqlen, doc_lengths=None,
                        doc_prefix_lens=None, *options, **named_options):
    _check_same_device("dout, q, k, v, out and lse", dout, q, k, v, out, lse)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty((q.shape[2] if sinks is not None else 0,), dtype=torch.float32))


@torch.library.register_fake("cpattn::invariant_bwd_part")
def _invariant_bwd_part_fake(dq_sum, dk_sum, dv_sum, dout, q, k, v, lse, shifted, dout_part,
                             q_part, k_part, v_part, *args, **named_options):
    _check_same_device("the sums, q, k, v and the parts", dq_sum, dk_sum, dv_sum, q, k, v,
                       q_part, k_part, v_part)


@torch.library.register_fake("cpattn::invariant_sink_bwd")
def _invariant_sink_bwd_fake(lse_all, shifted_all, sinks, rank, world, layout, seqlen,
                             doc_lengths=None):
    return lse_all.new_empty((lse_all.shape[1],))


@torch.library.register_fake("cpattn::invariant_partial")
def _invariant_partial_fake(q, k, v, q_begin, k_begin, *options, **named_options):
    _check_same_device("q, k and v", q, k, v)
    b, s, h, _ = q.shape
    return (q.new_empty((b, s, h, v.shape[-1]), dtype=torch.float32),
            q.new_empty((b, h, s), dtype=torch.float32))


@torch.library.register_fake("cpattn::invariant_merge")
def _invariant_merge_fake(outs, lses, tiles, sinks=None, out_dtype=None):
    return outs[0].new_empty(outs.shape[1:], dtype=out_dtype or torch.float32), \
        lses[0].new_empty(lses.shape[1:])


@torch.library.register_fake("cpattn::layout_positions")
def _layout_positions_fake(seqlen, world, rank, layout):
    return torch.empty((seqlen // world,), dtype=torch.int64)


# Inference over a KV cache sharded across ranks (csrc/ops/inference.cpp).


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
def _cache_attention_fake(q, k_cache, v_cache, cache_lens, q_start, rank, world, interleave,
                          out_dtype=None, *options, **named_options):
    b, sq, h, _ = q.shape
    out = q.new_empty(q.shape, dtype=out_dtype if out_dtype is not None else q.dtype)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.register_fake("cpattn::prefill_fwd")
def _prefill_fake(q, k, v, k_cache, v_cache, cache_lens, group_name, layout, interleave,
                  timeout_s, seqlen=0, *options, **named_options):
    b, s, h, _ = q.shape
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty((b, h, s), dtype=torch.float32)


@torch.library.register_fake("cpattn::cache_positions")
def _cache_positions_fake(n, rank, world, interleave):
    count = ops.cache_local_count(n, rank, world, interleave)
    return torch.empty((count,), dtype=torch.int64)
