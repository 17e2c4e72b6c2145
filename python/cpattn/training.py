"""Batch sharding and the loss for training with context parallelism.

The two places where context parallelism goes silently wrong outside attention are labels and
positions: shifting labels inside each shard drops one target per shard boundary, and positions
that are not the tokens' global positions give RoPE the wrong angles. `shard_batch` shifts labels
over the whole sequence before sharding and returns global `position_ids`; `cross_entropy`
averages over the tokens of every rank, not per rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from cpattn.parallel import ContextParallel

IGNORE_INDEX = -100


def shard_batch(
    batch: dict[str, Any],
    cp: ContextParallel,
    *,
    seq_dim: int = 1,
    ignore_index: int = IGNORE_INDEX,
) -> dict[str, Any]:
    """This rank's part of a causal-LM batch, with global positions and globally shifted labels.

    Args:
        batch: full (unsharded) batch, the same on every rank of cp's group: "input_ids"
            (batch, seqlen) (or "inputs_embeds" (batch, seqlen, hidden)), optionally "labels"
            (batch, seqlen) (the tokens themselves, as for transformers), "attention_mask"
            (batch, seqlen) and any other tensor with `seqlen` entries along `seq_dim`.
        cp: the ContextParallel settings.
        ignore_index: label of positions without a target.

    Returns a new dict: every token-aligned tensor sharded along seq_dim; "position_ids"
    (int64, (batch, seqlen / W)): the global positions of the local tokens (pass them to the
    model, e.g. for RoPE); "shift_labels" (batch, seqlen / W) instead of "labels": the next
    token of each position over the whole sequence, `ignore_index` at the last one (give them to
    `cpattn.cross_entropy`, not to the model, which would shift them again). An all-ones
    "attention_mask" is dropped; one with padding raises (padded batches are not supported:
    pack documents with cpattn.ring_attention_varlen instead). Other entries pass through.
    """
    what = "cpattn.shard_batch"
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    if key not in batch or not isinstance(batch[key], torch.Tensor):
        raise ValueError(f"{what}: batch needs a tensor 'input_ids' or 'inputs_embeds', got keys "
                         f"{sorted(batch)}")
    if "position_ids" in batch:
        raise ValueError(f"{what}: batch already has 'position_ids'; shard_batch makes the global "
                         "ones itself: remove them")
    if "shift_labels" in batch:
        raise ValueError(f"{what}: batch already has 'shift_labels'; give the unshifted 'labels'")
    bsz, seqlen = batch[key].shape[0], batch[key].shape[seq_dim]
    cp.check_seqlen(seqlen, what)
    mask = batch.get("attention_mask")
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(
            f"{what}: attention_mask has padding (zeros); cpattn cannot apply a padding mask "
            "under context parallelism. Pack the documents without padding and use "
            "cpattn.ring_attention_varlen, or trim the batch to equal lengths"
        )
    index = cp.positions(seqlen, device=batch[key].device)
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if name == "attention_mask":
            continue  # all ones: nothing to mask
        if name == "labels":
            if value.dim() < 2 or value.shape[seq_dim] != seqlen:
                raise ValueError(f"{what}: labels must have seqlen {seqlen} along dim {seq_dim}, "
                                 f"got shape {tuple(value.shape)}")
            pad = torch.full_like(value.narrow(seq_dim, 0, 1), ignore_index)
            shifted = torch.cat([value.narrow(seq_dim, 1, seqlen - 1), pad], seq_dim)
            out["shift_labels"] = shifted.index_select(seq_dim, index.to(value.device))
        elif (isinstance(value, torch.Tensor) and value.dim() > seq_dim
              and value.shape[seq_dim] == seqlen):
            out[name] = value.index_select(seq_dim, index.to(value.device))
        else:
            out[name] = value
    out["position_ids"] = index[None, :].expand(bsz, -1).contiguous()
    return out


def _sum(x: torch.Tensor, groups: tuple) -> torch.Tensor:
    """x summed over the ranks of the product of `groups` (one all-reduce per group; for hybrid,
    the ring x Ulysses grid of ranks). A new tensor."""
    x = x.clone()
    for group in groups:
        dist.all_reduce(x, group=group)
    return x


class _SumOverGroups(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradients too: every rank uses the sum."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return _sum(x, groups)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.groups), None  # (a copy: never write into an incoming gradient)


def _loss_groups(cp: Optional[ContextParallel], group) -> tuple:
    """The groups whose product holds the ranks the loss averages over: `group`, else cp's
    sequence (for hybrid: its Ulysses and ring groups). A given group must hold every rank that
    shares this rank's sequence (cp's), else the mean would miss some of its tokens."""
    what = "cpattn.cross_entropy"
    if group is None:
        if cp is None:
            raise ValueError(f"{what}: give cp (the ContextParallel settings) or group")
        if cp.strategy == "hybrid":
            return (cp.ulysses_group, cp.ring_group)
        return (cp.group,)
    if cp is not None:
        members = set(dist.get_process_group_ranks(group))
        peers = [cp.ulysses_group, cp.ring_group] if cp.strategy == "hybrid" else [cp.group]
        missing = sorted(set().union(*(dist.get_process_group_ranks(g) for g in peers)) - members)
        if missing:
            raise ValueError(
                f"{what}: group (ranks {sorted(members)}) must hold every rank of cp's sequence "
                f"group, but misses ranks {missing}: pass the group of all data-parallel x "
                "context-parallel ranks (e.g. the flattened dp x cp mesh), or no group for cp's"
            )
    return (group,)


def cross_entropy(
    logits: torch.Tensor,
    shift_labels: torch.Tensor,
    cp: Optional[ContextParallel] = None,
    *,
    group=None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored tokens of every rank of the group.

    Args:
        logits: (batch, seqlen / W, vocab), this rank's tokens.
        shift_labels: (batch, seqlen / W) from `shard_batch` (already shifted).
        cp: the ContextParallel settings; without `group`, the mean runs over the ranks that
            share the sequence (for hybrid: the ring x Ulysses ranks).
        group: the ranks whose tokens the mean runs over. Give the flattened data-parallel x
            context-parallel group to average over the whole global batch. With cp, it must
            hold every rank of cp's sequence (else ValueError).

    Returns the same scalar on every rank (float32; float64 for float64 logits): the sum of the
    token losses of all ranks divided by the number of non-ignored tokens of all ranks (not a
    mean of per-rank means).
    Gradients: each rank's backward gives the gradient of this loss times the group size, so
    that averaging the parameter gradients over the group (what DDP and FSDP do over their
    group) gives exactly the gradient of the global mean; see README "Training a transformers
    model with context parallelism".
    """
    groups = _loss_groups(cp, group)
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"cpattn.cross_entropy: logits (batch, seqlen, vocab) and shift_labels "
            f"(batch, seqlen) disagree: {tuple(logits.shape)} vs {tuple(shift_labels.shape)}"
        )
    token_loss = torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32)),
        shift_labels.flatten().to(logits.device), ignore_index=ignore_index, reduction="sum",
    )
    count = (shift_labels != ignore_index).sum().to(torch.float32)
    total = _SumOverGroups.apply(token_loss, groups)
    count = _sum(count.to(total.device), groups)
    # All tokens ignored everywhere: 0 with zero gradients, not NaN.
    return total / count.clamp(min=1)
