"""float64 reference attention in plain torch, on global positions (the rule of DESIGN.md)."""

import math
from typing import Optional

import torch


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    window: tuple[int, int],
    q_offset: int = 0,
    k_offset: int = 0,
) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: key c visible to query r (positions q_offset + r, k_offset + c)."""
    i = torch.arange(seqlen_q)[:, None] + q_offset
    j = torch.arange(seqlen_k)[None, :] + k_offset
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window[0] >= 0:
        vis &= j >= i - window[0]
    if window[1] >= 0:
        vis &= j <= i + window[1]
    return vis


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    q_offset: Optional[int] = None,
    k_offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in float64 (differentiable). q (B, Sq, H, D), k/v (B, Sk, Hkv, D).

    q_offset defaults to bottom-right alignment (Sk - Sq). Rows that see no key give out 0 and
    lse -inf. Returns out (B, Sq, H, D) and lse (B, H, Sq), both float64.
    """
    q, k, v = (t.double() for t in (q, k, v))
    b, sq, h, d = q.shape
    sk = k.shape[1]
    group = h // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if q_offset is None:
        q_offset = sk - sq
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    vis = visible_mask(sq, sk, causal, window, q_offset, k_offset)
    scores = scores.masked_fill(~vis, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - -inf) is NaN for empty rows: subtract a finite stand-in there.
    probs = torch.exp(scores - torch.where(lse.isinf(), 0.0, lse)[..., None])
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse
