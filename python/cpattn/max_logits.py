"""Each head's largest attention logit over the whole sharded sequence (`return_max_logits=True`).

QK-clip style optimisers (MuonClip) rescale the query / key projections of a head whose largest
logit s_ij = softmax_scale * q_i . k_j grows too large. Under context parallelism a rank sees its
own queries against every key only through the attention kernels, which do not report a max; so
this is a separate pass, run only when asked (no cost otherwise): the keys are all-gathered one KV
head at a time, each rank takes the max over its queries and the keys they see, and one
all-reduce (max) gives every rank the same (heads,) float32 values. The logit is the scaled
score before softcap and ALiBi; a head with no visible pair gets -inf. No gradient flows.

The keys a query sees follow the kernels' mask rule, on global positions. The rule (causal,
window, prefix) lives once, in the header core (csrc/include/cpattn/mask.h): the op
visible_key_ranges gives, on the host, each query's interval of visible keys and the prefix's
end, and this pass only expands those to a (rows, keys) mask on the device, adding what the
placement knows: a key is seen only within its query's document, and padding (position -1)
sees and is seen by nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn.core.device import to_device
from cpattn.core.layout import document_positions, shard_positions
from cpattn.core.options import AttentionOptions

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
    parts = [placement(r) for r in range(world)]  # on the host
    q_pos, q_doc = parts[rank]
    ranges = to_device(key_ranges(q_pos, options), q.device)
    q_doc = to_device(q_doc, q.device)
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
                seen = seen_pairs(ranges[rows], q_doc[rows], k_pos, k_doc)
                scores = (torch.einsum("bqgd,bkd->gbqk", queries[:, rows], keys)
                          * options.softmax_scale)
                scores = scores.masked_fill(~seen, float("-inf"))
                block = scores.flatten(1).amax(dim=1)
                sl = slice(h * group_size, (h + 1) * group_size)
                best[sl] = torch.maximum(best[sl], block)
    if world > 1:
        dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    return best


def key_ranges(positions: torch.Tensor, options: AttentionOptions) -> torch.Tensor:
    """(N, 3) int64 on the host: for each query at global positions (N,) (CPU int64, -1:
    padding), [first, last, prefix_end] of the keys it sees by the options' mask rule: the
    positions in [first, last] and those below prefix_end (op visible_key_ranges, mask.h)."""
    left, right = options.window
    return torch.ops.cpattn.visible_key_ranges(positions, options.causal, left, right,
                                               options.prefix_len)


def seen_pairs(ranges, q_doc, k_pos, k_doc) -> torch.Tensor:
    """(rows, keys) bool: the keys at positions k_pos (-1: padding) that each query row sees, by
    its key_ranges row, within its document."""
    first, last, prefix_end = ranges[:, 0:1], ranges[:, 1:2], ranges[:, 2:3]
    j = k_pos[None, :]
    in_rule = ((j >= first) & (j <= last)) | (j < prefix_end)
    return in_rule & (q_doc[:, None] == k_doc[None, :]) & (j >= 0)


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
