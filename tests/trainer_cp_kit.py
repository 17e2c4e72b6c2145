"""The toolkit of the trainer scenarios (tests/trainer_cp_worker.py, trainer_cp_exact.py and
trainer_cp_hybrid.py): tiny models and data, the trainer of a run (one process with SDPA, or
context parallel), what a run records, the scenario registry.

Batches: the reference's per-device batch is dp x the context-parallel run's, with the same
gradient accumulation, sampler and seed, so that each optimizer step covers the same samples.
AdamW's epsilon is 1e-5: with a smaller one, gradient entries near 0 (fp32 rounding noise of
1e-7 relative) become updates of about the learning rate that differ between the runs.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import transformers as T
from transformers import TrainerCallback

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, use_cache=False)


HYBRIDS = ("qwen3_5", "bamba")  # gated delta rule, Mamba-2: tests/hybrid_models.py's configs


def config(kind: str, **overrides):
    if kind in HYBRIDS:
        import hybrid_models

        return hybrid_models.config(kind, **overrides)
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
    """n rows of seqlen tokens; with `ignored`, row i has (7 * i) % min(23, seqlen) leading -100
    targets (rows with different numbers of targets)."""
    out = []
    for i in range(n):
        ids = _ids(seqlen, 1000 * seed + i)
        labels = list(ids)
        if ignored:
            ignore = (7 * i) % min(23, seqlen)
            labels[:ignore] = [-100] * ignore
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
                base=None, ulysses_size=None, model_overrides=None, attach="trainer", **kw):
        """(trainer, capture) for this run: `base` (Trainer or SFTTrainer; with context
        parallelism its ContextParallel class, or `base` itself when it already is one).
        attach: how cp reaches the model under context parallelism: "trainer" (an SDPA model,
        parallelized by the trainer), "register" (loaded with attn_implementation=register(cp),
        the older way) or "parallelize" (parallelize(model, cp) before the trainer)."""
        from trl import SFTTrainer

        base = base or (SFTTrainer if sft else T.Trainer)
        capture = Capture()
        if self.reference:
            m = model(kind, "sdpa", **(model_overrides or {}))
            return base(model=m, args=args, callbacks=[capture], **kw), capture
        from cpattn.integrations.trainer import with_context_parallel
        from cpattn.integrations.transformers import parallelize, register

        cp = self.cp(strategy, cp_size, ulysses_size)
        attn = register(cp, f"cpattn_{strategy}") if attach == "register" else "sdpa"
        m = model(kind, attn, **(model_overrides or {}))
        if attach == "parallelize":
            parallelize(m, cp)
        trainer = with_context_parallel(base)(cp, model=m, args=args, callbacks=[capture], **kw)
        assert trainer.model is m and trainer.cp_handle.cp is cp, "cp not attached to the model"
        return trainer, capture


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


# ---- scenarios -----------------------------------------------------------------------------------
# Each: scenario(ctx) -> {run name: results}; runs whose name starts with "ablation" only run
# under context parallelism.

SCENARIOS = {}


def scenario(world: int):
    def register(fn):
        SCENARIOS[fn.__name__] = (world, fn)
        return fn
    return register


def train_run(ctx, kind, args, data, collator=None, base=None, strategy="ring", cp_size=2,
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


def loss_of(run: dict) -> dict:
    return {"loss": run["loss"]}


def with_ablation(ctx, run, mistake, base=None) -> dict:
    """{"main": run(base)} and, with context parallelism, "ablation": the loss of
    run(mistake(base)), the trainer class with a mistake that must change it."""
    base = base or T.Trainer
    out = {"main": run(base)}
    if not ctx.reference:
        out["ablation"] = loss_of(run(mistake(base)))
    return out


def rows_run(ctx, kind: str, n: int, attach: str = "trainer", **args):
    """run(base) for with_ablation: `kind` trained on rows(n) with ctx.args(**args)."""
    def run(base):
        return train_run(ctx, kind, ctx.args(**args), rows(n), T.default_data_collator, base=base,
                         attach=attach)
    return run


def sft_documents(n: int, seed: int = 0) -> list[dict]:
    return [{"input_ids": d["input_ids"]} for d in documents(n, seed)]


def completions(n: int, seed: int = 0) -> list[dict]:
    """Pre-tokenized prompt-completion examples: a completion_mask marks the completion."""
    out = []
    g = torch.Generator().manual_seed(30_000 + seed)
    for i in range(n):
        prompt, completion = torch.randint(3, 12, (2,), generator=g).tolist()
        ids = _ids(prompt + completion, 3000 * seed + i)
        out.append({"input_ids": ids, "completion_mask": [0] * prompt + [1] * completion})
    return out


