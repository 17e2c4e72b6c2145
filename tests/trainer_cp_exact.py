"""Scenarios of issue 56 (run by tests/trainer_cp_worker.py): the batches one process sees (a
partial last batch, gradient accumulation's partial last window, evaluation counting each
example once at dp 2 x cp 2), any collator length (a flattened batch of one odd-length
document), the CPU set-up without use_cpu, and messages that name the cause.
"""

from __future__ import annotations

import torch.distributed as dist
import transformers as T
from trainer_cp_ablations import filled, no_cpu_ranks, no_documents, truncated_gathers
from trainer_cp_kit import (
    documents,
    every_rank,
    model,
    raised,
    results,
    rows,
    scenario,
    sft_documents,
    tokenizer,
    train_run,
)

EXACT = ("loss", "eval", "tokens", "predictions")  # what an ablation's run keeps


def _kept(run: dict) -> dict:
    return {k: run[k] for k in EXACT if k in run}


def _partial(ctx, cp_size: int) -> dict:
    """15 training rows (bs 2, accumulation 2: 7 full batches and one of 1 row, the last window
    of 2 batches), 5 evaluation rows and 5 predicted (the last batch of 1): nothing dropped."""
    def run(base):
        args = ctx.args(dp=1, batch=2, gradient_accumulation_steps=2, dataloader_drop_last=False)
        return train_run(ctx, "llama", args, rows(15), T.default_data_collator, base=base,
                         cp_size=cp_size, eval_data=rows(5, seed=1), predict=rows(5, seed=2))

    out = {"main": run(T.Trainer)}
    if not ctx.reference:
        out["ablation"] = _kept(run(filled(T.Trainer)))
    return out


@scenario(world=2)
def partial_batches(ctx):
    return _partial(ctx, 2)


@scenario(world=4)
def partial_batches_cp4(ctx):
    return _partial(ctx, 4)


@scenario(world=2)
def sft_partial_batches(ctx):
    """SFTTrainer packing with bs 2 and an odd number of packed rows, for training and for
    evaluation (eval_packing): the last batch of each holds one row. TRL's eval metrics too.
    Ablations: filled batches; TRL's per-rank sums truncated at the end of the loader."""
    from datasets import Dataset
    from trl import SFTTrainer

    def run(base):
        args = ctx.args(dp=1, batch=2, sft=True, packing=True, max_length=40, eval_packing=True,
                        dataloader_drop_last=False)
        trainer, capture = ctx.trainer(
            "qwen3", args, sft=True, base=base, processing_class=tokenizer(),
            train_dataset=Dataset.from_list(sft_documents(25)),
            eval_dataset=Dataset.from_list(sft_documents(9, seed=1)))
        trainer.train()
        metrics = trainer.evaluate()
        evaluated = metrics["eval_loss"]
        return {**results(trainer, capture), "eval": evaluated,
                "eval_every_rank": every_rank(evaluated), "eval_metrics": metrics,
                "packed_rows": (len(trainer.train_dataset), len(trainer.eval_dataset))}

    out = {"main": run(SFTTrainer)}
    if not ctx.reference:
        out["ablation"] = _kept(run(filled(SFTTrainer)))
        out["ablation_gathers"] = {"eval_metrics": run(truncated_gathers(SFTTrainer))[
            "eval_metrics"]}
    return out


def odd_documents(n: int, seed: int = 0) -> list[dict]:
    """n documents of odd lengths (3 to 19)."""
    return [{"input_ids": d["input_ids"][:len(d["input_ids"]) // 2 * 2 - 1]}
            for d in documents(n, seed)]


def _odd_lengths(ctx, cp_size: int, runs: tuple) -> dict:
    """Batches whose length the layout cannot split evenly: one odd-length document per batch
    (DataCollatorWithFlattening, both forms; with evaluate / predict), three documents in one
    row without position ids, rows of 17 tokens, TRL's packed rows of up to 37 tokens at bs 1."""
    from datasets import Dataset

    flatten = T.DataCollatorWithFlattening
    out = {}

    def flat(collator, batch, n, base=T.Trainer, **extra):
        return train_run(ctx, "llama", ctx.args(dp=1, batch=batch), odd_documents(n), collator,
                         base=base, cp_size=cp_size, **extra)

    if "flat_positions" in runs:
        out["flat_positions"] = flat(flatten(), 1, 6, eval_data=odd_documents(3, seed=1),
                                     predict=odd_documents(3, seed=2))
    if "flat_flash" in runs:
        out["flat_flash"] = flat(flatten(return_flash_attn_kwargs=True), 1, 4)
    if "flat_bare" in runs:
        out["flat_bare"] = flat(flatten(return_position_ids=False), 3, 6)
    if "rows_odd" in runs:
        out["rows_odd"] = train_run(ctx, "llama", ctx.args(dp=1, batch=2), rows(6, seqlen=17),
                                    T.default_data_collator, cp_size=cp_size,
                                    eval_data=rows(2, seqlen=17, seed=1))
    if "sft_bs1" in runs:
        args = ctx.args(dp=1, batch=1, sft=True, packing=True, max_length=37)
        trainer, capture = ctx.trainer("qwen3", args, sft=True, cp_size=cp_size,
                                       processing_class=tokenizer(),
                                       train_dataset=Dataset.from_list(sft_documents(10)))
        trainer.train()
        out["sft_bs1"] = results(trainer, capture)
    if not ctx.reference:
        out["refused"] = raised(lambda: flat(flatten(), 1, 2, base=no_documents(T.Trainer)))
    return out


@scenario(world=2)
def odd_lengths(ctx):
    return _odd_lengths(ctx, 2, ("flat_positions", "flat_flash", "flat_bare", "rows_odd",
                                 "sft_bs1"))


@scenario(world=4)
def odd_lengths_cp4(ctx):
    return _odd_lengths(ctx, 4, ("flat_positions", "rows_odd"))


@scenario(world=2)
def cpu_setup(ctx):
    """TrainingArguments without use_cpu (and no ddp_backend) under torchrun on CPUs, the
    process group already started with 2 ranks: the trainer runs them together. Ablation:
    left as they are, the arguments run each process alone: refused at construction."""
    def run(base):
        args = ctx.args(dp=1, batch=2, use_cpu=False, ddp_backend=None)
        return train_run(ctx, "llama", args, rows(4), T.default_data_collator, base=base)

    out = {"main": run(T.Trainer)}
    if not ctx.reference:
        out["refused"] = raised(lambda: run(no_cpu_ranks(T.Trainer)))
    return out


@scenario(world=2)
def messages(ctx):
    """Misuse whose message names its cause: a dataset that differs between the ranks (and
    the same dataset on every rank, which trains); a model registered, or parallelized, with
    another ContextParallel than the trainer's; a plain Trainer given a context-parallel model
    (registered Llama, parallelized Llama, parallelized Qwen3.5: it raises at the first forward,
    on every rank, saying to use ContextParallelTrainer). And a model from model_init, and one
    TRL loads from a folder's name, are attached to the trainer's cp."""
    if ctx.reference:
        return {}
    from cpattn.integrations.trainer import ContextParallelTrainer
    from cpattn.integrations.transformers import handle_of, parallelize, register

    def train(data, registered_with=None, parallelized_with=None):
        cp = ctx.cp()
        m = model("llama", register(registered_with or cp, "cpattn_messages"))
        if parallelized_with is not None:
            parallelize(m, parallelized_with)
        ContextParallelTrainer(cp, model=m, args=ctx.args(dp=1, max_steps=1), train_dataset=data,
                               data_collator=T.default_data_collator).train()

    def plain_trainer(kind, attach):
        cp = ctx.cp()
        m = model(kind, register(cp, "cpattn_messages") if attach == "register" else "sdpa")
        if attach == "parallelize":
            parallelize(m, cp)
        T.Trainer(model=m, args=ctx.args(dp=1, max_steps=1), train_dataset=rows(4),
                  data_collator=T.default_data_collator).train()

    def from_model_init():
        cp = ctx.cp()
        trainer = ContextParallelTrainer(
            cp, model_init=lambda: model("llama", "sdpa"), args=ctx.args(dp=1, max_steps=1),
            train_dataset=rows(4), data_collator=T.default_data_collator)
        handle = handle_of(trainer.model)
        return handle is not None and handle.cp is cp and trainer.cp_handle is handle

    def sft_from_name():  # (TRL loads the model inside its constructor)
        import os

        from datasets import Dataset
        from trl import SFTTrainer

        from cpattn.integrations.trainer import with_context_parallel

        folder = os.path.join(ctx.tmp, "tiny_qwen3")
        if dist.get_rank() == 0:
            model("qwen3", "sdpa").save_pretrained(folder)
        dist.barrier()
        cp = ctx.cp()
        trainer = with_context_parallel(SFTTrainer)(
            cp, model=folder, args=ctx.args(dp=1, sft=True, max_steps=1),
            processing_class=tokenizer(), train_dataset=Dataset.from_list(sft_documents(4)))
        handle = handle_of(trainer.model)
        return handle is not None and handle.cp is cp

    return {"dataset_differs": raised(lambda: train(rows(4, seed=dist.get_rank()))),
            "dataset_same": raised(lambda: train(rows(4))),
            "other_cp": raised(lambda: train(rows(4), registered_with=ctx.cp())),
            "other_cp_parallelized": raised(lambda: train(rows(4), parallelized_with=ctx.cp())),
            "plain_trainer": raised(lambda: plain_trainer("llama", "register")),
            "plain_trainer_parallelized": raised(lambda: plain_trainer("llama", "parallelize")),
            "plain_trainer_hybrid": raised(lambda: plain_trainer("qwen3_5", "parallelize")),
            "model_init_attached": from_model_init(),
            "sft_from_name_attached": sft_from_name()}


@scenario(world=4)
def dp_evaluate_exact(ctx):
    """dp 2 x cp 2: evaluation over 5 rows and over 5 packed documents (bs 2: the last round
    holds one batch of 1, the other replica a copy that counts nothing), predictions over 7
    rows (the last round's batches of 2 and 1 rows): one process's eval loss with a batch of 4,
    each example once. Ablation: accelerate's filled batches."""
    def run(base):
        return train_run(ctx, "llama", ctx.args(dp=2, batch=2, max_steps=1,
                                                dataloader_drop_last=False),
                         rows(4), T.default_data_collator, base=base,
                         eval_data=rows(5, seed=1), predict=rows(7, seed=2))

    out = {"rows": run(T.Trainer),
           "packed": train_run(ctx, "llama", ctx.args(dp=2, batch=2, max_steps=1,
                                                      dataloader_drop_last=False),
                               documents(4), T.DataCollatorWithFlattening(),
                               eval_data=documents(5, seed=1))}
    if not ctx.reference:
        out["ablation"] = _kept(run(filled(T.Trainer)))
    return out
