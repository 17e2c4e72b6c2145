"""Local (single-device) attention: the primitive every context-parallel strategy builds on."""

from typing import Optional, Union

import torch

from cpattn import _ops
from cpattn._validation import check_scale, check_score_options, check_window


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
    softmax_scale: Optional[float] = None, window: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    # score options (DESIGN.md order)
    sinks: Optional[torch.Tensor] = None, softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None, prefix_len: int = 0,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Exact softmax attention, differentiable with respect to q, k, v (and sinks).

    Args:
        q: (batch, seqlen_q, heads, head_dim), float32 / bfloat16 / float16.
        k: (batch, seqlen_k, kv_heads, head_dim); heads % kv_heads == 0 (GQA / MQA).
        v: (batch, seqlen_k, kv_heads, head_dim_v); head_dim_v may differ from head_dim (MLA).
        causal: key j is visible to query i only if j <= i.
        softmax_scale: defaults to 1 / sqrt(head_dim).
        window: (left, right) sliding window, -1 = unbounded: i - left <= j <= i + right.
        return_lse: also return the log-sum-exp of the scores.
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
    softmax_scale = check_scale("cpattn.attention", softmax_scale, max(q.shape[-1], 1))
    window = check_window(window, "cpattn.attention")
    softcap, prefix_len = check_score_options("cpattn.attention", softcap, alibi_slopes,
                                              prefix_len)
    # no positions given: the op aligns the rows bottom-right
    out, lse = _ops.attention_fwd(
        q, k, v, float(softmax_scale), bool(causal), window, None, None, None, softcap,
        alibi_slopes, sinks, prefix_len,
    )
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
