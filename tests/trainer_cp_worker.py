"""Scenarios of tests/test_trainer.py: the same transformers Trainer / TRL SFTTrainer run in one
process with SDPA (`--reference`) and under torchrun with cpattn context parallelism.

    python tests/trainer_cp_worker.py --reference --out ref.pt --scenarios rows,packed
    torchrun --nproc-per-node 2 tests/trainer_cp_worker.py --out cp.pt --scenarios rows,packed

Each scenario writes what the comparison needs (per-step logged losses, step-1 gradients after
the Trainer's DDP, final weights, token and FLOP counters, eval loss, predictions) under its
name; the context-parallel run also runs each scenario's ablation (a deliberate mistake that
must change the result or raise) and records what every rank raised for the misuse cases. One
launch runs many scenarios (the imports and the process group are paid once).

Batches: the reference's per-device batch is dp x the context-parallel run's, with the same
gradient accumulation, sampler and seed, so that each optimizer step covers the same samples.
AdamW's epsilon is 1e-5: with a smaller one, gradient entries near 0 (fp32 rounding noise of
1e-7 relative) become updates of about the learning rate that differ between the runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import transformers as T  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, use_cache=False)


def config(kind: str, **overrides):
    if kind == "llama":
        return T.LlamaConfig(**{**COMMON, **overrides})
    if kind == "qwen3":
        return T.Qwen3Config(**{**COMMON, "head_dim": 8, **overrides})
    if kind == "qwen3_moe":
        return T.Qwen3MoeConfig(**{**COMMON, "head_dim": 8, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                   "decoder_sparse_step": 1, "output_router_logits": True,
                                   "router_aux_loss_coef": 0.5, **overrides})
    raise AssertionError(kind)


def model(kind: str, attn: str, **overrides):
    torch.manual_seed(0)
    m = T.AutoModelForCausalLM.from_config(config(kind, **overrides), attn_implementation=attn,
                                           dtype=torch.float32)
    with torch.no_grad():  # logits with a real spread
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return m


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, VOCAB, (n,), generator=g).tolist()


def rows(n: int, seqlen: int = 32, seed: int = 0, ignored: bool = True) -> list[dict]:
    """n rows of seqlen tokens; with `ignored`, row i has (7 * i) % 23 leading -100 targets (rows
    with different numbers of targets)."""
    out = []
    for i in range(n):
        ids = _ids(seqlen, 1000 * seed + i)
        labels = list(ids)
        if ignored:
            labels[:(7 * i) % 23] = [-100] * ((7 * i) % 23)
        out.append({"input_ids": ids, "labels": labels})
    return out


def documents(n: int, seed: int = 0) -> list[dict]:
    """n documents of 5 to 20 tokens (packed by the collator)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    lengths = torch.randint(5, 21, (n,), generator=g).tolist()
    return [{"input_ids": _ids(k, 2000 * seed + i)} for i, k in enumerate(lengths)]


def tokenizer():
    """A word-level tokenizer made in memory (SFTTrainer wants a processing class)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t3"))
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="t1",
                                     eos_token="t2", unk_token="t3")


class Capture(TrainerCallback):
    """Step-1 gradients (after the Trainer's DDP averaged them), before the optimizer steps."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                          if p.grad is not None}


class Context:
    """What a scenario needs to know about the run: reference or context parallel, dp."""

    def __init__(self, reference: bool, tmp: str):
        self.reference = reference
        self.tmp = tmp
        self.world = 1 if reference else dist.get_world_size()
        self.runs = 0  # output directories: the same names on every rank (a shared folder)

    def args(self, dp: int, batch: int = 2, sft: bool = False, **kw):
        """TrainingArguments (SFTConfig with sft): the per-device batch x dp in the reference."""
        scale = dp if self.reference else 1
        self.runs += 1
        common = dict(
            output_dir=os.path.join(self.tmp, f"run{self.runs}"),
            per_device_train_batch_size=batch * scale, per_device_eval_batch_size=batch * scale,
            learning_rate=3e-3, adam_epsilon=1e-5, bf16=False,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
            max_grad_norm=0.0, logging_steps=1, report_to="none", save_strategy="no",
            disable_tqdm=True, include_num_input_tokens_seen="all", use_cpu=True,
            ddp_backend=None if self.reference else "gloo", seed=0, data_seed=0,
            dataloader_drop_last=True, num_train_epochs=1)
        common.update(kw)
        if sft:
            from trl import SFTConfig

            return SFTConfig(**common)
        return T.TrainingArguments(**common)

    def cp(self, strategy: str = "ring", cp_size: int = 2, ulysses_size=None):
        from cpattn.integrations.trainer import context_parallel

        return context_parallel(cp_size, strategy, ulysses_size=ulysses_size)

    def trainer(self, kind: str, args, strategy: str = "ring", cp_size: int = 2, sft=False,
                base=None, ulysses_size=None, model_overrides=None, **kw):
        """(trainer, capture) for this run: `base` (Trainer or SFTTrainer; with context
        parallelism its ContextParallel class, or `base` itself when it already is one)."""
        from trl import SFTTrainer

        base = base or (SFTTrainer if sft else T.Trainer)
        capture = Capture()
        if self.reference:
            m = model(kind, "sdpa", **(model_overrides or {}))
            return base(model=m, args=args, callbacks=[capture], **kw), capture
        from cpattn.integrations.trainer import with_context_parallel
        from cpattn.integrations.transformers import register

        cp = self.cp(strategy, cp_size, ulysses_size)
        m = model(kind, register(cp, f"cpattn_{strategy}"), **(model_overrides or {}))
        return with_context_parallel(base)(cp, model=m, args=args, callbacks=[capture],
                                           **kw), capture


def every_rank(value):
    """[value of each rank] under context parallelism, [value] in the reference."""
    if not dist.is_initialized():
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def results(trainer, capture) -> dict:
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    out = {
        "loss": losses,
        "loss_every_rank": every_rank(losses),
        "grad_norm": [h["grad_norm"] for h in history if "grad_norm" in h],
        "grads": capture.grads,
        "weights": {n: p.detach().clone() for n, p in
                    trainer.accelerator.unwrap_model(trainer.model).state_dict().items()},
        "tokens": trainer.state.num_input_tokens_seen,
        "flos": trainer.state.total_flos,
        "global_batch": trainer.get_total_train_batch_size(trainer.args),
    }
    trl_tokens = [h["num_tokens"] for h in history if "num_tokens" in h and "loss" in h]
    if trl_tokens:
        out["num_tokens"] = trl_tokens
    accuracy = [h["mean_token_accuracy"] for h in history if "mean_token_accuracy" in h
                and "loss" in h]
    if accuracy:
        out["mean_token_accuracy"] = accuracy
    return out


def raised(fn) -> str:
    """The ValueError fn raised ('' if none), the same on every rank (else AssertionError)."""
    try:
        fn()
        message = ""
    except ValueError as e:
        message = str(e)
    if dist.is_initialized():
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, message)
        assert all(m == message for m in every), f"ranks raised differently: {every}"
    return message


# ---- ablations: deliberate mistakes --------------------------------------------------------------


def _labels_shifted_per_shard(base):
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


def _count_not_divided(base):
    """get_cp_size left at 1: the Trainer's target count is cp times too large."""
    from cpattn.integrations.trainer import with_context_parallel

    class NotDivided(with_context_parallel(base)):
        def get_cp_size(self):
            return 1

    return NotDivided


def _not_resharded(base):
    """accelerate's sampler left as it is: batch k goes to rank k % W."""
    from accelerate.data_loader import BatchSamplerShard

    from cpattn.integrations.trainer import with_context_parallel

    class NotResharded(with_context_parallel(base)):
        def _get_dataloader(self, *args, **kwargs):
            loader = super()._get_dataloader(*args, **kwargs)
            shard = loader.batch_sampler
            assert isinstance(shard, BatchSamplerShard)
            shard.num_processes, shard.process_index = dist.get_world_size(), dist.get_rank()
            return loader

    return NotResharded


def _local_aux(base):
    """transformers' own MoE loss over each rank's tokens instead of the whole sequence."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from cpattn.integrations import trainer as cp_trainer

    class LocalAux(cp_trainer.with_context_parallel(base)):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            saved = cp_trainer.load_balancing_loss
            cp_trainer.load_balancing_loss = (
                lambda logits, cp, e, k, documents=None: load_balancing_loss_func(logits, e, k))
            try:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                cp_trainer.load_balancing_loss = saved

    return LocalAux


def _local_order(base):
    """Predictions returned in each rank's local order, not gathered back."""
    from cpattn.integrations.trainer import with_context_parallel

    class LocalOrder(with_context_parallel(base)):
        def _cp_full_order(self, local_logits, full, local):
            out = torch.zeros((*full["input_ids"].shape, *local_logits.shape[2:]))
            out[:, :local_logits.shape[1]] = local_logits
            return out

    return LocalOrder


# ---- scenarios -----------------------------------------------------------------------------------
# Each: scenario(ctx) -> {run name: results}; runs whose name starts with "ablation" only run
# under context parallelism.

SCENARIOS = {}


def scenario(world: int):
    def register(fn):
        SCENARIOS[fn.__name__] = (world, fn)
        return fn
    return register


def _train(ctx, kind, args, data, collator=None, base=None, strategy="ring", cp_size=2,
           eval_data=None, predict=None, ulysses_size=None, **kw):
    trainer, capture = ctx.trainer(kind, args, strategy, cp_size, base=base,
                                   train_dataset=data, eval_dataset=eval_data,
                                   data_collator=collator, ulysses_size=ulysses_size, **kw)
    trainer.train()
    out = results(trainer, capture)
    if eval_data is not None:
        out["eval"] = trainer.evaluate()["eval_loss"]
        out["eval_every_rank"] = every_rank(out["eval"])
    if predict is not None:
        prediction = trainer.predict(predict)
        out["predictions"] = torch.as_tensor(prediction.predictions)
        out["label_ids"] = torch.as_tensor(prediction.label_ids)
    return out


def _loss_of(run: dict) -> dict:
    return {"loss": run["loss"]}


def _with_ablation(ctx, run, mistake, base=None) -> dict:
    """{"main": run(base)} and, with context parallelism, "ablation": the loss of
    run(mistake(base)), the trainer class with a mistake that must change it."""
    base = base or T.Trainer
    out = {"main": run(base)}
    if not ctx.reference:
        out["ablation"] = _loss_of(run(mistake(base)))
    return out


def _rows_run(ctx, kind: str, n: int, **args):
    """run(base) for _with_ablation: `kind` trained on rows(n) with ctx.args(**args)."""
    def run(base):
        return _train(ctx, kind, ctx.args(**args), rows(n), T.default_data_collator, base=base)
    return run


@scenario(world=2)
def rows_ring(ctx):
    """Equal-length rows with different target counts, shuffled, GA 2 (cp 2, dp 1, ring)."""
    run = _rows_run(ctx, "llama", 12, dp=1, batch=2, gradient_accumulation_steps=2)
    out = _with_ablation(ctx, run, _labels_shifted_per_shard)
    if not ctx.reference:
        out["refused"] = raised(lambda: run(_not_resharded(T.Trainer)))
    return out


@scenario(world=2)
def rows_tokens_per_replica(ctx):
    """average_tokens_across_devices=False (the per-replica mean: exact at dp 1), all-gather;
    gradient clipping on."""
    args = ctx.args(dp=1, batch=2, gradient_accumulation_steps=2,
                    average_tokens_across_devices=False, max_grad_norm=0.5)
    return {"main": _train(ctx, "llama", args, rows(8), T.default_data_collator,
                           strategy="allgather")}


@scenario(world=2)
def checkpointing(ctx):
    """Gradient checkpointing: the backward recomputes the attention (its collectives too)."""
    return {"main": _train(ctx, "llama", ctx.args(dp=1, batch=2, gradient_checkpointing=True),
                           rows(4), T.default_data_collator)}


@scenario(world=2)
def mixed_precision(ctx):
    """bf16=True (autocast over fp32 weights): runs, close to one process at bf16 precision."""
    return {"main": _train(ctx, "llama", ctx.args(dp=1, batch=2, bf16=True), rows(4),
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
        out[name] = _train(ctx, kind, ctx.args(dp=1, batch=3), documents(9), collator,
                           strategy=strategy)
    if not ctx.reference:
        collator = T.DataCollatorWithFlattening()
        out["ablation"] = _loss_of(_train(ctx, "qwen3", ctx.args(dp=1, batch=3), documents(9),
                                          collator, base=_labels_shifted_per_shard(T.Trainer)))
    return out


@scenario(world=2)
def label_smoothing(ctx):
    run = _rows_run(ctx, "llama", 6, dp=1, batch=2, label_smoothing_factor=0.1)
    return _with_ablation(ctx, run, _labels_shifted_per_shard)


@scenario(world=2)
def moe(ctx):
    """Qwen3-MoE's load-balancing loss (router_aux_loss_coef 0.5) over the whole sequence."""
    return _with_ablation(ctx, _rows_run(ctx, "qwen3_moe", 6, dp=1, batch=2), _local_aux)


@scenario(world=2)
def evaluate_predict(ctx):
    """evaluate() and predict(): rows (ring) and packed documents (Ulysses)."""
    out = {"rows": _train(ctx, "llama", ctx.args(dp=1, batch=2, max_steps=1), rows(2),
                          T.default_data_collator, eval_data=rows(4, seed=1),
                          predict=rows(4, seed=2))}
    collator = T.DataCollatorWithFlattening()
    out["packed"] = _train(ctx, "llama", ctx.args(dp=1, batch=3, max_steps=1), documents(3),
                           collator, strategy="ulysses", eval_data=documents(6, seed=1),
                           predict=documents(3, seed=2))
    if not ctx.reference:
        out["ablation"] = _train(ctx, "llama", ctx.args(dp=1, batch=2, max_steps=1), rows(2),
                                 T.default_data_collator, predict=rows(4, seed=2),
                                 base=_local_order(T.Trainer))
    return out


@scenario(world=2)
def resume(ctx):
    """A checkpoint at step 2 of 4, then training resumed from it: the same as uninterrupted;
    the checkpoint is written once and loads without cpattn."""
    def args(**kw):
        return ctx.args(dp=1, batch=2, save_strategy="steps", save_steps=2, **kw)
    data = rows(8)
    first = args()
    whole = _train(ctx, "llama", first, data, T.default_data_collator)
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


def _sft_documents(n: int, seed: int = 0) -> list[dict]:
    return [{"input_ids": d["input_ids"]} for d in documents(n, seed)]


@scenario(world=2)
def sft_packing(ctx):
    """SFTTrainer packing=True (best-fit packing, padding-free batches with seq_idx), tiny Qwen3,
    with evaluation on packed documents."""
    from datasets import Dataset
    from trl import SFTTrainer

    def run(base):
        args = ctx.args(dp=1, batch=2, sft=True, packing=True, max_length=40, eval_packing=True)
        trainer, capture = ctx.trainer(
            "qwen3", args, sft=True, base=base, processing_class=tokenizer(),
            train_dataset=Dataset.from_list(_sft_documents(24)),
            eval_dataset=Dataset.from_list(_sft_documents(8, seed=1)))
        trainer.train()
        evaluated = trainer.evaluate()["eval_loss"]
        return {**results(trainer, capture), "eval": evaluated,
                "eval_every_rank": every_rank(evaluated)}

    return _with_ablation(ctx, run, _count_not_divided, SFTTrainer)


def _completions(n: int, seed: int = 0) -> list[dict]:
    """Pre-tokenized prompt-completion examples: a completion_mask marks the completion."""
    out = []
    g = torch.Generator().manual_seed(30_000 + seed)
    for i in range(n):
        prompt, completion = torch.randint(3, 12, (2,), generator=g).tolist()
        ids = _ids(prompt + completion, 3000 * seed + i)
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * completion})
    return out


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
                                       train_dataset=Dataset.from_list(_completions(9)))
        trainer.train()
        return results(trainer, capture)

    return _with_ablation(ctx, run, _labels_shifted_per_shard, SFTTrainer)


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
            train_dataset=Dataset.from_list(_sft_documents(4)), processing_class=tokenizer())

    return {
        "sdpa": raised(lambda: build(attn="sdpa")),
        "accelerate_cp": raised(lambda: build(parallelism_config=ParallelismConfig(cp_size=2))),
        "batch_rebalance": raised(lambda: build(train_sampling_strategy="batch_rebalance")),
        "iterable": raised(lambda: build(train_dataset=Stream(), max_steps=2)),
        "eval_not_resharded": raised(lambda: build().evaluate(eval_dataset=Stream())),
        "sft_label_smoothing": raised(sft_smoothing),
    }


@scenario(world=4)
def dp_accumulation(ctx):
    """dp 2 x cp 2, GA 2, shuffled rows with different target counts per replica."""
    run = _rows_run(ctx, "llama", 16, dp=2, batch=1, gradient_accumulation_steps=2)
    return _with_ablation(ctx, run, _count_not_divided)


def _one_rank_astray(base):
    """Rank 3 reads replica 0's batches: only the second CP group's batches differ."""
    from accelerate.data_loader import BatchSamplerShard

    from cpattn.integrations.trainer import with_context_parallel

    class Astray(with_context_parallel(base)):
        def _get_dataloader(self, *args, **kwargs):
            loader = super()._get_dataloader(*args, **kwargs)
            assert isinstance(loader.batch_sampler, BatchSamplerShard)
            if dist.get_rank() == 3:
                loader.batch_sampler.process_index = 0
            return loader

    return Astray


@scenario(world=4)
def dp_one_group_astray(ctx):
    """Different batches in one CP group only: every rank raises (none waits in the gradient
    all-reduce)."""
    if ctx.reference:
        return {}
    return {"refused": raised(lambda: _train(ctx, "llama", ctx.args(dp=2, batch=1), rows(8),
                                             T.default_data_collator,
                                             base=_one_rank_astray(T.Trainer)))}


@scenario(world=4)
def dp_tokens_per_replica(ctx):
    """average_tokens_across_devices=False at dp 2 x cp 2: the per-replica mean, the same as one
    process when the replicas hold equal numbers of targets."""
    args = ctx.args(dp=2, batch=1, gradient_accumulation_steps=2,
                    average_tokens_across_devices=False)
    return {"main": _train(ctx, "llama", args, rows(8, ignored=False), T.default_data_collator,
                           strategy="ulysses")}


@scenario(world=4)
def dp_evaluate(ctx):
    """evaluate() and predict() at dp 2 x cp 2: one copy of each prediction per CP group."""
    return {"main": _train(ctx, "llama", ctx.args(dp=2, batch=2, max_steps=1), rows(4),
                           T.default_data_collator, eval_data=rows(8, seed=1),
                           predict=rows(8, seed=2))}


@scenario(world=4)
def dp_sft_packing(ctx):
    """SFTTrainer packing at dp 2 x cp 2 (TRL's token counter over the replicas)."""
    from datasets import Dataset

    args = ctx.args(dp=2, batch=1, sft=True, packing=True, max_length=40)
    trainer, capture = ctx.trainer("qwen3", args, sft=True, processing_class=tokenizer(),
                                   train_dataset=Dataset.from_list(_sft_documents(24)))
    trainer.train()
    return {"main": results(trainer, capture)}


@scenario(world=4)
def hybrid(ctx):
    """Hybrid (ring 2 x Ulysses 2, cp 4): rows, and packed documents with evaluate / predict."""
    out = {"rows": _train(ctx, "llama", ctx.args(dp=1, batch=2), rows(4),
                          T.default_data_collator, strategy="hybrid", cp_size=4,
                          ulysses_size=2),
           "packed": _train(ctx, "llama", ctx.args(dp=1, batch=3), documents(6),
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
