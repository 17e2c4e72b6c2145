"""Each head's largest attention logit over the whole sharded sequence (`return_max_logits=True`).

QK-clip style optimisers (MuonClip) rescale the query / key projections of a head whose largest
logit s_ij = softmax_scale * q_i . k_j grows too large. Under context parallelism a rank sees its
own queries against every key only through the attention kernels, which do not report a max; so
this is a separate pass, run only when asked (no cost otherwise): the keys are all-gathered one KV
head at a time, each rank takes the max over its queries and the keys they see (the same mask
rule as the kernels, on global positions: causal, window, prefix, documents, padding), and one
all-reduce (max) gives every rank the same (heads,) float32 values. The logit is the scaled
score before softcap and ALiBi; a head with no visible pair gets -inf. No gradient flows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn._device import to_device
from cpattn._layout import document_positions, shard_positions
from cpattn.options import AttentionOptions

Placement = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # rank -> (position, document)
QUERY_ROWS = 512  # query rows scored at a time: bounds the (rows x sequence) score block


def global_max_logits(q: torch.Tensor, k: torch.Tensor, group, placement: Placement,
                      options: AttentionOptions) -> torch.Tensor:
    """q (B, S_local, H, D), k (B, S_local, Hkv, D): this rank's tokens; placement(r): the
    global position (-1: padding) and document of rank r's local tokens; the options' scale and
    mask rule (causal, window, prefix). Returns (H,) float32, the same on every rank of
    `group`."""
    if torch.compiler.is_compiling():
        raise ValueError("cpattn: return_max_logits is not supported under torch.compile yet "
                         "(its pass runs collectives in Python): call the attention eagerly")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q_pos, q_doc = (to_device(t, q.device) for t in placement(rank))
    parts = [placement(r) for r in range(world)]
    k_pos = to_device(torch.cat([p for p, _ in parts]), q.device)
    k_doc = to_device(torch.cat([d for _, d in parts]), q.device)
    heads, kv_heads = q.shape[2], k.shape[2]
    group_size = heads // kv_heads
    best = torch.full((heads,), float("-inf"), dtype=torch.float32, device=q.device)
    with torch.no_grad():
        for h in range(kv_heads):
            keys = comm.all_gather(k[:, :, h].contiguous(), dim=1, group=group).float()
            queries = q[:, :, h * group_size:(h + 1) * group_size].float()
            for start in range(0, q.shape[1], QUERY_ROWS):
                rows = slice(start, start + QUERY_ROWS)
                seen = _visible(q_pos[rows], q_doc[rows], k_pos, k_doc, options)
                scores = (torch.einsum("bqgd,bkd->gbqk", queries[:, rows], keys)
                          * options.softmax_scale)
                scores = scores.masked_fill(~seen, float("-inf"))
                block = scores.flatten(1).amax(dim=1)
                sl = slice(h * group_size, (h + 1) * group_size)
                best[sl] = torch.maximum(best[sl], block)
    if world > 1:
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    return best


def _visible(q_pos, q_doc, k_pos, k_doc, options: AttentionOptions) -> torch.Tensor:
    """(rows, keys) bool: the mask rule (docs/design.md) on positions within the documents."""
    i, j = q_pos[:, None], k_pos[None, :]
    seen = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool, device=q_pos.device)
    if options.causal:
        seen &= j <= i
    left, right = options.window
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    if options.prefix_len:
        seen |= j < options.prefix_len
    return seen & (q_doc[:, None] == k_doc[None, :]) & (i >= 0) & (j >= 0)


def sequence_placement(seqlen: int, layout: str, world: int) -> Placement:
    """One sequence of seqlen tokens sharded by `layout` (padding slots: position -1)."""

    def placement(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = shard_positions(seqlen, layout, world, rank)
        return pos, torch.zeros_like(pos)

    return placement


def document_placement(docs: torch.Tensor, layout: str, world: int) -> Placement:
    """Packed documents of lengths `docs` sharded per document (cpattn.shard_varlen's layout):
    positions within the documents, each token's document (-1: padding)."""
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), docs.cumsum(0)])

    def placement(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        index, within = document_positions(docs, layout, world, rank)
        doc = torch.searchsorted(cu, index.clamp(min=0), right=True) - 1
        return within, torch.where(index >= 0, doc, -1)

    return placement
