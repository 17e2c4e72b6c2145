"""Scenarios of hybrid models under the trainers (run by tests/trainer_cp_worker.py): Qwen3.5
(gated delta rule) and Bamba (Mamba-2), packed documents, gradient checkpointing on, under
ContextParallelTrainer (DataCollatorWithFlattening) and ContextParallelSFTTrainer
(SFTConfig(packing=True), TRL's padding-free batches); the trainer parallelizes the model.

The one-process reference is the same trainer on the same documents, each document in its own
right-padded row. Not the packed rows: transformers' own CPU mixers cannot keep packed documents
apart (with DataCollatorWithFlattening's position ids each document's convolution and state run
on from the one before; TRL's padding-free batch, whose seq_idx would separate them, is refused
without the causal_conv1d kernel). Right padding after a causal document cannot reach its
tokens, and the mixers zero the padded positions: each row is its document alone, which
tests/test_trainer.py's test_hybrid_reference_keeps_documents_apart checks against one forward per
document. The targets are the same (each document's tokens after its first, predicted from its
own tokens), so the Trainer's count, every loss, gradient and update are one process's. FLOPs are
estimated from the padded rows there (not compared); tokens are counted without padding
(include_num_input_tokens_seen="non_padding") and compared.
"""

from __future__ import annotations

import hybrid_models
import torch
import transformers as T
from trainer_cp_kit import (
    HYBRIDS,
    documents,
    every_rank,
    results,
    scenario,
    sft_documents,
    tokenizer,
    train_run,
)

IGNORE = -100


def padded_rows(docs: list[list[int]]) -> dict:
    """Each document its own row, right-padded (pad id 0): input_ids, attention_mask, and labels
    with -100 on the padding and on each document's first token (never a target)."""
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, IGNORE)
    for i, doc in enumerate(docs):
        ids[i, :len(doc)] = torch.tensor(doc)
        mask[i, :len(doc)] = 1
        labels[i, 1:len(doc)] = ids[i, 1:len(doc)]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def padded_documents(features: list[dict]) -> dict:
    """The reference's collator for DataCollatorWithFlattening's batches: the same documents."""
    return padded_rows([f["input_ids"] for f in features])


def unpacked(features: list[dict]) -> dict:
    """The reference's collator for TRL's packed rows: each row's documents (by its
    `seq_lengths`) in rows of their own."""
    docs = []
    for f in features:
        start = 0
        for n in f["seq_lengths"]:
            docs.append(list(f["input_ids"][start:start + n]))
            start += n
        assert start == len(f["input_ids"]), (start, len(f["input_ids"]))
    return padded_rows(docs)


def _ablation(run) -> dict:
    """run() with every mixer on its rank's pieces only (no halo, no entry state): its losses."""
    with hybrid_models.mixers_alone():
        return {"loss": run()["loss"]}


@scenario(world=2)
def hybrid_models_trainer(ctx):
    """ContextParallelTrainer, DataCollatorWithFlattening (position ids), 12 documents of 5 to
    20 tokens, bs 3, gradient checkpointing (Qwen3.5 non-reentrant, transformers' default;
    Bamba reentrant), gradient clipping (the grad norm logged), ring over cp 2."""
    out = {}
    for kind, reentrant in zip(HYBRIDS, (False, True)):
        def run(kind=kind, reentrant=reentrant):
            args = ctx.args(dp=1, batch=3, gradient_checkpointing=True,
                            gradient_checkpointing_kwargs={"use_reentrant": reentrant},
                            max_grad_norm=1.0, include_num_input_tokens_seen="non_padding")
            collator = padded_documents if ctx.reference else T.DataCollatorWithFlattening()
            return train_run(ctx, kind, args, documents(12), collator)
        out[kind] = run()
        if not ctx.reference:
            out[f"ablation_{kind}"] = _ablation(run)
    return out


@scenario(world=2)
def hybrid_models_sft(ctx):
    """ContextParallelSFTTrainer, SFTConfig(packing=True) (best-fit packing, TRL's padding-free
    batches with seq_idx), bs 2, gradient checkpointing on (TRL's default), ring over cp 2."""
    from datasets import Dataset

    out = {}
    for kind in HYBRIDS:
        def run(kind=kind):
            args = ctx.args(dp=1, batch=2, sft=True, packing=True, max_length=40,
                            max_grad_norm=1.0, include_num_input_tokens_seen="non_padding")
            assert args.gradient_checkpointing, "TRL's default changed"
            trainer, capture = ctx.trainer(kind, args, sft=True, processing_class=tokenizer(),
                                           train_dataset=Dataset.from_list(sft_documents(20)))
            if ctx.reference:  # (TRL takes no collator of the user's with padding-free packing)
                trainer.data_collator = unpacked
            trainer.train()
            return {**results(trainer, capture),
                    "packed_rows": len(trainer.train_dataset),
                    "every_rank_rows": every_rank(len(trainer.train_dataset))}
        out[kind] = run()
        if not ctx.reference:
            out[f"ablation_{kind}"] = _ablation(run)
    return out
