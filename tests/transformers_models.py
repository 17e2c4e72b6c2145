"""Tiny random-init transformers models and the single-process reference training step, shared by
tests/test_transformers*.py (and small enough for 1-thread ranks on a 2-core CI machine)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import cpattn

SEQLEN = 48  # a multiple of 2W for W = 1, 2, 3, 4 and of the hybrid 2x2 granularity (8)
BATCH = 2


KINDS = ("llama", "mistral", "gpt_oss", "gemma2")


def tiny_config(kind: str = "llama", **overrides):
    """kind "llama" (GQA 4 / 2 heads), "mistral" (the same with a 7-token sliding window),
    "gpt_oss" (learnable attention sinks, sliding (7) and full layers alternating, 2 of 4
    experts) or "gemma2" (attention logit softcap 2.0, sliding (7) and full layers alternating).
    The options are chosen so that each one changes the loss (the tests check it)."""
    from transformers import Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig

    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, attention_dropout=0.0, tie_word_embeddings=False)
    if kind == "mistral":
        return MistralConfig(**{"sliding_window": 7, **common, **overrides})
    if kind == "gpt_oss":
        return GptOssConfig(**{**common, "head_dim": 8, "sliding_window": 7,
                               "num_local_experts": 4, "num_experts_per_tok": 2,
                               "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                               **overrides})
    if kind == "gemma2":
        return Gemma2Config(**{**common, "head_dim": 8, "query_pre_attn_scalar": 8,
                               "sliding_window": 7, "attn_logit_softcapping": 2.0,
                               "initializer_range": 0.05,
                               "final_logit_softcapping": None, **overrides})
    return LlamaConfig(**{**common, **overrides})


def tiny_model(config, attn_implementation: str, seed: int = 0, weight_scale: float = 4.0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                             dtype=torch.float32)
    # Scaled-up weights: logits with a real spread, so the comparison is not of near-constants.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(weight_scale)
            elif name.endswith("sinks"):  # sink logits of the scores' size, so that they matter
                p.normal_(0.0, 2.0)
    return model


def tiny_batch(config, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (BATCH, SEQLEN), generator=g)
    labels = ids.clone()
    labels[0, 5] = -100  # an ignored target: the mean must count only real ones
    return {"input_ids": ids, "labels": labels}


def reference_step(config, batch: dict) -> tuple[float, dict]:
    """Loss and gradients of one single-process step (float32; SDPA, or transformers' eager
    attention for the models whose options SDPA lacks: sinks, softcap)."""
    model = tiny_model(config, "eager" if config.model_type in ("gpt_oss", "gemma2") else "sdpa")
    out = model(input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def cp_model(config, cp: "cpattn.ContextParallel", name: str, compile_model=None):
    """(model, forward): the tiny model with cpattn registered as `name`; forward is the model,
    or torch.compile(model, fullgraph=True, backend=compile_model)."""
    from cpattn.integrations.transformers import register

    model = tiny_model(config, register(cp, name))
    forward = (torch.compile(model, fullgraph=True, backend=compile_model) if compile_model
               else model)
    return model, forward


def cp_run(model, forward, batch: dict, cp: "cpattn.ContextParallel", loss_group=None):
    """Loss and gradients (averaged over the loss group, as DDP would) of one step under CP."""
    model.zero_grad()
    local = cpattn.shard_batch(batch, cp)
    labels = local.pop("shift_labels")  # the README's recipe
    logits = forward(**local, use_cache=False).logits
    group = loss_group if loss_group is not None else cp.group
    loss = cpattn.cross_entropy(logits, labels, cp, group=group)
    loss.backward()
    world = dist.get_world_size(group)
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads[n] = g / world
    return loss.item(), grads


def cp_step(config, batch: dict, cp: "cpattn.ContextParallel", name: str, compile_model=None,
            loss_group=None):
    """Loss and gradients of one step of a fresh model under CP (see cp_run)."""
    model, forward = cp_model(config, cp, name, compile_model)
    return cp_run(model, forward, batch, cp, loss_group)


def assert_step_matches(ref: tuple[float, dict], got: tuple[float, dict], what: str,
                        loss_rtol: float = 1e-5, grad_rtol: float = 1e-4) -> None:
    """Loss within loss_rtol (relative); each gradient within grad_rtol of its largest entry."""
    ref_loss, ref_grads = ref
    loss, grads = got
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), f"{what}: loss {loss} vs {ref_loss}"
    for n, g_ref in ref_grads.items():
        scale = g_ref.abs().max().item()
        assert scale > 0, f"{what}: reference gradient of {n} is zero: the test cannot fail"
        err = (grads[n] - g_ref).abs().max().item()
        assert err <= grad_rtol * scale, f"{what}: grad {n} off by {err} (max {scale})"
