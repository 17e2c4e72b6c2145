"""Local (single-device) attention: the primitive every context-parallel strategy builds on."""

from typing import Union

import torch

from cpattn.core.autograd import once_differentiable
from cpattn.core.layout import LAYOUTS, PackedDocuments, doc_args
from cpattn.core.options import AttentionOptions
from cpattn.core.validation import check_qkv, document_lengths, error
from cpattn.invariant import InvariantAttention, check_invariant_call


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Exact softmax attention, differentiable with respect to q, k, v (and sinks).

    Args:
        q: (batch, seqlen_q, heads, head_dim), float32 / bfloat16 / float16.
        k: (batch, seqlen_k, kv_heads, head_dim); heads % kv_heads == 0 (GQA / MQA).
        v: (batch, seqlen_k, kv_heads, head_dim_v); head_dim_v may differ from head_dim (MLA).
        return_lse: also return the log-sum-exp of the scores.

    The attention options (keyword arguments; cpattn.AttentionOptions, the same for every
    attention function of cpattn, on global positions there):
        causal: key j is visible to query i only if j <= i (default False).
        softmax_scale: defaults to 1 / sqrt(head_dim).
        window: (left, right) sliding window, -1 = unbounded: i - left <= j <= i + right.
        sinks: (heads,) attention-sink logits (gpt-oss): exp(sinks[h]) joins every row's softmax
            denominator, with no value. Differentiable.
        softcap: > 0 caps the scaled score s to softcap * tanh(s / softcap) (Gemma 2); 0: off.
        alibi_slopes: (heads,) float: adds -slope_h * |i - j| (positions i, j) to the score.
            Fixed slopes: they get no gradient (a tensor that requires grad is refused).
        prefix_len: prefix-LM: keys at positions < prefix_len are visible to every query
            (with causal=True: bidirectional inside the prefix); 0: off.

    The score is computed in this order: scale, softcap, ALiBi, mask, softmax with the sink.
    When seqlen_q != seqlen_k, positions are bottom-right aligned (as flash-attn): query i sits
    at position i + seqlen_k - seqlen_q, so a single decode query sees every key.
    A query that sees no key gets output 0 and LSE -inf (with a sink: LSE = sinks[h]).

    Returns:
        out (batch, seqlen_q, heads, head_dim_v) in q's dtype, and with return_lse the LSE
        (batch, heads, seqlen_q), float32, natural log, of the softmax applied: with sinks,
        log(exp(sinks[h]) + sum_j exp(s_ij)). Gradients flow through both.
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            "cpattn.attention: q and k must be (batch, seqlen, heads, head_dim), got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    opts = AttentionOptions.checked("cpattn.attention", q.shape[-1], **options)
    if opts.invariant:  # the one-rank case of ring_attention(invariant=True)
        check_invariant_call("cpattn.attention", q)
        out, lse = InvariantAttention.apply(q, k, v, opts.sinks, opts, None, 0, 1,
                                            LAYOUTS["contiguous"], k.shape[1], k.shape[2], None)
        return (out, lse) if return_lse else out
    # no positions given: the op aligns the rows bottom-right
    out, lse = torch.ops.cpattn.attention_fwd(q, k, v, sinks=opts.sinks, **opts.op_kwargs())
    return (out, lse) if return_lse else out


def merge_state_(
    out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor
) -> None:
    """Merges a partial attention result into a running one, in place and exactly.

    out (batch, seqlen, heads, head_dim) float32 and lse (batch, heads, seqlen) float32 hold the
    result over one set of keys; part_out / part_lse over a disjoint set. Afterwards they hold
    the result over the union. Rows empty on both sides stay (0, -inf).
    """
    torch.ops.cpattn.merge_state_(out, lse, part_out, part_lse)


class LocalDocuments(torch.autograd.Function):
    """Attention over packed documents held whole by this process (the op attention_varlen_fwd:
    the all-gather strategy's steps over one rank, no padding); docs a PackedDocuments."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, docs, options):
        out, lse = torch.ops.cpattn.attention_varlen_fwd(q, k, v, *doc_args(docs), sinks,
                                                         **options.op_kwargs())
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.docs, ctx.options = docs, options
        return out, lse

    @staticmethod
    @once_differentiable("cpattn.attention_varlen")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = torch.ops.cpattn.attention_varlen_bwd(dout, q, k, v, out, lse,
                                                           *doc_args(ctx.docs), dlse,
                                                           **ctx.options.op_kwargs())
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            dsinks = torch.ops.cpattn.sink_bwd(dout, out, lse, sinks, dlse).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None


def attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, return_lse: bool = False,
    **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention over packed documents in one process (no communication): q (T, H, D), k / v
    (T, Hkv, D) hold the documents of cu_seqlens (int, D+1, from 0, ending at T) one after the
    other; a document never attends to another. Options as cpattn.attention but prefix_len, on
    positions within each document. Returns out (T, H, Dv) and optionally lse (H, T).
    Differentiable."""
    what = "cpattn.attention_varlen"
    check_qkv(what, q, k, v, varlen=True, v_head_dim_free=True)
    opts = AttentionOptions.checked(what, q.shape[-1], {"prefix_len": 0}, **options)
    out, lse = varlen_attention(q, k, v, cu_seqlens, opts)
    return (out, lse) if return_lse else out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                     opts: AttentionOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_varlen's out and lse with options checked already: its tensors' and options'
    checks are the caller's (attention_varlen's, or Ulysses' at its public boundary)."""
    what = "cpattn.attention_varlen"
    docs, tokens, _ = document_lengths(what, cu_seqlens)
    if tokens != q.shape[0]:
        raise error(what, "cu_seqlens", f"[..., {tokens}]", f"must end at the {q.shape[0]} "
                    "tokens of q")
    if opts.invariant:  # the one-rank case of ring_attention_varlen(invariant=True)
        check_invariant_call(what, q)
        out, lse = InvariantAttention.apply(q[None], k[None], v[None], opts.sinks, opts, None, 0,
                                            1, LAYOUTS["contiguous"], tokens, k.shape[1],
                                            PackedDocuments(docs))
        return out[0], lse[0]
    out, lse = LocalDocuments.apply(q[None], k[None], v[None], opts.sinks,
                                    PackedDocuments(docs), opts)
    return out[0], lse[0]
