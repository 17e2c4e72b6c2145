"""Scenarios of tests/test_trainer.py: the same transformers Trainer / TRL SFTTrainer run in one
process with SDPA (`--reference`) and under torchrun with cpattn context parallelism.

    python tests/trainer_cp_worker.py --reference --out ref.pt --scenarios rows,packed
    torchrun --nproc-per-node 2 tests/trainer_cp_worker.py --out cp.pt --scenarios rows,packed

Each scenario writes what the comparison needs (per-step logged losses, step-1 gradients after
the Trainer's DDP, final weights, token and FLOP counters, eval loss, predictions) under its
name; the context-parallel run also runs each scenario's ablation (a deliberate mistake that
must change the result or raise) and records what every rank raised for the misuse cases. One
launch runs many scenarios (the imports and the process group are paid once).

The toolkit (models, data, runs) is tests/trainer_cp_kit.py, the ablations
tests/trainer_cp_ablations.py; the scenarios of issue 56 (batches exactly one process's, any
collator length, the CPU set-up, messages) are in tests/trainer_cp_exact.py, the hybrid models
under both trainers in tests/trainer_cp_hybrid.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer_cp_exact  # noqa: E402,F401  (registers its scenarios)
import trainer_cp_hybrid  # noqa: E402,F401  (registers its scenarios)
import transformers as T  # noqa: E402
from trainer_cp_ablations import (  # noqa: E402
    count_not_divided,
    labels_shifted_per_shard,
    local_aux,
    local_order,
    not_resharded,
    one_rank_astray,
)
from trainer_cp_kit import (  # noqa: E402
    SCENARIOS,
    Context,
    completions,
    documents,
    every_rank,
    loss_of,
    model,
    raised,
    results,
    rows,
    rows_run,
    scenario,
    sft_documents,
    tokenizer,
    train_run,
    with_ablation,
)


@scenario(world=2)
def rows_ring(ctx):
    """Equal-length rows with different target counts, shuffled, GA 2 (cp 2, dp 1, ring); the
    model loaded with attn_implementation=register(cp), the older way (the trainer parallelizes
    it)."""
    run = rows_run(ctx, "llama", 12, attach="register", dp=1, batch=2,
                   gradient_accumulation_steps=2)
    out = with_ablation(ctx, run, labels_shifted_per_shard)
    if not ctx.reference:
        out["refused"] = raised(lambda: run(not_resharded(T.Trainer)))
    return out


@scenario(world=2)
def rows_tokens_per_replica(ctx):
    """average_tokens_across_devices=False (the per-replica mean: exact at dp 1), all-gather;
    gradient clipping on."""
    args = ctx.args(dp=1, batch=2, gradient_accumulation_steps=2,
                    average_tokens_across_devices=False, max_grad_norm=0.5)
    return {"main": train_run(ctx, "llama", args, rows(8), T.default_data_collator,
                           strategy="allgather")}


@scenario(world=2)
def checkpointing(ctx):
    """Gradient checkpointing: the backward recomputes the attention (its collectives too)."""
    return {"main": train_run(ctx, "llama", ctx.args(dp=1, batch=2, gradient_checkpointing=True),
                           rows(4), T.default_data_collator)}


@scenario(world=2)
def mixed_precision(ctx):
    """bf16=True (autocast over fp32 weights): runs, close to one process at bf16 precision."""
    return {"main": train_run(ctx, "llama", ctx.args(dp=1, batch=2, bf16=True), rows(4),
                           T.default_data_collator)}


@scenario(world=2)
def packed(ctx):
    """DataCollatorWithFlattening: position_ids form (Qwen3, ring; Llama, Ulysses) and its
    cu_seq_lens form (Llama, all-gather)."""
    out = {}
    for name, kind, strategy, flash in (("ring", "qwen3", "ring", False),
                                        ("ulysses", "llama", "ulysses", False),
                                        ("allgather", "llama", "allgather", True)):
        collator = T.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
        out[name] = train_run(ctx, kind, ctx.args(dp=1, batch=3), documents(9), collator,
                           strategy=strategy)
    if not ctx.reference:
        collator = T.DataCollatorWithFlattening()
        out["ablation"] = loss_of(train_run(ctx, "qwen3", ctx.args(dp=1, batch=3), documents(9),
                                          collator, base=labels_shifted_per_shard(T.Trainer)))
    return out


@scenario(world=2)
def label_smoothing(ctx):
    run = rows_run(ctx, "llama", 6, dp=1, batch=2, label_smoothing_factor=0.1)
    return with_ablation(ctx, run, labels_shifted_per_shard)


@scenario(world=2)
def moe(ctx):
    """Qwen3-MoE's load-balancing loss (router_aux_loss_coef 0.5) over the whole sequence."""
    return with_ablation(ctx, rows_run(ctx, "qwen3_moe", 6, dp=1, batch=2), local_aux)


@scenario(world=2)
def evaluate_predict(ctx):
    """evaluate() and predict(): rows (ring) and packed documents (Ulysses)."""
    out = {"rows": train_run(ctx, "llama", ctx.args(dp=1, batch=2, max_steps=1), rows(2),
                          T.default_data_collator, eval_data=rows(4, seed=1),
                          predict=rows(4, seed=2))}
    collator = T.DataCollatorWithFlattening()
    out["packed"] = train_run(ctx, "llama", ctx.args(dp=1, batch=3, max_steps=1), documents(3),
                           collator, strategy="ulysses", eval_data=documents(6, seed=1),
                           predict=documents(3, seed=2))
    if not ctx.reference:
        out["ablation"] = train_run(ctx, "llama", ctx.args(dp=1, batch=2, max_steps=1), rows(2),
                                 T.default_data_collator, predict=rows(4, seed=2),
                                 base=local_order(T.Trainer))
    return out


@scenario(world=2)
def resume(ctx):
    """A checkpoint at step 2 of 4, then training resumed from it: the same as uninterrupted;
    the checkpoint is written once and loads without cpattn."""
    def args(**kw):
        return ctx.args(dp=1, batch=2, save_strategy="steps", save_steps=2, **kw)
    data = rows(8)
    first = args()
    whole = train_run(ctx, "llama", first, data, T.default_data_collator)
    checkpoint = os.path.join(first.output_dir, "checkpoint-2")
    resumed, capture = ctx.trainer("llama", args(), train_dataset=data,
                                   data_collator=T.default_data_collator)
    resumed.train(resume_from_checkpoint=checkpoint)
    out = {"whole": whole, "resumed": results(resumed, capture), "checkpoint": checkpoint,
           "files": sorted(os.listdir(checkpoint))}
    if not ctx.reference:
        skipped, capture = ctx.trainer("llama", args(ignore_data_skip=True), train_dataset=data,
                                       data_collator=T.default_data_collator)
        skipped.train(resume_from_checkpoint=checkpoint)
        out["ablation"] = {"weights": results(skipped, capture)["weights"]}
    return out



@scenario(world=2)
def sft_packing(ctx):
    """SFTTrainer packing=True (best-fit packing, padding-free batches with seq_idx), tiny Qwen3,
    with evaluation on packed documents; the model parallelized before the trainer (which takes
    it as it is)."""
    from datasets import Dataset
    from trl import SFTTrainer

    def run(base):
        args = ctx.args(dp=1, batch=2, sft=True, packing=True, max_length=40, eval_packing=True)
        trainer, capture = ctx.trainer(
            "qwen3", args, sft=True, base=base, processing_class=tokenizer(), attach="parallelize",
            train_dataset=Dataset.from_list(sft_documents(24)),
            eval_dataset=Dataset.from_list(sft_documents(8, seed=1)))
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
        return {**results(trainer, capture), "eval": evaluated,
                "eval_every_rank": every_rank(evaluated)}

    return with_ablation(ctx, run, count_not_divided, SFTTrainer)



@scenario(world=2)
def sft_completion_only(ctx):
    """SFTTrainer without packing (right-padded batches with an attention mask), the loss on the
    completions only."""
    from datasets import Dataset
    from trl import SFTTrainer

    def run(base):
        args = ctx.args(dp=1, batch=3, sft=True, completion_only_loss=True)
        trainer, capture = ctx.trainer("llama", args, sft=True, base=base,
                                       processing_class=tokenizer(),
                                       train_dataset=Dataset.from_list(completions(9)))
        trainer.train()
        return results(trainer, capture)

    return with_ablation(ctx, run, labels_shifted_per_shard, SFTTrainer)


@scenario(world=2)
def loss_options(ctx):
    """cpattn.cross_entropy's num_items_in_batch, label_smoothing and reduction='sum' (loss and
    the logits' gradient) against torch on the full batch; shard_batch with TRL's seq_idx."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 32, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 32), generator=g)
    labels[0, :9] = -100
    options = {"items": dict(num_items_in_batch=37),
               "smoothing": dict(label_smoothing=0.1, num_items_in_batch=37),
               "sum": dict(label_smoothing=0.1, reduction="sum"),
               "mean": dict(label_smoothing=0.1)}
    out = {}
    if ctx.reference:
        shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1).flatten()
        for name, kw in options.items():
            x = logits.clone().requires_grad_()
            loss = torch.nn.functional.cross_entropy(
                x.flatten(0, 1), shifted, label_smoothing=kw.get("label_smoothing", 0.0),
                reduction="sum")
            loss = loss / {"items": 37, "smoothing": 37, "sum": 1,
                           "mean": int((shifted != -100).sum())}[name]
            loss.backward()
            out[name] = (loss.item(), x.grad)
        return out
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    import cpattn

    cp = ctx.cp("ring")
    local = cpattn.shard_batch({"input_ids": labels.clamp(min=0), "labels": labels}, cp)
    for name, kw in options.items():
        x = cp.shard(logits).requires_grad_()
        loss = cpattn.cross_entropy(x, local["shift_labels"], cp, **kw)
        loss.backward()
        out[name] = (loss.item(), cp.unshard(x.grad) / cp.world_size)
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(
        documents(5))
    with_idx = cpattn.shard_batch(batch, cp)
    without = cpattn.shard_batch({k: v for k, v in batch.items() if k != "seq_idx"}, cp)
    out["seq_idx_dropped"] = "seq_idx" not in with_idx and all(
        torch.equal(with_idx[k], without[k]) for k in without if torch.is_tensor(without[k]))
    wrong = dict(batch, seq_idx=torch.zeros_like(batch["seq_idx"]))
    out["seq_idx_wrong"] = raised(lambda: cpattn.shard_batch(wrong, cp))
    return out


@scenario(world=2)
def refusals(ctx):
    """Misuse raises ValueError on every rank, naming a correct path."""
    if ctx.reference:
        return {}
    from accelerate.parallelism_config import ParallelismConfig
    from datasets import Dataset
    from trl import SFTTrainer

    from cpattn.integrations.trainer import ContextParallelTrainer, context_parallel
    from cpattn.integrations.transformers import register

    cp = context_parallel(2, "ring")
    data = rows(4)

    def build(attn=None, base=ContextParallelTrainer, **kw):
        m = model("llama", attn or register(cp, "cpattn_refusals"))
        extra = {k: kw.pop(k) for k in ("train_dataset", "processing_class") if k in kw}
        return base(cp, model=m, args=ctx.args(dp=1, **kw),
                    **{"train_dataset": data, "data_collator": T.default_data_collator, **extra})

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(data)

    def sft_smoothing():
        from cpattn.integrations.trainer import with_context_parallel

        m = model("llama", register(cp, "cpattn_refusals"))
        with_context_parallel(SFTTrainer)(
            cp, model=m, args=ctx.args(dp=1, sft=True, label_smoothing_factor=0.1),
            train_dataset=Dataset.from_list(sft_documents(4)), processing_class=tokenizer())

    def striped_hybrid():  # (parallelize refuses the striped layout for models with mixers)
        striped = context_parallel(2, "ring", layout="striped")
        ContextParallelTrainer(striped, model=model("qwen3_5", "sdpa"), args=ctx.args(dp=1),
                               train_dataset=data, data_collator=T.default_data_collator)

    return {
        "parallelize_refuses": raised(striped_hybrid),
        "accelerate_cp": raised(lambda: build(parallelism_config=ParallelismConfig(cp_size=2))),
        "batch_rebalance": raised(lambda: build(train_sampling_strategy="batch_rebalance")),
        "iterable": raised(lambda: build(train_dataset=Stream(), max_steps=2)),
        "eval_not_resharded": raised(lambda: build().evaluate(eval_dataset=Stream())),
        "sft_label_smoothing": raised(sft_smoothing),
    }


@scenario(world=4)
def dp_accumulation(ctx):
    """dp 2 x cp 2, GA 2, shuffled rows with different target counts per replica."""
    run = rows_run(ctx, "llama", 16, dp=2, batch=1, gradient_accumulation_steps=2)
    return with_ablation(ctx, run, count_not_divided)



@scenario(world=4)
def dp_one_group_astray(ctx):
    """Different batches in one CP group only: every rank raises (none waits in the gradient
    all-reduce)."""
    if ctx.reference:
        return {}
    return {"refused": raised(lambda: train_run(ctx, "llama", ctx.args(dp=2, batch=1), rows(8),
                                             T.default_data_collator,
                                             base=one_rank_astray(T.Trainer)))}


@scenario(world=4)
def dp_tokens_per_replica(ctx):
    """average_tokens_across_devices=False at dp 2 x cp 2: the per-replica mean, the same as one
    process when the replicas hold equal numbers of targets."""
    args = ctx.args(dp=2, batch=1, gradient_accumulation_steps=2,
                    average_tokens_across_devices=False)
    return {"main": train_run(ctx, "llama", args, rows(8, ignored=False), T.default_data_collator,
                           strategy="ulysses")}


@scenario(world=4)
def dp_evaluate(ctx):
    """evaluate() and predict() at dp 2 x cp 2: one copy of each prediction per CP group."""
    return {"main": train_run(ctx, "llama", ctx.args(dp=2, batch=2, max_steps=1), rows(4),
                           T.default_data_collator, eval_data=rows(8, seed=1),
                           predict=rows(8, seed=2))}


@scenario(world=4)
def dp_sft_packing(ctx):
    """SFTTrainer packing at dp 2 x cp 2 (TRL's token counter over the replicas)."""
    from datasets import Dataset

    args = ctx.args(dp=2, batch=1, sft=True, packing=True, max_length=40)
    trainer, capture = ctx.trainer("qwen3", args, sft=True, processing_class=tokenizer(),
                                   train_dataset=Dataset.from_list(sft_documents(24)))
    trainer.train()
    return {"main": results(trainer, capture)}


@scenario(world=4)
def hybrid(ctx):
    """Hybrid (ring 2 x Ulysses 2, cp 4): rows, and packed documents with evaluate / predict."""
    out = {"rows": train_run(ctx, "llama", ctx.args(dp=1, batch=2), rows(4),
                          T.default_data_collator, strategy="hybrid", cp_size=4,
                          ulysses_size=2),
           "packed": train_run(ctx, "llama", ctx.args(dp=1, batch=3), documents(6),
                            T.DataCollatorWithFlattening(), strategy="hybrid", cp_size=4,
                            ulysses_size=2, eval_data=documents(6, seed=1),
                            predict=documents(3, seed=2))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", required=True)
    parser.add_argument("--tmp", required=True, help="a folder every rank can write (checkpoints)")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    T.logging.set_verbosity_error()
    names = opts.scenarios.split(",")
    if not opts.reference:
        dist.init_process_group("gloo")
    ctx = Context(opts.reference, opts.tmp)
    out = {}
    try:
        for name in names:
            world, fn = SCENARIOS[name]
            assert opts.reference or world == ctx.world, (name, world, ctx.world)
            out[name] = fn(ctx)
        if opts.reference or dist.get_rank() == 0:
            torch.save(out, opts.out)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if not opts.reference:
        import cpattn

        cpattn.destroy_communicators()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # (no interpreter teardown: see cpattn.testing.distributed)


if __name__ == "__main__":
    main()

