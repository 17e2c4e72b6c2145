"""float64 reference attention in plain torch, on the global-position mask rule of docs/design.md.

Query row r sits at position q_offset + r, key column c at k_offset + c; key j is visible to
query i iff (not causal or j <= i) and (left < 0 or j >= i - left) and
(right < 0 or j <= i + right), or j < prefix_len (prefix-LM). Score options in docs/design.md's
order: scaled score, softcap cap * tanh(s / cap), ALiBi -slope_h * |i - j|, mask, softmax whose
denominator holds exp(sink_h).
A row that sees no key has out 0 and lse -inf (with a sink: lse = sink). Importable from spawned
ranks (no pytest needed).
"""

from __future__ import annotations

import math

import torch

Window = tuple[int, int]


def visible_mask(
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    window: Window,
    q_offset: int,
    k_offset: int,
    prefix_len: int = 0,
) -> torch.Tensor:
    """Bool (Sq, Sk): True where local key c is visible to local query r."""
    # Deliberately a copy of the rule (csrc/include/cpattn/mask.h is its home): a test oracle
    # must not share the code it checks, so this one is written from docs/design.md alone.
    i = torch.arange(seqlen_q, dtype=torch.int64)[:, None] + q_offset
    j = torch.arange(seqlen_k, dtype=torch.int64)[None, :] + k_offset
    left, right = window
    vis = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if left >= 0:
        vis &= j >= i - left
    if right >= 0:
        vis &= j <= i + right
    return vis | (j < prefix_len)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    window: Window = (-1, -1),
    scale: float | None = None,
    q_offset: int | None = None,
    k_offset: int = 0,
    compute_dtype: torch.dtype = torch.float64,
    sinks: torch.Tensor | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    prefix_len: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention in plain torch, differentiable; returns out (B, Sq, H, Dv), lse (B, H, Sq).
    prefix_len: an int, or a tensor (B,): one prefix per sequence of the batch.

    Inputs are cast to compute_dtype (float64 for the reference; a low dtype to measure torch's
    own error in that dtype). q_offset defaults to Sk - Sq (bottom-right alignment, as the public
    API). K/V heads are repeated for GQA here only. lse is returned in compute_dtype.
    """
    if isinstance(prefix_len, torch.Tensor):  # each sequence with its own prefix
        parts = [reference_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], causal, window, scale,
                                     q_offset, k_offset, compute_dtype, sinks, softcap,
                                     alibi_slopes, int(prefix_len[b])) for b in range(q.shape[0])]
        return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])
    seqlen_q, heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    seqlen_k, kv_heads = k.shape[1], k.shape[2]
    if q_offset is None:
        q_offset = seqlen_k - seqlen_q
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype).repeat_interleave(group, dim=2)
    vc = v.to(compute_dtype).repeat_interleave(group, dim=2)

    vis = visible_mask(seqlen_q, seqlen_k, causal, window, q_offset, k_offset, prefix_len)
    nonempty = vis.any(dim=-1)  # (Sq,)
    s = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi_slopes is not None:
        i = torch.arange(seqlen_q, dtype=compute_dtype)[:, None] + q_offset
        j = torch.arange(seqlen_k, dtype=compute_dtype)[None, :] + k_offset
        s = s - alibi_slopes.to(compute_dtype)[:, None, None] * (i - j).abs()
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        # the sink is one more logit in every row, with value 0: never an empty row
        sink = sinks.to(compute_dtype)[None, :, None, None].expand(s.shape[0], -1, seqlen_q, 1)
        lse = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
        p = torch.exp(s - lse[..., None])
        return torch.einsum("bhqk,bkhd->bqhd", p, vc), lse
    # Empty rows get finite dummy scores (zeroed below) so that no inf - inf reaches autograd.
    s = s.masked_fill(~nonempty[:, None], 0.0)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]) * vis.to(compute_dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vc)
    lse = lse.masked_fill(~nonempty, float("-inf"))
    return out, lse


def reference_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, causal: bool
) -> torch.Tensor:
    """float64 out (B, len(rows), H, Dv) of the query rows `rows` only, for problems whose full
    score matrix would not fit (the demos); bottom-right aligned as the public API."""
    offset = k.shape[1] - q.shape[1]
    return torch.cat([reference_attention(q[:, r:r + 1], k, v, causal, q_offset=r + offset)[0]
                      for r in rows.tolist()], dim=1)
