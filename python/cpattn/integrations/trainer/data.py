"""The batches of a context-parallel trainer: every rank of a CP group gets the same full batch,
the batches one process would see (no filled last batch at one data-parallel replica; exact
evaluation rounds at several), checked to agree over the ranks; and batches whose length the
layout cannot split evenly are sharded as documents (padded inside the shards, never by the
user)."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch
import torch.distributed as dist
from accelerate.data_loader import BatchSamplerShard

from cpattn.integrations.trainer.ranks import WHAT, host_or_device
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import FLASH_KEYS, find_packing
from cpattn.training import IGNORE_INDEX

SAMPLED_EXAMPLES = 16  # examples of a dataset compared over the ranks (with its length)


class WholeRounds:
    """A batch sampler's batches, then copies of its first batch up to a multiple of `dp`: an
    evaluation round (one batch per data-parallel replica) is then never short of a batch, so
    no replica fills a batch with repeated examples (accelerate's even_batches) and the
    replicas run the same number of steps. `real` batches come first; the copies (`dp` - 1 at
    most, on the replicas after the last real batch) are marked by EvalRounds."""

    def __init__(self, batch_sampler, dp: int) -> None:
        self.batch_sampler = batch_sampler
        self.dp = dp
        self.batch_size = getattr(batch_sampler, "batch_size", None)
        self.drop_last = getattr(batch_sampler, "drop_last", False)
        self.sampler = getattr(batch_sampler, "sampler", None)  # (accelerate's set_epoch)

    @property
    def real(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return -(-self.real // self.dp) * self.dp

    def __iter__(self):
        first = None
        for batch in self.batch_sampler:
            first = batch if first is None else first
            yield batch
        for _ in range(len(self) - self.real):
            yield list(first)


def reshard(loader, dp_rank: int, dp_size: int, description: str, training: bool):
    """The Trainer's loader with its accelerate BatchSamplerShard dealing over the data-parallel
    replicas (dp rank = rank // cp) instead of every rank, so that the ranks of a CP group get
    the same batches. At one replica it never fills the last batch (the partial batch of one
    process); at several, training keeps accelerate's filling (what data parallelism does) and
    evaluation gets whole rounds (WholeRounds) instead. Idempotent (a cached eval loader)."""
    shards = [s for s in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None))
              if isinstance(s, BatchSamplerShard)]
    if not shards and dist.get_world_size() > 1:
        raise ValueError(
            f"{WHAT}: the {description} data loader is not sharded by accelerate's "
            f"BatchSamplerShard (got {type(getattr(loader, 'batch_sampler', None)).__name__}), "
            "so it cannot be re-sharded over the data-parallel ranks: use a map-style dataset "
            "with the Trainer's own samplers")
    for shard in shards:
        shard.num_processes, shard.process_index = dp_size, dp_rank
        if dp_size == 1:
            shard.even_batches = False
        elif not training and not shard.drop_last:
            shard.even_batches = False
            if not isinstance(shard.batch_sampler, WholeRounds):
                shard.batch_sampler = WholeRounds(shard.batch_sampler, dp_size)
    return loader


def digest(value: Any, into=None) -> "hashlib.blake2b":
    """A digest of nested dicts / lists / tensors / arrays / scalars (tensors by their bytes)."""
    into = into if into is not None else hashlib.blake2b(digest_size=32)
    if isinstance(value, torch.Tensor) or hasattr(value, "__array__") and not isinstance(
            value, (str, bytes)):
        tensor = torch.as_tensor(value).detach().contiguous().cpu()
        into.update(repr((tuple(tensor.shape), tensor.dtype)).encode())
        into.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict) or hasattr(value, "keys") and hasattr(value, "__getitem__"):
        for key in sorted(value.keys(), key=str):
            into.update(repr(key).encode())
            digest(value[key], into)
    elif isinstance(value, (list, tuple)):
        into.update(f"[{len(value)}".encode())
        for item in value:
            digest(item, into)
    else:
        into.update(repr(value).encode())
    return into


def differing_groups(key: int, mine: "hashlib.blake2b") -> list[int]:
    """All-gathers (key, digest) over the world (5 int64 per rank; on every rank alike): the
    keys whose ranks disagree on the digest."""
    row = torch.tensor([key, *struct.unpack("<4q", mine.digest())], dtype=torch.int64,
                       device=host_or_device())
    every = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(every, row)
    first: dict[int, torch.Tensor] = {}
    differ = set()
    for other in (t.cpu() for t in every):
        if not torch.equal(first.setdefault(int(other[0]), other), other):
            differ.add(int(other[0]))
    return sorted(differ)


def check_same_dataset(dataset, description: str) -> None:
    """ValueError on every rank unless every rank holds the same dataset (its length and
    SAMPLED_EXAMPLES examples spread over it): the trainer deals one dataset's batches."""
    if dataset is None or dist.get_world_size() == 1:
        return
    mine = hashlib.blake2b(digest_size=32)
    try:
        length = len(dataset)
    except TypeError:  # (no length: an iterable dataset, refused elsewhere)
        return
    mine.update(str(length).encode())
    for i in sorted({length * k // SAMPLED_EXAMPLES for k in range(SAMPLED_EXAMPLES)}):
        if i < length:
            digest(dataset[i], mine)
    if differing_groups(0, mine):
        raise ValueError(
            f"{WHAT}: the {description} dataset differs between ranks (its length or its "
            "examples): build the same dataset on every rank (the same files, the same seed, no "
            "rank-dependent step); the trainer deals the batches of that one dataset to the "
            "ranks itself")


def check_same_batch(inputs: dict[str, Any], dp_rank: int, dp_size: int, cp_size: int) -> None:
    """ValueError on every rank unless every rank of each CP group holds the same full batch,
    so that a mismatch in one group stops every rank (none waits in the gradient all-reduce)."""
    differ = differing_groups(dp_rank, digest(inputs))
    if differ:
        raise ValueError(
            f"{WHAT}: the ranks of a context-parallel group were given different batches "
            f"(data-parallel replica(s) {differ}; each rank of a group must get the same full "
            "batch, which cpattn.shard_batch splits). The datasets agree (checked when the loader "
            "was made), so either the data loader is not sharded over the "
            f"{dp_size} data-parallel ranks (the trainer's own loaders are; a custom loader must "
            f"shard over dp = world / {cp_size} with dp rank = rank // {cp_size}, not over every "
            "rank), or the collator or a dataset transform draws random numbers differently on "
            "the ranks (seed it the same on every rank)")


def documents_if_uneven(batch: dict[str, Any], cp: ContextParallel) -> dict[str, Any]:
    """A batch of rows without document boundaries whose length cp's layout cannot split evenly
    (a flattened batch of one document, rows of odd length): the same batch as one row of
    documents, one per row (`cu_seq_lens_q`, position ids 0, 1, ... in each), which
    shard_batch pads inside the shards. The targets are the rows' own: a row's first label is
    never a target, and in one row it would be the previous row's last one, so it becomes
    -100. Any other batch is returned as it is."""
    key = "input_ids" if "input_ids" in batch else "inputs_embeds"
    ids = batch.get(key)
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return batch  # (shard_batch names what is missing)
    bsz, seqlen = ids.shape[:2]
    if seqlen % cp.granularity == 0 or find_packing(batch, key, WHAT) is not None:
        return batch
    out: dict[str, Any] = {}
    for name, value in batch.items():
        if name in ("attention_mask", "position_ids", "seq_idx", *FLASH_KEYS):
            continue  # (all ones / 0, 1, ... / one per row: rebuilt below)
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (
                bsz, seqlen):
            value = value.reshape(1, bsz * seqlen, *value.shape[2:])
        out[name] = value
    if "labels" in out:
        out["labels"] = out["labels"].clone()
        out["labels"][0, ::seqlen] = IGNORE_INDEX
    device = ids.device
    out["position_ids"] = torch.arange(seqlen, device=device).repeat(bsz)[None]
    cu = torch.arange(0, bsz * seqlen + 1, seqlen, dtype=torch.int32, device=device)
    out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
    out["max_length_q"] = out["max_length_k"] = seqlen
    if "seq_idx" in batch:
        out["seq_idx"] = torch.arange(bsz, dtype=torch.int32, device=device).repeat_interleave(
            seqlen)[None]
    return out


def refuse_iterable(dataset) -> None:
    datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
    if any(isinstance(d, torch.utils.data.IterableDataset) for d in datasets):
        raise ValueError(f"{WHAT}: context parallelism cannot honour an IterableDataset "
                         "(accelerate shards it over every rank, not over the data-parallel "
                         "ranks): use a map-style dataset (a datasets.Dataset, or a list)")
