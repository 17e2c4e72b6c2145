"""Context parallelism inside transformers' `Trainer` and TRL's `SFTTrainer`, without patching.

    args = TrainingArguments("out", ...)            # under torchrun: starts torch.distributed
    cp = context_parallel(cp_size=2, strategy="ring")       # groups of 2 consecutive ranks
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=register(cp))
    trainer = ContextParallelTrainer(cp, model=model, args=args, train_dataset=ds,
                                     data_collator=DataCollatorWithFlattening())
    trainer.train()

`ContextParallelSFTTrainer` is the same for TRL's `SFTTrainer` (TRL imported when first named);
`with_context_parallel(cls)` makes the class for any other Trainer subclass.

What the mixin changes, and why (the Trainer's own code does the rest):
- data: accelerate deals batch k to process k % W; the mixin re-shards its samplers over the
  data-parallel ranks (dp = W / cp, dp rank = rank // cp), so every rank of a CP group gets the
  same full batch (train, eval and test loaders; shuffling, resume and gradient accumulation
  stay the Trainer's). Each step checks that each CP group's batches are equal (a digest
  gathered over the world; ValueError on every rank otherwise).
- sharding: the Trainer's context-parallel seam `_prepare_context_parallel_inputs` runs after
  the Trainer counted the targets of the full batches (`num_items_in_batch`) and returns
  `cpattn.shard_batch`'s local batch (labels shifted over the whole sequence, global positions,
  packed documents).
- counts: `get_cp_size` is cp's size, so the Trainer divides its count (gathered over every
  rank) by cp, and the global batch size is per-device x accumulation x dp. Token and FLOP
  counters count each CP group's batch once.
- loss (`ContextParallelTrainer`): this rank's token-loss sum / num_items_in_batch, scaled as the
  Trainer scales it (x W with average_tokens_across_devices): the Trainer's DDP / FSDP mean over
  all W = dp x cp ranks is then the exact token mean of the step; label smoothing and the MoE
  load-balancing loss over the whole sequence. TRL's own loss is already right on sharded
  inputs with `shift_labels`; its token counter is corrected.
- evaluation: the loss of each batch is the same on every rank of a CP group; predictions
  (logits) are gathered back into the batch's full order, and gathered over dp (one copy per
  CP group) by `gather_function`.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import KEYWORD, find_packing
from cpattn.training import cross_entropy, load_balancing_loss, shard_batch, token_loss_sum

try:
    from accelerate.data_loader import BatchSamplerShard
    from transformers import Trainer

    from cpattn.integrations.transformers import registered
except ImportError as e:  # pragma: no cover - only without transformers / accelerate
    raise ImportError(
        "cpattn.integrations.trainer needs transformers and accelerate (pip install "
        "transformers accelerate); cpattn itself does not"
    ) from e

# (and ContextParallelSFTTrainer, made when first named: see __getattr__)
__all__ = ["ContextParallelMixin", "ContextParallelTrainer", "context_parallel",
           "with_context_parallel"]

WHAT = "cpattn.integrations.trainer"


def context_parallel(cp_size: int, strategy: str = "ring", *, ulysses_size: Optional[int] = None,
                     **options) -> ContextParallel:
    """ContextParallel settings for a trainer: the W ranks form W / cp_size data-parallel
    replicas, each a context-parallel group of cp_size consecutive ranks (a (dp, cp) device
    mesh, cp innermost, so that a group stays inside a node). strategy "hybrid" needs
    ulysses_size (dividing cp_size): the group is a (ring, Ulysses) grid of cp_size /
    ulysses_size x ulysses_size ranks. options: ContextParallel's (layout, timeout, ...).
    Needs torch.distributed started (TrainingArguments starts it under torchrun); call it on
    every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    what = f"{WHAT}.context_parallel"
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{what}: torch.distributed is not started: create the "
                         "TrainingArguments first (under torchrun or accelerate launch they "
                         "start it), or call torch.distributed.init_process_group")
    world = dist.get_world_size()
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or (
            world % cp_size):
        raise ValueError(f"{what}: cp_size must be a positive int dividing the world size "
                         f"{world}, got {cp_size!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dp = world // cp_size
    if strategy == "hybrid":
        if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or (
                ulysses_size < 1 or cp_size % ulysses_size):
            raise ValueError(f"{what}: strategy 'hybrid' needs ulysses_size, a positive int "
                             f"dividing cp_size {cp_size}, got {ulysses_size!r}")
        mesh = init_device_mesh(device, (dp, cp_size // ulysses_size, ulysses_size),
                                mesh_dim_names=("dp", "ring", "ulysses"))
        return ContextParallel(mesh["ring", "ulysses"], strategy="hybrid", **options)
    if ulysses_size is not None:
        raise ValueError(f"{what}: ulysses_size is for strategy 'hybrid', got strategy "
                         f"{strategy!r}")
    mesh = init_device_mesh(device, (dp, cp_size), mesh_dim_names=("dp", "cp"))
    return ContextParallel(mesh["cp"], strategy=strategy, **options)


def _data_parallel(cp: ContextParallel) -> tuple[int, int]:
    """(dp rank, dp size) of this rank; cp's ranks must be a block of consecutive ranks
    (context_parallel's), else ValueError (the same on every rank)."""
    world, rank, size = dist.get_world_size(), dist.get_rank(), cp.world_size
    start = rank - cp.rank
    block = set(range(start, start + size))
    members = set().union(*(dist.get_process_group_ranks(g) for g in cp.groups))
    if world % size or start % size or not members <= block:
        raise ValueError(f"{WHAT}: the context-parallel group must be {size} consecutive ranks "
                         f"starting at a multiple of {size} (this rank {rank} is in "
                         f"{sorted(members)}): build cp with {WHAT}.context_parallel(cp_size="
                         f"{size}, ...)")
    return rank // size, world // size


class ContextParallelMixin:
    """Context parallelism for a transformers Trainer class: put it first in the bases
    (`with_context_parallel` does). The first argument is the cpattn.ContextParallel settings
    the model was loaded with (attn_implementation=register(cp)); the others are the Trainer's.
    See the module docstring for what it changes."""

    def __init__(self, cp: ContextParallel, *args, **kwargs) -> None:
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"{WHAT}: the first argument must be the cpattn.ContextParallel "
                            f"the model was loaded with, got {type(cp).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        _refuse_accelerate_parallelism(getattr(training_args, "parallelism_config", None))
        for i, name in ((3, "train_dataset"), (4, "eval_dataset")):
            _refuse_iterable(kwargs.get(name, args[i] if len(args) > i else None))
        self.cp = cp
        self._cp_dp_rank, self._cp_dp_size = _data_parallel(cp)
        self._cp_batch_tokens = None
        super().__init__(*args, **kwargs)
        self._cp_check_setup()
        # The Trainer counts the full batches' targets for the loss (num_items_in_batch), and
        # counts them shifted: cpattn's loss shifts labels over the whole sequence.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True

    # ---- refusals ------------------------------------------------------------------------------

    def _cp_is_sft(self) -> bool:
        trl = sys.modules.get("trl")
        return trl is not None and isinstance(self, trl.SFTTrainer)

    def _cp_own_loss(self) -> bool:
        """Whether the loss is this mixin's: the class below it computes the Trainer's default
        loss (TRL's SFTTrainer, and a subclass with its own compute_loss, keep theirs)."""
        mro = type(self).__mro__
        for cls in mro[mro.index(ContextParallelMixin) + 1:]:
            if "compute_loss" in vars(cls):
                return cls is Trainer
        return False

    def _cp_check_setup(self) -> None:
        """Refuses, on every rank (the same settings everywhere), what cannot be made exact."""
        args = self.args
        _refuse_accelerate_parallelism(getattr(self.accelerator, "parallelism_config", None))
        config = getattr(self.accelerator.unwrap_model(self.model), "config", None)
        name = getattr(config, "_attn_implementation", None)
        if registered(name) is not self.cp:
            raise ValueError(
                f"{WHAT}: the model's attention implementation is {name!r}, not cpattn's for "
                "the settings given to the trainer: load the model with attn_implementation="
                "cpattn.integrations.transformers.register(cp), with the same cp")
        refusals = [
            (args.n_gpu > 1, "several GPUs in one process (torch.nn.DataParallel): launch one "
                             "process per GPU (torchrun or accelerate launch)"),
            (args.train_sampling_strategy == "batch_rebalance",
             "train_sampling_strategy='batch_rebalance' (its sampler shards over every rank, "
             "not over the data-parallel ranks): use 'random', 'sequential' or "
             "'group_by_length'"),
            (self.compute_loss_func is not None,
             "compute_loss_func (it would get the local logits with the full batch's labels): "
             "subclass the trainer and compute the loss from inputs['shift_labels'] with "
             "cpattn.training.token_loss_sum"),
            (getattr(self, "neftune_noise_alpha", None) is not None,
             "neftune_noise_alpha (its noise is scaled by each rank's local length)"),
            (args.eval_use_gather_object,
             "eval_use_gather_object=True: predictions are gathered as tensors over the "
             "data-parallel ranks"),
            (args.accelerator_config.dispatch_batches is True,
             "accelerator_config.dispatch_batches=True (the main process would deal different "
             "slices to the ranks of a context-parallel group): leave it unset"),
            (getattr(self.model, "_tp_size", None) not in (None, 1),
             "tensor parallelism (tp_plan)"),
        ]
        for dataset in (self.train_dataset, self.eval_dataset):
            _refuse_iterable(dataset)
        if self._cp_is_sft():
            refusals += [
                (args.label_smoothing_factor > 0,
                 "label_smoothing_factor with ContextParallelSFTTrainer (TRL smooths the "
                 "unshifted labels of the local shard): use ContextParallelTrainer, which "
                 "smooths the globally shifted labels"),
                (getattr(self, "aux_loss_enabled", False),
                 "the MoE load-balancing loss with ContextParallelSFTTrainer (TRL computes it "
                 "over each rank's tokens only): set router_aux_loss_coef=0.0 in SFTConfig, or "
                 "use ContextParallelTrainer (cpattn.load_balancing_loss over the whole "
                 "sequence)"),
            ]
        for refused, why in refusals:
            if refused:
                raise ValueError(f"{WHAT}: context parallelism cannot honour {why}")

    # ---- data ----------------------------------------------------------------------------------

    def get_cp_size(self) -> int:
        """The Trainer divides its target count by this (every rank of a CP group counted the
        same batch) and the data-parallel size is world / this."""
        return self.cp.world_size

    def _get_dataloader(self, dataset, description: str, batch_size: int, *args, **kwargs):
        """The Trainer's loader, its batch sampler re-sharded over the data-parallel ranks: every
        rank of a context-parallel group gets the same batches."""
        loader = super()._get_dataloader(dataset, description, batch_size, *args, **kwargs)
        shards = [s for s in (getattr(loader, "batch_sampler", None),
                              getattr(loader, "sampler", None))
                  if isinstance(s, BatchSamplerShard)]
        if not shards and dist.get_world_size() > 1:
            raise ValueError(
                f"{WHAT}: the {description} data loader is not sharded by accelerate's "
                f"BatchSamplerShard (got {type(getattr(loader, 'batch_sampler', None)).__name__}"
                "), so it cannot be re-sharded over the data-parallel ranks: use a map-style "
                "dataset with the Trainer's own samplers")
        for shard in shards:
            shard.num_processes, shard.process_index = self._cp_dp_size, self._cp_dp_rank
        return loader

    def _cp_check_batch(self, inputs: dict[str, Any]) -> None:
        """Raises ValueError on every rank unless every rank of each CP group holds the same
        full batch: a digest of the batch's tensors, all-gathered over the world with the dp
        rank (one all-gather of 5 int64 per micro-batch), so that a mismatch in one group
        stops every rank, never leaving the others waiting in the gradient all-reduce."""
        digest = hashlib.blake2b(digest_size=32)
        for key in sorted(inputs):
            value = inputs[key]
            digest.update(key.encode())
            if isinstance(value, torch.Tensor):
                value = value.detach().contiguous().cpu()
                digest.update(repr((tuple(value.shape), value.dtype)).encode())
                digest.update(value.view(-1).view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
        mine = torch.tensor([self._cp_dp_rank, *struct.unpack("<4q", digest.digest())],
                            dtype=torch.int64, device=_host_or_device())
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        first: dict[int, torch.Tensor] = {}
        differ = set()
        for row in (t.cpu() for t in every):
            group = int(row[0])
            if not torch.equal(first.setdefault(group, row), row):
                differ.add(group)
        if differ:
            raise ValueError(
                f"{WHAT}: the ranks of a context-parallel group were given different batches "
                f"(data-parallel replica(s) {sorted(differ)}; each rank of a group must get the "
                "same full batch, which cpattn.shard_batch splits): the data loader is not "
                f"sharded over the {self._cp_dp_size} data-parallel ranks. The trainer's own "
                "loaders are (get_train_dataloader / get_eval_dataloader); a custom loader "
                f"must shard over dp = world / {self.cp.world_size} with dp rank = rank // "
                f"{self.cp.world_size}, not over every rank")

    def _prepare_context_parallel_inputs(self, model, inputs: dict[str, Any]):
        """The Trainer's context-parallel seam, called with the full batch after the Trainer
        counted its targets: (a no-op context, this rank's batch from cpattn.shard_batch)."""
        self._cp_check_batch(inputs)
        self._cp_batch_tokens = _trl_token_count(inputs)
        return contextlib.nullcontext, shard_batch(inputs, self.cp)

    def _track_num_input_tokens(self, inputs) -> None:
        """The Trainer's token counter sums every rank's full batch: each CP group's once."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (
            self.state.num_input_tokens_seen - before) // self.cp.world_size

    def floating_point_ops(self, inputs) -> float:
        """Summed over every rank by the Trainer: each CP group's batch once."""
        return super().floating_point_ops(inputs) / self.cp.world_size

    # ---- loss ----------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs: bool = False,
                     num_items_in_batch=None):
        if not self._cp_own_loss():
            if not (self._cp_is_sft() and model.training):
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            before = self._total_train_tokens  # TRL counts the local tokens: the full batch's
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
            count = torch.as_tensor(self._cp_batch_tokens, device=self.args.device)
            self._total_train_tokens = before + int(
                self.accelerator.gather(count.reshape(1)).sum().item()) // self.cp.world_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return loss
        shift_labels = inputs.get("shift_labels")
        if shift_labels is None:
            raise ValueError(f"{WHAT}: the batch has no 'labels': ContextParallelTrainer "
                             "computes a causal language model's loss from them")
        config = self.accelerator.unwrap_model(model).config
        coef = getattr(config, "router_aux_loss_coef", 0.0)
        aux = bool(getattr(config, "output_router_logits", False)) and bool(coef)
        outputs = model(**_model_inputs(inputs), **({"output_router_logits": True} if aux
                                                    else {}))
        smoothing = self.label_smoother.epsilon if self.label_smoother is not None else 0.0
        if num_items_in_batch is None:
            loss = cross_entropy(outputs.logits, shift_labels, self.cp, label_smoothing=smoothing)
            aux_scale = 1
        else:
            # The Trainer's rule: the token-loss sum over its count of the step's targets (every
            # rank's, every accumulation step's), times the ranks its gradient mean runs over.
            scale = 1
            if self.args.average_tokens_across_devices:
                scale = self.accelerator.num_processes // self.get_tp_size()
            loss = token_loss_sum(outputs.logits, shift_labels, label_smoothing=smoothing)
            loss = loss / torch.as_tensor(num_items_in_batch).to(loss.device) * scale
            aux_scale = max(scale // self.cp.world_size, 1)  # (dp: the replicas' own scale)
        if aux:
            # transformers adds coef x the load-balancing loss of the whole micro-batch, scaled
            # as the token loss is: over the whole sequence (every rank of cp's group) here.
            experts = getattr(config, "num_experts", None) or config.num_local_experts
            loss = loss + coef * aux_scale * load_balancing_loss(
                outputs.router_logits, self.cp, experts, config.num_experts_per_tok,
                documents=inputs.get(KEYWORD))
        return (loss, outputs) if return_outputs else loss

    # ---- evaluation ----------------------------------------------------------------------------

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The Trainer's prediction step on the sharded batch: the loss (over the full batch's
        count of targets) the same on every rank of the CP group, logits gathered back into
        the batch's full order (batch, seqlen, vocab), the full batch's labels."""
        inputs = self._prepare_inputs(inputs)
        has_labels = bool(self.label_names) and all(
            inputs.get(k) is not None for k in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(inputs[k].detach() for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        count = self._get_num_items_in_batch([inputs], self.args.device) if has_labels else None
        _, local = self._prepare_context_parallel_inputs(model, inputs)
        loss = logits = None
        with torch.no_grad(), self.compute_loss_context_manager():
            if has_labels:
                if self._cp_own_loss() and not prediction_loss_only:
                    loss, outputs = self.compute_loss(model, local, return_outputs=True,
                                                      num_items_in_batch=count)
                    logits = outputs.logits
                else:
                    loss = self.compute_loss(model, dict(local), num_items_in_batch=count)
                loss = loss.detach().mean()
                for group in self.cp.groups:
                    dist.all_reduce(loss, group=group)
                loss = loss / self.cp.world_size
            if not prediction_loss_only and logits is None:
                logits = model(**_model_inputs(local)).logits
        if prediction_loss_only:
            return loss, None, None
        return loss, self._cp_full_order(logits.detach(), inputs, local), labels

    def _cp_full_order(self, local_logits: torch.Tensor, full: dict[str, Any],
                       local: dict[str, Any]) -> torch.Tensor:
        """Every CP rank's per-token outputs (batch, local, ...) put back where their tokens sit
        in the full batch: (batch, seqlen, ...); padding slots of a padded batch are 0."""
        key = "input_ids" if "input_ids" in full else "inputs_embeds"
        bsz, seqlen = full[key].shape[:2]
        docs = local.get(KEYWORD)
        if docs is not None:
            index, _ = self.cp.document_positions(docs)
        else:
            index = self.cp.positions(seqlen)
        gathered, where = _gather_sequence(self.cp, local_logits, index.to(local_logits.device))
        if docs is None:  # rows of one sequence each: where is every position of the row
            out = torch.empty((bsz, seqlen, *local_logits.shape[2:]), dtype=local_logits.dtype,
                              device=local_logits.device)
            out[:, where] = gathered
            return out
        source = find_packing(full, key, WHAT).source.to(local_logits.device)
        out = torch.zeros((bsz * seqlen, *local_logits.shape[2:]), dtype=local_logits.dtype,
                          device=local_logits.device)
        out[source[where]] = gathered[0]
        return out.view(bsz, seqlen, *local_logits.shape[2:])

    def evaluation_loop(self, *args, **kwargs):
        # The Trainer resets gather_function to accelerate's at the end of every loop.
        self.gather_function = self._cp_gather_over_dp
        return super().evaluation_loop(*args, **kwargs)

    def _cp_gather_over_dp(self, data):
        """accelerate's gather_for_metrics over the data-parallel ranks: every rank of a CP group
        holds the same values, so only one copy per group is kept."""
        from accelerate.utils import recursively_apply

        gathered = self.accelerator.gather(data)
        state = self.accelerator.gradient_state
        world, size = dist.get_world_size(), self.cp.world_size

        def one_copy(t: torch.Tensor) -> torch.Tensor:
            t = t.view(world // size, size, t.shape[0] // world, *t.shape[1:])[:, 0]
            t = t.reshape(-1, *t.shape[2:])
            if state.end_of_dataloader and state.remainder > 0:
                t = t[:state.remainder]  # (the duplicates that made the last batches even)
            return t

        return recursively_apply(one_copy, gathered)


def _refuse_accelerate_parallelism(config) -> None:
    """accelerate's own context / sequence / tensor parallelism next to cpattn's: refused."""
    if config is None:
        return
    sizes = {"cp_size": getattr(config, "cp_size", 1), "sp_size": getattr(config, "sp_size", 1),
             "tp_size": getattr(config, "tp_size", 1)}
    used = [f"{k}={v}" for k, v in sizes.items() if (v or 1) > 1]
    if used:
        raise ValueError(
            f"{WHAT}: accelerate's ParallelismConfig has {', '.join(used)}: cpattn runs the "
            "context parallelism itself (its size is the cp given to the trainer). Remove "
            "parallelism_config from TrainingArguments (and parallelism_config_cp_size from the "
            "accelerate config, PARALLELISM_CONFIG_CP_SIZE from the environment)")


def _host_or_device() -> torch.device:
    """Where the world group's collectives take tensors: the CPU with gloo (also in a
    "cpu:gloo,cuda:nccl" group), else this rank's GPU."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _refuse_iterable(dataset) -> None:
    datasets = dataset.values() if isinstance(dataset, dict) else [dataset]
    if any(isinstance(d, torch.utils.data.IterableDataset) for d in datasets):
        raise ValueError(f"{WHAT}: context parallelism cannot honour an IterableDataset "
                         "(accelerate shards it over every rank, not over the data-parallel "
                         "ranks): use a map-style dataset (a datasets.Dataset, or a list)")


def _model_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """What goes to the model: the sharded batch without its targets, no K/V cache."""
    return {**{k: v for k, v in inputs.items() if k not in ("labels", "shift_labels")},
            "use_cache": False}


def _trl_token_count(inputs: dict[str, Any]):
    """The tokens TRL's SFTTrainer counts in a full batch (its `num_tokens`)."""
    if "attention_mask" in inputs:
        return inputs["attention_mask"].sum()
    if "position_ids" in inputs:
        return inputs["position_ids"].size(1)
    key = "input_ids" if "input_ids" in inputs else "inputs_embeds"
    return inputs[key].shape[:2].numel()


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


def with_context_parallel(trainer_class: type) -> type:
    """The class `trainer_class` with context parallelism (ContextParallelMixin first in its
    bases): its constructor takes the cpattn.ContextParallel first. A subclass with its own
    compute_loss keeps it and gets the sharded batch (its targets as 'shift_labels', already
    shifted; pass the rest to the model, and divide by num_items_in_batch as the Trainer does)."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"{WHAT}.with_context_parallel: needs a transformers.Trainer subclass, "
                        f"got {trainer_class!r}")
    if issubclass(trainer_class, ContextParallelMixin):
        return trainer_class
    return type(f"ContextParallel{trainer_class.__name__}", (ContextParallelMixin, trainer_class),
                {"__module__": __name__, "__doc__": trainer_class.__doc__})


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    """transformers.Trainer with context parallelism: ContextParallelTrainer(cp, model=...,
    args=..., ...). The loss is the causal language model's (from the batch's 'labels')."""


def __getattr__(name: str):
    """ContextParallelSFTTrainer, made when first named (TRL is imported then)."""
    if name == "ContextParallelSFTTrainer":
        try:
            import trl
        except ImportError as e:
            raise ImportError(f"{WHAT}.ContextParallelSFTTrainer needs TRL (pip install "
                              "trl)") from e
        cls = with_context_parallel(trl.SFTTrainer)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
