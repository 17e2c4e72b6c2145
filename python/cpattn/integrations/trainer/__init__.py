"""Context parallelism inside transformers' `Trainer` and TRL's `SFTTrainer`.

    args = TrainingArguments("out", ...)            # under torchrun: starts torch.distributed
    cp = context_parallel(cp_size=2, strategy="ring")       # groups of 2 consecutive ranks
    model = AutoModelForCausalLM.from_pretrained(name)      # any model parallelize takes
    trainer = ContextParallelTrainer(cp, model=model, args=args, train_dataset=ds,
                                     data_collator=DataCollatorWithFlattening())
    trainer.train()                                 # (the trainer parallelized the model)

`ContextParallelSFTTrainer` is the same for TRL's `SFTTrainer` (TRL imported when first named);
`with_context_parallel(cls)` makes the class for any other Trainer subclass.

The trainer makes the model context-parallel itself (`parallelize(model, cp)`, unless the model
is parallelized with this cp already; a model attached to another ContextParallel is refused).

What the mixin changes, and why (the Trainer's own code does the rest; the public methods
get_*_dataloader, compute_loss, prediction_step, evaluation_loop, floating_point_ops,
call_model_init and get_cp_size are overridden, and two private ones:
`_prepare_context_parallel_inputs`, the Trainer's context-parallel seam, and
`_track_num_input_tokens`; a CPU machine's TrainingArguments get use_cpu=True when
torch.distributed runs W > 1 ranks):
- data (data.py): accelerate deals batch k to process k % W; the mixin re-shards its samplers
  over the data-parallel ranks (dp = W / cp, dp rank = rank // cp), so every rank of a CP group
  gets the same full batch (train, eval and test loaders; shuffling, resume and gradient
  accumulation stay the Trainer's). At dp 1 no batch is filled (the last one is one process's
  partial batch); at dp > 1 training fills as accelerate does and evaluation runs whole rounds
  whose completing copies count nothing. The datasets (length and a sample) and each step's
  batches are checked to agree over the ranks (ValueError on every rank otherwise).
- sharding: `_prepare_context_parallel_inputs` runs after the Trainer counted the targets of
  the full batches (`num_items_in_batch`) and returns `cpattn.shard_batch`'s local batch
  (labels shifted over the whole sequence, global positions, packed documents; a batch whose
  length the layout cannot split evenly is sharded as documents, padded inside the shards).
- counts: `get_cp_size` is cp's size, so the Trainer divides its count (gathered over every
  rank) by cp, and the global batch size is per-device x accumulation x dp. Token and FLOP
  counters count each CP group's batch once.
- loss (`ContextParallelTrainer`): this rank's token-loss sum / num_items_in_batch, scaled as the
  Trainer scales it (x W with average_tokens_across_devices): the Trainer's DDP / FSDP mean over
  all W = dp x cp ranks is then the exact token mean of the step; label smoothing and the MoE
  load-balancing loss over the whole sequence. TRL's own loss is already right on sharded
  inputs with `shift_labels`; its token counter is corrected.
- evaluation (evaluation.py): the loss of each round is the token mean over its real targets,
  the same on every rank; predictions (logits) are gathered back into the batch's full order,
  and gathered over dp (one copy per CP group) by `gather_function`.
"""

from __future__ import annotations

try:
    import accelerate  # noqa: F401
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - only without transformers / accelerate
    raise ImportError(
        "cpattn.integrations.trainer needs transformers and accelerate (pip install "
        "\"cpattn[trainer]\": the versions tested); cpattn itself does not") from e

from cpattn.integrations.trainer.mixin import MIXIN_DOC, ContextParallelMixin
from cpattn.integrations.trainer.ranks import WHAT, context_parallel

# (and ContextParallelSFTTrainer, made when first named: see __getattr__)
__all__ = ["ContextParallelMixin", "ContextParallelTrainer", "context_parallel",
           "with_context_parallel"]


def with_context_parallel(trainer_class: type) -> type:
    """The class `trainer_class` with context parallelism (ContextParallelMixin first in its
    bases): its constructor takes the cpattn.ContextParallel first. A subclass with its own
    compute_loss keeps it and gets the sharded batch (its targets as 'shift_labels', already
    shifted; pass the rest to the model, and divide by num_items_in_batch and scale as the
    Trainer does)."""
    if not (isinstance(trainer_class, type) and issubclass(trainer_class, Trainer)):
        raise TypeError(f"{WHAT}.with_context_parallel: needs a transformers.Trainer subclass, "
                        f"got {trainer_class!r}")
    if issubclass(trainer_class, ContextParallelMixin):
        return trainer_class
    name = f"ContextParallel{trainer_class.__name__}"
    return type(name, (ContextParallelMixin, trainer_class),
                {"__module__": __name__, "__doc__": _class_doc(name, trainer_class)})


def _class_doc(name: str, base: type) -> str:
    """cpattn's docstring for the class, then the base class's own."""
    own = MIXIN_DOC.format(name=name, base=base.__name__)
    return f"{own}\n\n{base.__name__}'s documentation:\n\n{base.__doc__ or ''}"


class ContextParallelTrainer(ContextParallelMixin, Trainer):
    __doc__ = _class_doc("ContextParallelTrainer", Trainer).replace(
        "Context parallelism (cpattn)",
        "transformers.Trainer with context parallelism (cpattn); the loss is the causal "
        "language model's, from the batch's 'labels'.\n\nContext parallelism (cpattn)", 1)


def __getattr__(name: str):
    """ContextParallelSFTTrainer, made when first named (TRL is imported then)."""
    if name == "ContextParallelSFTTrainer":
        try:
            import trl
        except ImportError as e:
            raise ImportError(f"{WHAT}.ContextParallelSFTTrainer needs TRL (pip install "
                              "\"cpattn[trainer]\")") from e
        cls = with_context_parallel(trl.SFTTrainer)
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
