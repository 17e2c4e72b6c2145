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

from cpattn.parallel import PLAN_STRATEGIES, ContextParallel
from cpattn.sharding.documents import shard_documents
from cpattn.sharding.packing import (
    FLASH_KEYS,
    KEYWORD,
    Documents,
    Packing,
    check_seq_idx,
    find_packing,
)

IGNORE_INDEX = -100
DOCUMENTS = ("auto", "plan", "per-document")  # shard_batch's documents=


def shard_batch(
    batch: dict[str, Any],
    cp: ContextParallel,
    *,
    seq_dim: int = 1,
    ignore_index: int = IGNORE_INDEX,
    documents: str = "auto",
    causal: bool = True,
    window=(-1, -1),
    split: str = "balanced",
) -> dict[str, Any]:
    """This rank's part of a causal-LM batch, with global positions and globally shifted labels.

    Args:
        batch: full (unsharded) batch, the same on every rank of cp's group: "input_ids"
            (batch, seqlen) (or "inputs_embeds" (batch, seqlen, hidden)), optionally "labels"
            (batch, seqlen) (the tokens themselves, as for transformers), "attention_mask"
            (batch, seqlen), "position_ids" (batch, seqlen), the packed-sequence keys of
            transformers' DataCollatorWithFlattening ("cu_seq_lens_q" / "_k", "max_length_q" /
            "_k"), TRL's padding-free "seq_idx" (checked against the documents, not passed on)
            and any other tensor with `seqlen` entries along `seq_dim`.
        cp: the ContextParallel settings.
        ignore_index: label of positions without a target.
        documents: how packed documents are sharded: "plan" (cpattn.shard_documents: short
            documents whole on one rank, without communication, heavy ones split over as few
            ranks as the balance needs; strategies "ring" and "allgather"), "per-document" (every
            document split over every rank, cpattn.shard_varlen's layout) or "auto" (default):
            "plan" for ring and allgather, "per-document" for ulysses and hybrid.
        causal, window, split: the plan's (cpattn.shard_documents): the mask whose attention
            work it balances (the model's: causal=True, full attention by default; window
            (left, right) as cpattn.attention's) and how it chooses the documents to split
            ("balanced", default: deterministic and independent of the machine; "all",
            "none", "auto": the cost model with its defaults). Layers with another mask
            (sliding and full layers alternating, an encoder's bidirectional attention) run
            exactly on the same tokens, only balanced for this mask.

    Returns a new dict: every token-aligned tensor sharded along seq_dim; "position_ids"
    (int64, (batch, local)): the position ids of the local tokens (pass them to the model, e.g.
    for RoPE); "shift_labels" (batch, local) instead of "labels": the next token of each
    position in its row of the whole batch, `ignore_index` at the last one (give them to
    `cpattn.cross_entropy`, not to the model, which would shift them again).

    Packed documents (cpattn.sharding.packing: position_ids that restart inside a row, the
    collator's cu_seq_lens_q, or an attention_mask with padding, whose rows' real tokens become
    documents) are sharded into one row, by a plan (`documents`; then ranks hold different
    numbers of tokens: "cpattn_documents".plan.tokens[rank]) or per document (as
    cpattn.shard_varlen: each document padded to the layout's granularity and split over the ranks):
    "position_ids" are then the tokens' own position ids (within their documents), padding
    slots get token 0, position 0 and label `ignore_index`, and "cpattn_documents" (a
    cpattn.sharding.packing.Documents, its `plan` the DocumentPlan or None) must be passed to the
    model with the rest (`model(**batch)` does), so that the attention keeps the documents
    apart (every strategy; for hybrid the documents are sharded over the ring and each ring
    shard cut in U parts, see ContextParallel.document_positions). cp.unshard(x, documents=
    batch["cpattn_documents"]) gathers per-token outputs back into the packed sequence. A
    batch of rows of one document each (positions 0, 1, ... or none) is sharded as one
    sequence per row, with "cpattn_documents" None: passed to the model, it tells the attention
    that the batch's position_ids were passed too (needed by models whose attention does not
    receive position_ids, e.g. ModernBERT). The batch's own attention_mask, position_ids and
    flash keys are never passed on (they would describe the unsharded batch).
    """
    what = "cpattn.shard_batch"
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    if key not in batch or not isinstance(batch[key], torch.Tensor) or batch[key].dim() < 2:
        raise ValueError(f"{what}: batch needs a tensor 'input_ids' or 'inputs_embeds' (batch, "
                         f"seqlen, ...), got keys {sorted(batch)}")
    if "shift_labels" in batch:
        raise ValueError(f"{what}: batch already has 'shift_labels'; give the unshifted 'labels'")
    if KEYWORD in batch:
        raise ValueError(f"{what}: batch already has {KEYWORD!r}: it is sharded already")
    bsz, seqlen = batch[key].shape[0], batch[key].shape[seq_dim]
    labels = batch.get("labels")
    if labels is not None and (labels.dim() < 2 or labels.shape[seq_dim] != seqlen):
        raise ValueError(f"{what}: labels must have seqlen {seqlen} along dim {seq_dim}, got "
                         f"shape {tuple(labels.shape)}")
    shifted = None if labels is None else _shift(labels, seq_dim, ignore_index)
    packing = find_packing(batch, key, what) if seq_dim == 1 else None
    if "seq_idx" in batch:
        if seq_dim != 1:
            raise ValueError(f"{what}: seq_idx needs seq_dim=1, got seq_dim={seq_dim}")
        check_seq_idx(batch, packing, key, what)
    if packing is None and seq_dim != 1 and any(
            k in batch for k in ("position_ids", "attention_mask", *FLASH_KEYS)):
        raise ValueError(f"{what}: position_ids, attention_mask and packed-sequence keys need "
                         f"seq_dim=1, got seq_dim={seq_dim}")
    if documents not in DOCUMENTS:
        raise ValueError(f"{what}: documents must be one of {DOCUMENTS}, got {documents!r}")
    if documents == "plan" and not cp.spec.runs_document_plans:
        plan_strategies = " or ".join(map(repr, PLAN_STRATEGIES))
        raise ValueError(f"{what}: documents='plan' needs strategy {plan_strategies} (a "
                         f"DocumentPlan is run by ring_attention_varlen), got {cp.strategy!r}; "
                         "use documents='per-document' (the default 'auto' does)")
    if packing is not None:
        if documents == "plan" or (documents == "auto" and cp.spec.runs_document_plans):
            docs = packing.docs
            plan = shard_documents(list(docs.cu_seqlens), world_size=cp.world_size,
                                   layout=cp.layout, causal=causal, window=window,
                                   split=split)
            packing = Packing(Documents(docs.lengths, docs.starts, plan=plan), packing.source)
        return _shard_packed(batch, cp, key, packing, shifted, ignore_index, what)
    cp.check_seqlen(seqlen, what)
    index = cp.positions(seqlen, device=batch[key].device)
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if name in _NOT_PASSED_ON:
            continue  # the batch's positions are 0, 1, ...; its mask is all ones (find_packing)
        if name == "labels":
            out["shift_labels"] = shifted.index_select(seq_dim, index.to(value.device))
        elif _token_aligned(value, seq_dim, seqlen):
            out[name] = value.index_select(seq_dim, index.to(value.device))
        else:
            out[name] = value
    out["position_ids"] = index[None, :].expand(bsz, -1).contiguous()
    out[KEYWORD] = None  # one sequence per row (passed on: the model got this whole batch)
    return out


_NOT_PASSED_ON = frozenset({"attention_mask", "position_ids", "seq_idx", *FLASH_KEYS})


def _token_aligned(value, seq_dim: int, seqlen: int) -> bool:
    return (isinstance(value, torch.Tensor) and value.dim() > seq_dim
            and value.shape[seq_dim] == seqlen)


def _shift(labels: torch.Tensor, seq_dim: int, ignore_index: int) -> torch.Tensor:
    """Each position's target: the next label of its row, ignore_index at the row's end."""
    seqlen = labels.shape[seq_dim]
    pad = torch.full_like(labels.narrow(seq_dim, 0, 1), ignore_index)
    return torch.cat([labels.narrow(seq_dim, 1, seqlen - 1), pad], seq_dim)


def _shard_packed(batch: dict[str, Any], cp: ContextParallel, key: str, packing: Packing,
                  shifted: Optional[torch.Tensor], ignore_index: int, what: str
                  ) -> dict[str, Any]:
    """shard_batch for packed documents: one row of this rank's tokens of the documents (the
    plan's, or its per-document shards)."""
    docs = packing.docs
    bsz, seqlen = batch[key].shape[:2]
    index, positions = cp.document_positions(docs)
    real = index >= 0
    source = packing.source[index.clamp(min=0)]
    out: dict[str, Any] = {}
    if shifted is not None:
        flat = shifted.reshape(-1)
        dropped = torch.ones(flat.numel(), dtype=torch.bool)
        dropped[packing.source] = False
        if bool((flat[dropped.to(flat.device)] != ignore_index).any()):
            raise ValueError(
                f"{what}: a padding token has a target (its shifted label is not {ignore_index}):"
                f" padding is dropped under context parallelism, so its loss term would be lost."
                f" Set the labels of padding tokens to {ignore_index}, and with left padding also"
                " the label of each row's first real token (the one a padding token predicts)")
        out["shift_labels"] = torch.where(real.to(flat.device), flat[source.to(flat.device)],
                                          ignore_index)[None]
    for name, value in batch.items():
        if name in _NOT_PASSED_ON or name == "labels":
            continue
        if _token_aligned(value, 1, seqlen) and value.shape[0] == bsz:
            flat = value.flatten(0, 1)
            picked = flat.index_select(0, source.to(value.device))
            keep = real.to(value.device).view(-1, *([1] * (picked.dim() - 1)))
            out[name] = torch.where(keep, picked, torch.zeros_like(picked))[None]
        else:
            out[name] = value
    out["position_ids"] = positions.to(batch[key].device)[None]
    out[KEYWORD] = docs
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
        return cp.groups
    if cp is not None:
        members = set(dist.get_process_group_ranks(group))
        missing = sorted(set().union(*(dist.get_process_group_ranks(g) for g in cp.groups))
                         - members)
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
    num_items_in_batch=None,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy over the non-ignored tokens of every rank of the group.

    Args:
        logits: (batch, seqlen / W, vocab), this rank's tokens.
        shift_labels: (batch, seqlen / W) from `shard_batch` (already shifted).
        cp: the ContextParallel settings; without `group`, the loss runs over the ranks that
            share the sequence (for hybrid: the ring x Ulysses ranks).
        group: the ranks whose tokens the loss runs over. Give the flattened data-parallel x
            context-parallel group to take the whole global batch. With cp, it must hold every
            rank of cp's sequence (else ValueError).
        num_items_in_batch: the number of targets the mean divides by, counted by the caller
            on the full batches before sharding (a positive int or a scalar tensor; transformers'
            Trainer passes it as `num_items_in_batch`): over every rank's tokens and every
            gradient-accumulation micro-batch, so that summing the micro-batches' losses gives
            the exact token mean of the whole step. None (default): the group's targets of
            this call, counted here.
        label_smoothing: in [0, 1): each target's loss is (1 - e) * nll + e * the mean over the
            vocabulary of -log p (torch's and transformers' LabelSmoother's definition).
        reduction: "mean" (default; the sum divided by the number of targets) or "sum" (the
            sum of the token losses of every rank of the group; with num_items_in_batch None).

    Returns the same scalar on every rank (float32; float64 for float64 logits): the sum of the
    token losses of all ranks divided by the number of non-ignored tokens of all ranks (not a
    mean of per-rank means), or by num_items_in_batch; the sum with reduction="sum". All
    targets ignored: 0 with zero gradients.
    Gradients: each rank's backward gives the gradient of this loss times the group size, so
    that averaging the parameter gradients over the group (what DDP and FSDP do over their
    group) gives exactly the gradient of the loss; see docs/transformers.md, "Gradient
    reduction with data parallelism".
    """
    what = "cpattn.cross_entropy"
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{what}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if reduction == "sum" and num_items_in_batch is not None:
        raise ValueError(f"{what}: num_items_in_batch is the divisor of reduction='mean'; "
                         "reduction='sum' takes none")
    groups = _loss_groups(cp, group)
    token_loss = token_loss_sum(logits, shift_labels, ignore_index=ignore_index,
                                label_smoothing=label_smoothing)
    total = _SumOverGroups.apply(token_loss, groups)
    if reduction == "sum":
        return total
    if num_items_in_batch is None:
        count = (shift_labels != ignore_index).sum().to(torch.float32)
        count = _sum(count.to(total.device), groups)
    else:
        count = _items(num_items_in_batch, what).to(total.device, torch.float32)
    # All tokens ignored everywhere: 0 with zero gradients, not NaN.
    return total / count.clamp(min=1)


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor, *,
                   ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0
                   ) -> torch.Tensor:
    """The sum of this rank's token losses (no communication): logits (batch, local, vocab),
    shift_labels (batch, local). float32 (float64 for float64 logits). The one definition of
    the token loss (label smoothing included) behind cross_entropy and the trainers'."""
    what = "cpattn.cross_entropy"
    if logits.shape[:-1] != shift_labels.shape:
        raise ValueError(
            f"{what}: logits (batch, seqlen, vocab) and shift_labels "
            f"(batch, seqlen) disagree: {tuple(logits.shape)} vs {tuple(shift_labels.shape)}"
        )
    if isinstance(label_smoothing, bool) or not (0.0 <= float(label_smoothing) < 1.0):
        raise ValueError(f"{what}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, -2).to(torch.promote_types(logits.dtype, torch.float32)),
        shift_labels.flatten().to(logits.device), ignore_index=ignore_index, reduction="sum",
        label_smoothing=float(label_smoothing),
    )


def _items(num_items_in_batch, what: str) -> torch.Tensor:
    """num_items_in_batch as a scalar tensor, checked."""
    n = num_items_in_batch
    if isinstance(n, bool) or not isinstance(n, (int, float, torch.Tensor)) or (
            isinstance(n, torch.Tensor) and n.numel() != 1):
        raise ValueError(f"{what}: num_items_in_batch must be a number or a scalar tensor, got "
                         f"{n!r}")
    return torch.as_tensor(n).reshape(())


def load_balancing_loss(router_logits, cp: ContextParallel, num_experts: int, top_k: int,
                        documents: Optional[Documents] = None) -> torch.Tensor:
    """The MoE auxiliary load-balancing loss (transformers' `load_balancing_loss_func`, Switch
    Transformer eq. 4-6) over the tokens of every rank of cp's sequence, the same on every
    rank: equal to one process's over the whole sequence (transformers' own, computed inside
    the model, averages over each rank's tokens only).

    router_logits: the model output's `router_logits` (with output_router_logits=True): one
    (local tokens, num_experts) tensor per MoE layer. documents: the batch's
    "cpattn_documents" from cpattn.shard_batch (its padding slots are left out). Gradients
    follow cpattn.cross_entropy's convention (averaging them over the group is exact)."""
    if not router_logits:
        raise ValueError("cpattn.load_balancing_loss: no router logits (pass "
                         "output_router_logits=True to the model)")
    groups = _loss_groups(cp, None)
    layers = tuple(router_logits)
    device = layers[0].device
    weight = None
    if documents is not None:
        index, _ = cp.document_positions(documents)
        weight = (index >= 0).to(device, torch.float32)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for logits in layers:
        if logits.dim() != 2 or logits.shape[-1] != num_experts or (
                weight is not None and logits.shape[0] != weight.numel()):
            raise ValueError(
                f"cpattn.load_balancing_loss: router logits must be (local tokens"
                f"{'' if weight is None else ' = ' + str(weight.numel())}, num_experts = "
                f"{num_experts}), got {tuple(logits.shape)}")
        routing = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(routing, top_k, dim=-1).indices
        w = torch.ones(routing.shape[0], device=device) if weight is None else weight
        counts = counts.scatter_add(0, chosen.reshape(-1), w.repeat_interleave(top_k))
        probs = probs + (routing * w[:, None]).sum(0)
        rows = rows + w.sum()
    rows, counts = _sum(rows, groups), _sum(counts, groups)
    probs = _SumOverGroups.apply(probs, groups)
    return (counts / rows * (probs / rows)).sum() * num_experts
