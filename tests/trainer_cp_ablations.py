"""Deliberate mistakes of the trainer scenarios: each is a trainer class (or a patch) that must
change a run's result or make it raise, so that the comparisons of tests/test_trainer.py can
fail.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _patched(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def labels_shifted_per_shard(base):
    """The classic mistake: each rank shifts its own shard's labels (targets lost at the shard
    joins, mispaired across zigzag's chunks)."""
    from cpattn.integrations.trainer import with_context_parallel
    from cpattn.training import shard_batch

    class Shifted(with_context_parallel(base)):
        def _prepare_context_parallel_inputs(self, model, inputs):
            context, local = super()._prepare_context_parallel_inputs(model, inputs)
            as_tokens = {**{k: v for k, v in inputs.items() if k != "labels"},
                         "input_ids": inputs["labels"]}  # (sharded as the tokens are)
            labels = shard_batch(as_tokens, self.cp)["input_ids"]
            local["shift_labels"] = torch.cat(
                [labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
            return context, local

    return Shifted


def count_not_divided(base):
    """get_cp_size left at 1: the Trainer's target count is cp times too large."""
    from cpattn.integrations.trainer import with_context_parallel

    class NotDivided(with_context_parallel(base)):
        def get_cp_size(self):
            return 1

    return NotDivided


def _train_loader_shard(trainer_class, adjust):
    """trainer_class whose training loader's BatchSamplerShard gets adjust(shard) after the
    trainer re-sharded it."""
    from accelerate.data_loader import BatchSamplerShard

    class Adjusted(trainer_class):
        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            assert isinstance(loader.batch_sampler, BatchSamplerShard)
            adjust(loader.batch_sampler)
            return loader

    return Adjusted


def not_resharded(base):
    """accelerate's sampler left as it is: batch k goes to rank k % W."""
    from cpattn.integrations.trainer import with_context_parallel

    def every_rank(shard):
        shard.num_processes, shard.process_index = dist.get_world_size(), dist.get_rank()

    return _train_loader_shard(with_context_parallel(base), every_rank)


def one_rank_astray(base):
    """Rank 3 reads replica 0's batches: only the second CP group's batches differ."""
    from cpattn.integrations.trainer import with_context_parallel

    def astray(shard):
        if dist.get_rank() == 3:
            shard.process_index = 0

    return _train_loader_shard(with_context_parallel(base), astray)


def filled(base):
    """accelerate's even_batches kept: the last batches filled with the first examples (on
    every loader, training and evaluation), as before issue 56."""
    from accelerate.data_loader import BatchSamplerShard

    from cpattn.integrations.trainer import data, with_context_parallel

    def fill(loader):
        shard = loader.batch_sampler
        assert isinstance(shard, BatchSamplerShard)
        shard.even_batches = True
        if isinstance(shard.batch_sampler, data.WholeRounds):
            shard.batch_sampler = shard.batch_sampler.batch_sampler
        return loader

    class Filled(with_context_parallel(base)):
        def get_train_dataloader(self):
            return fill(super().get_train_dataloader())

        def get_eval_dataloader(self, eval_dataset=None):
            return fill(super().get_eval_dataloader(eval_dataset))

        def get_test_dataloader(self, test_dataset):
            return fill(super().get_test_dataloader(test_dataset))

    return Filled


def no_documents(base):
    """A batch whose length the layout cannot split evenly handed to shard_batch as it is."""
    from cpattn.integrations.trainer import data, with_context_parallel

    class AsItIs(with_context_parallel(base)):
        def _prepare_context_parallel_inputs(self, model, inputs):
            with _patched(data, "documents_if_uneven", lambda batch, cp: batch):
                return super()._prepare_context_parallel_inputs(model, inputs)

    return AsItIs


def no_cpu_ranks(base):
    """The TrainingArguments of a CPU machine left to run each process alone."""
    from cpattn.integrations.trainer import with_context_parallel

    class Alone(with_context_parallel(base)):
        def _cp_use_every_rank(self, args):
            pass

    return Alone


def truncated_gathers(base):
    """TRL's per-rank sums (tokens, correct tokens, entropy) left to gather_for_metrics'
    truncation at the end of a loader."""
    from cpattn.integrations.trainer import evaluation, with_context_parallel

    def as_is(accelerator):
        return contextlib.nullcontext()

    class Truncated(with_context_parallel(base)):
        def compute_loss(self, *args, **kwargs):
            with _patched(evaluation, "whole_gathers", as_is):
                return super().compute_loss(*args, **kwargs)

        def prediction_step(self, *args, **kwargs):
            with _patched(evaluation, "whole_gathers", as_is):
                return super().prediction_step(*args, **kwargs)

    return Truncated


def local_aux(base):
    """transformers' own MoE loss over each rank's tokens instead of the whole sequence."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from cpattn.integrations.trainer import mixin, with_context_parallel

    def local(logits, cp, experts, k, documents=None):
        return load_balancing_loss_func(logits, experts, k)

    class LocalAux(with_context_parallel(base)):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            with _patched(mixin, "load_balancing_loss", local):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return LocalAux


def local_order(base):
    """Predictions returned in each rank's local order, not gathered back."""
    from cpattn.integrations.trainer import evaluation, with_context_parallel

    def local(cp, local_logits, shape, local, source):
        out = torch.zeros((*shape, *local_logits.shape[2:]))
        out[:, :local_logits.shape[1]] = local_logits
        return out

    class LocalOrder(with_context_parallel(base)):
        def prediction_step(self, *args, **kwargs):
            with _patched(evaluation, "full_order", local):
                return super().prediction_step(*args, **kwargs)

    return LocalOrder
