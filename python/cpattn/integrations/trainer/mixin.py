"""ContextParallelMixin: what a transformers Trainer class needs to train with cpattn's context
parallelism (see the package's docstring for what it changes and why)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer

from cpattn.integrations.trainer import data, evaluation, ranks
from cpattn.integrations.trainer.ranks import WHAT
from cpattn.integrations.transformers import ParallelHandle, handle_of, parallelize, registered
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import KEYWORD, find_packing
from cpattn.training import (
    IGNORE_INDEX,
    cross_entropy,
    load_balancing_loss,
    shard_batch,
    token_loss_sum,
)

MIXIN_DOC = """Context parallelism (cpattn): each sequence of a batch is split over the
cp.world_size ranks of a context-parallel group, with exact attention, loss and gradients.

    trainer = {name}(cp, model=model, args=args, train_dataset=ds, ...)

cp: the cpattn.ContextParallel of this rank's group, from
    cpattn.integrations.trainer.context_parallel(cp_size, strategy): groups of cp_size
    consecutive ranks; the W / cp_size groups are data-parallel replicas. The trainer makes
    the model context-parallel with it (cpattn.integrations.transformers.parallelize(model,
    cp): its attention and the token mixers of hybrid models, checked on every rank; also a
    model made by model_init, or loaded by TRL from a name), so cp is given once. A model
    parallelized with this cp already is taken as it is; one loaded with
    attn_implementation=register(cp) (the older way, this cp) is parallelized too. The
    handle (its remove() restores the model) is trainer.cp_handle.
The other arguments are {base}'s. Under torchrun (or accelerate launch), on GPUs or CPUs.

Batches: the ranks of a group get the same full batch, split by cpattn.shard_batch (labels
shifted over the whole sequence, global positions, packed documents kept apart; any length:
documents are padded inside the shards). With one data-parallel replica the batches are one
process's (the last one partial, never filled); with several, training fills the last batches
as accelerate does, and evaluation counts each example once.

Refused with ValueError on every rank, naming the fix: a model parallelized or registered with
another cp (or that parallelize refuses); accelerate's ParallelismConfig (cp_size, sp_size,
tp_size); train_sampling_strategy="batch_rebalance"; an IterableDataset; accelerator_config
dispatch_batches=True, split_batches with several replicas, even_batches=False with several
replicas; compute_loss_func; neftune_noise_alpha; eval_use_gather_object; several GPUs in one
process; tensor parallelism; with TRL's SFTTrainer, label_smoothing_factor and the MoE auxiliary
loss; datasets or batches that differ between the ranks."""


class ContextParallelMixin:
    __doc__ = MIXIN_DOC.format(name="ContextParallel<Trainer>", base="Trainer class")

    def __init__(self, cp: ContextParallel, *args, **kwargs) -> None:
        """cp: the cpattn.ContextParallel of this rank's group (context_parallel(...)), which
        the trainer attaches to the model; the other arguments are the Trainer class's."""
        if not isinstance(cp, ContextParallel):
            raise TypeError(f"{WHAT}: the first argument must be the cpattn.ContextParallel "
                            f"of this rank's group (context_parallel(...)), got "
                            f"{type(cp).__name__}")
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        self._cp_use_every_rank(training_args)
        ranks.check_world(training_args)
        ranks.refuse_accelerate_parallelism(getattr(training_args, "parallelism_config", None))
        for i, name in ((3, "train_dataset"), (4, "eval_dataset")):
            data.refuse_iterable(kwargs.get(name, args[i] if len(args) > i else None))
        self.cp = cp
        self.cp_handle: ParallelHandle | None = None
        self._cp_dp_rank, self._cp_dp_size = ranks.data_parallel(cp)
        self._cp_batch_tokens = None
        self._cp_rounds = None
        super().__init__(*args, **kwargs)
        self._cp_check_setup()
        # (after the Trainer's set-up: the model is on its device, TRL has loaded a model given
        # by name; model_init's models are attached in call_model_init. After the refusals:
        # a refused trainer leaves the model as it was)
        self.cp_handle = self._cp_attach(self.model)
        # The Trainer counts the full batches' targets for the loss (num_items_in_batch), and
        # counts them shifted: cpattn's loss shifts labels over the whole sequence.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = True

    def _cp_use_every_rank(self, args) -> None:
        """TrainingArguments made under torchrun on a CPU machine: run with every rank."""
        ranks.use_cpu_ranks(args)

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

    def _cp_attach(self, model) -> ParallelHandle:
        """Makes `model` context-parallel with self.cp (parallelize), unless it is already (its
        handle is returned); a model parallelized or registered with another ContextParallel
        raises ValueError on every rank (the same settings everywhere)."""
        model = self.accelerator.unwrap_model(model) if hasattr(self, "accelerator") else model
        handle = handle_of(model)
        theirs = handle.cp if handle is not None else registered(
            getattr(getattr(model, "config", None), "_attn_implementation", None))
        if theirs is not None and theirs is not self.cp:
            mine, other = _describe(self.cp), _describe(theirs)
            settings = (f"the same settings ({mine}), but another object" if mine == other else
                        f"{other}, the trainer's: {mine}")
            how = ("was parallelized with another ContextParallel" if handle is not None else
                   f"has the attention implementation {model.config._attn_implementation!r}, "
                   "registered with another ContextParallel")
            raise ValueError(
                f"{WHAT}: the model {how} than the one given to the trainer ({settings}): build "
                "cp once (context_parallel(...)) and give it to the trainer only, which makes "
                "the model context-parallel itself (or give that object to parallelize(model, "
                "cp) / register(cp) too; handle_of(model).remove() undoes an earlier "
                "parallelize)")
        return handle if handle is not None else parallelize(model, self.cp)

    def call_model_init(self, trial=None):
        """The Trainer's model_init (at construction, and for each trial of a hyperparameter
        search), its model made context-parallel with cp."""
        model = super().call_model_init(trial)
        self.cp_handle = self._cp_attach(model)
        return model

    def _cp_check_setup(self) -> None:
        """Refuses, on every rank (the same settings everywhere), what cannot be made exact."""
        args = self.args
        ranks.refuse_accelerate_parallelism(getattr(self.accelerator, "parallelism_config", None))
        several = self._cp_dp_size > 1
        loader_config = args.accelerator_config
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
            (loader_config.dispatch_batches is True,
             "accelerator_config.dispatch_batches=True (the main process would deal different "
             "slices to the ranks of a context-parallel group): leave it unset"),
            (several and loader_config.split_batches,
             "accelerator_config.split_batches=True with several data-parallel replicas (the "
             "last batch would be split unevenly): leave it unset"),
            (several and not loader_config.even_batches,
             "accelerator_config.even_batches=False with several data-parallel replicas (they "
             "would run different numbers of steps): leave it unset"),
            (getattr(self.model, "_tp_size", None) not in (None, 1),
             "tensor parallelism (tp_plan)"),
        ]
        for dataset in (self.train_dataset, self.eval_dataset):
            data.refuse_iterable(dataset)
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

    def get_train_dataloader(self):
        """The Trainer's loader re-sharded over the data-parallel ranks (data.reshard)."""
        return self._cp_loader(super().get_train_dataloader(), "train", training=True)

    def get_eval_dataloader(self, eval_dataset=None):
        return self._cp_loader(super().get_eval_dataloader(eval_dataset), "evaluation")

    def get_test_dataloader(self, test_dataset):
        return self._cp_loader(super().get_test_dataloader(test_dataset), "test")

    def _cp_loader(self, loader, description: str, training: bool = False):
        data.check_same_dataset(getattr(loader, "dataset", None), description)
        return data.reshard(loader, self._cp_dp_rank, self._cp_dp_size, description, training)

    def _prepare_context_parallel_inputs(self, model, inputs: dict[str, Any]):
        """The Trainer's context-parallel seam (a private method: no public hook runs after the
        Trainer counted the full batch's targets and before the model), called with the full
        batch: (a no-op context, this rank's batch from cpattn.shard_batch)."""
        data.check_same_batch(inputs, self._cp_dp_rank, self._cp_dp_size, self.cp.world_size)
        self._cp_batch_tokens = _trl_token_count(inputs)
        return contextlib.nullcontext, shard_batch(data.documents_if_uneven(inputs, self.cp),
                                                   self.cp)

    def _track_num_input_tokens(self, inputs) -> None:
        """The Trainer's token counter (private) sums every rank's full batch: each CP group's
        batch once."""
        before = self.state.num_input_tokens_seen
        super()._track_num_input_tokens(inputs)
        self.state.num_input_tokens_seen = before + (
            self.state.num_input_tokens_seen - before) // self.cp.world_size

    def floating_point_ops(self, inputs) -> float:
        """Summed over every rank by the Trainer: each CP group's batch once."""
        return super().floating_point_ops(inputs) / self.cp.world_size

    # ---- loss ----------------------------------------------------------------------------------

    def _cp_loss_scale(self) -> int:
        """The Trainer's (and TRL's) factor on a loss over num_items_in_batch: the ranks its
        gradient mean runs over, with average_tokens_across_devices."""
        if not self.args.average_tokens_across_devices:
            return 1
        return self.accelerator.num_processes // self.get_tp_size()

    def _cp_forward(self, model, inputs):
        """(outputs, this rank's token-loss sum, the MoE term coef x load-balancing loss over
        the whole sequence or None) of the sharded batch."""
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
        loss_sum = token_loss_sum(outputs.logits, shift_labels, label_smoothing=smoothing)
        if not aux:
            return outputs, loss_sum, None
        experts = getattr(config, "num_experts", None) or config.num_local_experts
        balance = load_balancing_loss(outputs.router_logits, self.cp, experts,
                                      config.num_experts_per_tok, documents=inputs.get(KEYWORD))
        return outputs, loss_sum, coef * balance

    def compute_loss(self, model, inputs, return_outputs: bool = False,
                     num_items_in_batch=None):
        if not self._cp_own_loss():
            if not (self._cp_is_sft() and model.training):
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            before = self._total_train_tokens  # TRL counts the local tokens: the full batch's
            with evaluation.whole_gathers(self.accelerator):
                loss = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            count = torch.as_tensor(self._cp_batch_tokens, device=self.args.device)
            self._total_train_tokens = before + int(
                self.accelerator.gather(count.reshape(1)).sum().item()) // self.cp.world_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
            return loss
        outputs, loss_sum, aux = self._cp_forward(model, inputs)
        if num_items_in_batch is None:
            smoothing = self.label_smoother.epsilon if self.label_smoother is not None else 0.0
            loss = cross_entropy(outputs.logits, inputs["shift_labels"], self.cp,
                                 label_smoothing=smoothing)
            aux_scale = 1
        else:
            # The Trainer's rule: the token-loss sum over its count of the step's targets (every
            # rank's, every accumulation step's), times the ranks its gradient mean runs over.
            scale = self._cp_loss_scale()
            loss = loss_sum / torch.as_tensor(num_items_in_batch).to(loss_sum.device) * scale
            aux_scale = max(scale // self.cp.world_size, 1)  # (dp: the replicas' own scale)
        if aux is not None:
            # transformers adds coef x the load-balancing loss of the whole micro-batch, scaled
            # as the token loss is: over the whole sequence (every rank of cp's group) here.
            loss = loss + aux_scale * aux
        return (loss, outputs) if return_outputs else loss

    # ---- evaluation ----------------------------------------------------------------------------

    def evaluation_loop(self, dataloader, *args, **kwargs):
        """The Trainer's loop, with predictions gathered once per CP group; knows which batches
        complete the last round (EvalRounds). The Trainer resets gather_function to
        accelerate's at the end of every loop."""
        self.gather_function = self._cp_gather_over_dp
        self._cp_rounds = evaluation.EvalRounds(dataloader, self._cp_dp_rank)
        try:
            return super().evaluation_loop(dataloader, *args, **kwargs)
        finally:
            self._cp_rounds = None

    def _cp_gather_over_dp(self, tensors):
        return evaluation.gather_over_dp(self.accelerator, tensors, self.cp.world_size)

    def prediction_step(self, model, inputs, prediction_loss_only: bool, ignore_keys=None):
        """The Trainer's prediction step on the sharded batch: the loss of the whole round (the
        token mean over every replica's batch; the same on every rank), logits gathered back
        into the batch's full order (batch, seqlen, vocab), the full batch's labels. A copy that
        completes the last round counts no target (its labels -100)."""
        inputs = self._prepare_inputs(inputs)
        if self._cp_rounds is not None and self._cp_rounds.next_is_copy():
            inputs = evaluation.without_targets(inputs)
        has_labels = bool(self.label_names) and all(
            inputs.get(k) is not None for k in self.label_names)
        labels = None
        if has_labels:
            labels = tuple(inputs[k].detach() for k in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        key = "input_ids" if "input_ids" in inputs else "inputs_embeds"
        shape = tuple(inputs[key].shape[:2])
        _, local = self._prepare_context_parallel_inputs(model, inputs)
        loss = logits = None
        with torch.no_grad(), self.compute_loss_context_manager():
            if has_labels:
                loss, logits = self._cp_eval_loss(model, local, prediction_loss_only)
            if not prediction_loss_only and logits is None:
                logits = model(**_model_inputs(local)).logits
        if prediction_loss_only:
            return loss, None, None
        packed = local.get(KEYWORD) is not None
        source = find_packing(data.documents_if_uneven(inputs, self.cp), key, WHAT).source \
            if packed else None
        return loss, evaluation.full_order(self.cp, logits.detach(), shape, local, source), labels

    def _cp_eval_loss(self, model, local: dict[str, Any], loss_only: bool):
        """(the round's loss, the same on every rank; this rank's logits or None)."""
        if self._cp_own_loss():
            outputs, loss_sum, aux = self._cp_forward(model, local)
            count = (local["shift_labels"] != IGNORE_INDEX).sum()
            loss = evaluation.round_mean(loss_sum, count)
            if aux is not None:  # (one process's at one replica; else the replicas' mean)
                loss = loss + (evaluation.world_sum(aux) / dist.get_world_size()).to(loss.dtype)
            return loss.detach(), (None if loss_only else outputs.logits)
        # Another class's loss over a given count (the Trainer's rule): the world's count of
        # the round's targets, so that the ranks' losses sum to the round's mean.
        total = evaluation.world_sum((local["shift_labels"] != IGNORE_INDEX).sum())
        with evaluation.whole_gathers(self.accelerator):
            loss = self.compute_loss(model, dict(local), num_items_in_batch=total.clamp(min=1))
        mean = evaluation.world_sum(loss.detach().mean() / self._cp_loss_scale())
        return mean.to(loss.dtype), None


def _describe(cp: ContextParallel) -> str:
    """cp's settings, the same words on every rank."""
    return f"strategy {cp.strategy!r}, layout {cp.layout!r}, {cp.world_size} ranks"


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
