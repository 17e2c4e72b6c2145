"""Evaluation under context parallelism, exact over the dataset's examples: each round of
batches (one per data-parallel replica) gives one loss, the token mean of its real targets, on
every rank; the copies that complete the last round (data.WholeRounds) count no target and
their predictions are dropped; predictions are put back into each batch's full order and
gathered once per CP group."""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from cpattn.integrations.trainer.data import WholeRounds
from cpattn.integrations.trainer.ranks import host_or_device
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import KEYWORD
from cpattn.training import IGNORE_INDEX


class EvalRounds:
    """Which batches of an evaluation loop are WholeRounds' copies: the loop's k-th batch on
    data-parallel replica d is the sampler's batch k * dp + d."""

    def __init__(self, loader, dp_rank: int) -> None:
        shard = getattr(loader, "batch_sampler", None)
        rounds = getattr(shard, "batch_sampler", None)
        self.rounds = rounds if isinstance(rounds, WholeRounds) else None
        self.dp_rank = dp_rank
        self.seen = 0

    def next_is_copy(self) -> bool:
        """Whether the batch now evaluated is a copy (counts the batch)."""
        index, self.seen = self.seen, self.seen + 1
        if self.rounds is None:
            return False
        return index * self.rounds.dp + self.dp_rank >= self.rounds.real


def without_targets(inputs: dict[str, Any]) -> dict[str, Any]:
    """The batch with every label ignored: a copy that completes a round counts no target."""
    return {k: torch.full_like(v, IGNORE_INDEX) if k in ("labels", "shift_labels") else v
            for k, v in inputs.items()}


def world_sum(value: torch.Tensor) -> torch.Tensor:
    """value (a scalar) summed over every rank, in float64 (the same on every rank)."""
    out = value.detach().double().reshape(()).to(host_or_device()).clone()
    dist.all_reduce(out)
    return out.to(value.device)


def round_mean(local_sum: torch.Tensor, local_count: torch.Tensor) -> torch.Tensor:
    """The token mean over every rank's targets (every token of a CP group's batch is on
    exactly one of its ranks): the sums over the count, each summed over the world."""
    mean = world_sum(local_sum) / world_sum(torch.as_tensor(local_count)).clamp(min=1)
    return mean.to(local_sum.dtype)


def full_order(cp: ContextParallel, local_logits: torch.Tensor, shape: tuple[int, int],
               local: dict[str, Any], source: Optional[torch.Tensor]) -> torch.Tensor:
    """Every CP rank's per-token outputs (batch, local, ...) put back where their tokens sit in
    the full batch of `shape` (batch, seqlen): (batch, seqlen, ...). `source`: for a sharded
    packed batch, each packed token's place in the flattened full batch (padding slots of a
    padded batch are then 0)."""
    bsz, seqlen = shape
    docs = local.get(KEYWORD)
    index = (cp.document_positions(docs)[0] if docs is not None else cp.positions(seqlen))
    gathered, where = _gather_sequence(cp, local_logits, index.to(local_logits.device))
    rest = local_logits.shape[2:]
    if docs is None:  # rows of one sequence each: where is every position of the row
        out = torch.empty((bsz, seqlen, *rest), dtype=local_logits.dtype,
                          device=local_logits.device)
        out[:, where] = gathered
        return out
    out = torch.zeros((bsz * seqlen, *rest), dtype=local_logits.dtype, device=local_logits.device)
    out[source.to(local_logits.device)[where]] = gathered[0]
    return out.view(bsz, seqlen, *rest)


def _gather_sequence(cp: ContextParallel, x: torch.Tensor, index: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """x (batch, local, ...) of every rank of cp's group, with each rank's `index` (local,) of
    its tokens' places in the sequence (-1: padding slot): (values (batch, n, ...), places
    (n,)) of every real token, in rank order. Ranks may hold different numbers of tokens."""
    values, places = x, index
    for group in cp.groups:  # for hybrid: Ulysses, then ring (cp.rank's order)
        size = dist.get_world_size(group)
        counts = [torch.zeros(1, dtype=torch.int64, device=x.device) for _ in range(size)]
        dist.all_gather(counts, torch.tensor([places.numel()], device=x.device), group=group)
        longest = int(max(c.item() for c in counts))
        pad = longest - places.numel()
        padded_values = torch.nn.functional.pad(values, (0, 0) * (values.dim() - 2) + (0, pad))
        padded_places = torch.nn.functional.pad(places, (0, pad), value=-1)
        all_values = [torch.empty_like(padded_values) for _ in range(size)]
        all_places = [torch.empty_like(padded_places) for _ in range(size)]
        dist.all_gather(all_values, padded_values.contiguous(), group=group)
        dist.all_gather(all_places, padded_places.contiguous(), group=group)
        values, places = torch.cat(all_values, 1), torch.cat(all_places)
    real = places >= 0
    return values[:, real], places[real]


def gather_over_dp(accelerator, data, cp_size: int):
    """accelerate's gather_for_metrics over the data-parallel ranks: every rank of a CP group
    holds the same values, so one copy per group is kept; batches may differ in their first
    dimension (the last round's partial batch); at the end of the loader only the dataset's
    `remainder` last examples are kept (the copies that completed the round are after them)."""
    from accelerate.utils import recursively_apply

    state = accelerator.gradient_state
    world = dist.get_world_size()

    def one_copy(t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(1) if t.dim() == 0 else t
        sizes = accelerator.gather(torch.tensor([t.shape[0]], device=t.device)).tolist()
        longest = max(sizes)
        padded = torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, longest - t.shape[0]))
        every = accelerator.gather(padded.contiguous()).view(world, longest, *t.shape[1:])
        out = torch.cat([every[r, :sizes[r]] for r in range(0, world, cp_size)])
        if state.end_of_dataloader and state.remainder > 0:
            out = out[:state.remainder]
        return out

    return recursively_apply(one_copy, data)


@contextlib.contextmanager
def whole_gathers(accelerator):
    """accelerate's gather_for_metrics keeps, at the end of a loader, only as many entries as
    the dataset's last examples (`remainder`): right for per-example values, wrong for the
    per-rank sums TRL gathers with it (tokens, correct tokens, entropy), of which every rank
    holds a part of every example under context parallelism. Inside, the loader's remainder
    reads -1 (gather_for_metrics then keeps every entry)."""
    state = accelerator.gradient_state
    loader = state.active_dataloader if state.in_dataloader else None
    if loader is None or not state.end_of_dataloader:
        yield
        return
    saved, loader.remainder = loader.remainder, -1
    try:
        yield
    finally:
        loader.remainder = saved
