"""Tiny hybrid transformers models (token mixers outside attention) and their one-process
reference step, shared by tests/test_transformers_hybrid*.py and bench/bench_mixers.py.

Every family cpattn makes exact: a config small enough for 1-thread ranks on 2 cores, one mixer
layer and (where the family has one) one attention layer, built with from_config."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import cpattn

from transformers_models import tiny_model

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              use_cache=False)
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8,
              mamba_chunk_size=16)
DELTA = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=8)
HYBRID = ["linear_attention", "full_attention"]

# family -> (model type, the math of its mixer)
FAMILIES = {
    "lfm2": "short convolution", "lfm2_moe": "short convolution",
    "mamba2": "Mamba-2", "bamba": "Mamba-2", "granitemoehybrid": "Mamba-2",
    "nemotron_h": "Mamba-2", "falcon_h1": "Mamba-2", "zamba2": "Mamba-2",
    "qwen3_next": "gated delta rule", "qwen3_5": "gated delta rule",
    "qwen3_5_moe": "gated delta rule", "olmo_hybrid": "gated delta rule",
    "mamba": "Mamba", "falcon_mamba": "Mamba", "jamba": "Mamba",
    "kimi_linear": "Kimi delta attention", "minimax": "lightning attention",
}


def config(kind: str, all_experts: bool = False, **overrides):
    """The tiny config of a family (keywords override its fields); all_experts: a mixture of
    experts routes every token to all 4 experts (no top-k choice, which rounding can flip)."""
    import transformers as T

    c = {**COMMON}
    # (top-2 of 4 by default: the routers' gradients are not 0)
    moe = dict(num_experts_per_tok=4 if all_experts else 2)
    if kind == "lfm2":
        return T.Lfm2Config(**c, layer_types=["conv", "full_attention"], **overrides)
    if kind == "lfm2_moe":
        return T.Lfm2MoeConfig(**c, layer_types=["conv", "full_attention"], num_experts=4,
                               moe_intermediate_size=16, num_dense_layers=1, **moe, **overrides)
    if kind == "mamba2":
        return T.Mamba2Config(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_heads=8,
                              head_dim=8, state_size=8, n_groups=2, chunk_size=16, expand=2,
                              tie_word_embeddings=False, use_cache=False, **overrides)
    if kind == "bamba":
        return T.BambaConfig(**c, attn_layer_indices=[1], mamba_expand=2, **MAMBA2, **overrides)
    if kind == "granitemoehybrid":
        return T.GraniteMoeHybridConfig(**c, layer_types=["mamba", "attention"],
                                        num_local_experts=4, **moe, **MAMBA2, **overrides)
    if kind == "nemotron_h":
        return T.NemotronHConfig(**{**c, "num_hidden_layers": 3},
                                 layers_block_type=["mamba", "attention", "mlp"],
                                 mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
                                 ssm_state_size=8, chunk_size=16, head_dim=8, **overrides)
    if kind == "falcon_h1":
        return T.FalconH1Config(**c, mamba_d_ssm=64, head_dim=8, **MAMBA2, **overrides)
    if kind == "zamba2":
        return T.Zamba2Config(**c, layers_block_type=["mamba", "hybrid"], mamba_headdim=8,
                              n_mamba_heads=8, mamba_d_state=8, mamba_ngroups=2, chunk_size=16,
                              attention_head_dim=8, num_mem_blocks=1, **overrides)
    if kind == "qwen3_next":
        return T.Qwen3NextConfig(**c, layer_types=HYBRID, head_dim=8, num_experts=4,
                                 moe_intermediate_size=16, shared_expert_intermediate_size=16,
                                 **moe, **DELTA, **overrides)
    if kind == "qwen3_5":
        return T.Qwen3_5TextConfig(**c, layer_types=HYBRID, head_dim=8, **DELTA, **overrides)
    if kind == "qwen3_5_moe":
        return T.Qwen3_5MoeTextConfig(**c, layer_types=HYBRID, head_dim=8, num_experts=4,
                                      moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, **moe, **DELTA,
                                      **overrides)
    if kind == "olmo_hybrid":
        return T.OlmoHybridConfig(**c, layer_types=HYBRID, linear_allow_neg_eigval=True,
                                  **DELTA, **overrides)
    if kind == "mamba":
        return T.MambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8,
                             expand=2, tie_word_embeddings=False, use_cache=False, **overrides)
    if kind == "falcon_mamba":
        return T.FalconMambaConfig(vocab_size=96, hidden_size=32, num_hidden_layers=2,
                                   state_size=8, expand=2, tie_word_embeddings=False,
                                   use_cache=False, **overrides)
    if kind == "jamba":
        return T.JambaConfig(**c, attn_layer_period=2, attn_layer_offset=1,
                             expert_layer_period=2, expert_layer_offset=1, num_experts=4,
                             mamba_d_state=8, mamba_expand=2, mamba_dt_rank=4, **moe,
                             **overrides)
    if kind == "kimi_linear":
        return T.KimiLinearConfig(**{**c, "num_key_value_heads": 4}, layer_types=HYBRID,
                                  linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=4,
                                  num_local_experts=4,
                                  num_experts_per_token=moe["num_experts_per_tok"],
                                  moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=None,
                                  qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                  **overrides)
    if kind == "minimax":
        return T.MiniMaxConfig(**c, head_dim=8, num_local_experts=4, layer_types=HYBRID,
                               block_size=16, **moe, **overrides)
    raise AssertionError(kind)


def model(cfg, implementation: str):
    """The tiny model, fixed seed, weights x3 (logits with a real spread), eval mode."""
    return tiny_model(cfg, implementation, weight_scale=3.0).eval()


def sequences(rows: int = 2, seqlen: int = 48, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 96, (rows, seqlen), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def packed(lengths, flash: bool = False) -> dict:
    """transformers' DataCollatorWithFlattening over documents of these lengths (position ids
    that restart, or with flash=True its cu_seq_lens form too)."""
    from transformers import DataCollatorWithFlattening

    def ids(n, seed):
        return torch.randint(5, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
    return collator([{"input_ids": ids(n, i)} for i, n in enumerate(lengths)])


def _loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             labels[:, 1:].flatten())


def _autocast(enabled: bool):
    return torch.autocast("cpu", torch.bfloat16, enabled=enabled)


def reference(cfg, batch: dict, lengths=None, *, dtype=torch.float32,
              autocast: bool = False) -> tuple[float, dict]:
    """One process (eager attention, the mixers' own forwards): loss and gradients. lengths:
    packed documents, one forward per document (transformers' own CPU mixers let packed
    documents leak into each other's state); a batch with an attention_mask: each row's real
    tokens alone (at their positions in the row). dtype: the model's (torch.float64: the
    truth); autocast: under torch.autocast("cpu", torch.bfloat16)."""
    m = model(cfg, "eager").to(dtype)
    if dtype == torch.float64 and getattr(m.config, "_experts_implementation", None) not in (
            None, "eager"):
        m.set_experts_implementation("eager")  # (grouped_mm has no float64)
    with _autocast(autocast):
        return _reference_step(m, batch, lengths)


def _reference_step(m, batch: dict, lengths) -> tuple[float, dict]:
    if "attention_mask" in batch:  # padded rows: each row's real tokens alone
        losses, count = [], 0
        for ids, mask, labels in zip(batch["input_ids"], batch["attention_mask"],
                                     batch["labels"]):
            real = mask.nonzero().flatten()
            logits = m(input_ids=ids[real][None], position_ids=real[None], use_cache=False).logits
            losses.append(torch.nn.functional.cross_entropy(
                logits[0, :-1], labels[real][1:], reduction="sum"))
            count += int((labels[real][1:] != -100).sum())
        loss = sum(losses) / count
    elif lengths is None:
        logits = m(input_ids=batch["input_ids"], use_cache=False).logits
    else:
        logits = torch.cat([m(input_ids=part, use_cache=False).logits
                            for part in batch["input_ids"].split(list(lengths), dim=1)], 1)
    if "attention_mask" not in batch:
        loss = _loss(logits, batch["labels"])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()
                         if p.grad is not None}


def cp_model(cfg, cp: "cpattn.ContextParallel", prepare=None):
    """The tiny model, parallelized for cp (then prepare(model), if given)."""
    from cpattn.integrations.transformers import parallelize

    m = model(cfg, "eager")
    parallelize(m, cp)
    if prepare is not None:
        prepare(m)
    return m


def cp_step(cfg, batch: dict, cp: "cpattn.ContextParallel", compile_backend=None,
            prepare=None, m=None, autocast: bool = False, **shard) -> tuple[float, dict]:
    """One step under cp: shard_batch, the whole local batch to the model, cpattn's loss,
    gradients averaged over the ranks (as DDP would). m: a parallelized model to step (its
    gradients are cleared first), else a fresh one (cp_model(cfg, cp, prepare)); autocast:
    under torch.autocast("cpu", torch.bfloat16)."""
    m = cp_model(cfg, cp, prepare) if m is None else m
    m.zero_grad()
    forward = torch.compile(m, fullgraph=True, backend=compile_backend) if compile_backend \
        else m
    local = cpattn.shard_batch(batch, cp, **shard)
    with _autocast(autocast):
        out = forward(**{k: v for k, v in local.items() if k != "shift_labels"})
        loss = cpattn.cross_entropy(out.logits, local["shift_labels"], cp)
    loss.backward()
    grads = {}
    for n, p in m.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[n] = g / dist.get_world_size()
    return loss.item(), grads


CHECKPOINTING = ("reentrant", "non-reentrant", "plain")


class Checkpointed(torch.nn.Module):
    """A decoder layer under a plain torch.utils.checkpoint (non-reentrant), as a user wraps
    one; its parameters' names gain ".checkpointed" (see `unwrapped`)."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.checkpointed = layer

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.checkpointed, *args, use_reentrant=False, **kwargs)


def checkpointing(mode: str):
    """prepare(model) for cp_model / cp_step: training mode with the decoder layers checkpointed,
    by transformers' gradient_checkpointing_enable ("reentrant", "non-reentrant") or each in a
    plain torch.utils.checkpoint ("plain")."""
    def prepare(m):
        m.train()
        if mode == "plain":
            layers = m.base_model.layers
            for i, layer in enumerate(layers):
                layers[i] = Checkpointed(layer)
        else:
            m.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": mode == "reentrant"})
    return prepare


def unwrapped(step: tuple[float, dict]) -> tuple[float, dict]:
    """A step's gradients by the parameter names of the model without Checkpointed layers."""
    loss, grads = step
    return loss, {n.replace(".checkpointed.", "."): g for n, g in grads.items()}


@contextlib.contextmanager
def mixers_alone():
    """The ablation: every mixer on its rank's pieces only (no halo, no entry state received)."""
    from cpattn.integrations.hybrid import forward

    real = forward.exchange_of

    def alone(cp):
        return lambda x: torch.zeros((cp.world_size, *x.shape), dtype=x.dtype, device=x.device)

    forward.exchange_of = alone
    try:
        yield
    finally:
        forward.exchange_of = real


# Gradients under 1% of the model's largest one are compared against 1% of it: such small
# gradients are sums of cancelling terms whose fp32 rounding alone exceeds 1e-4 of their own
# size (Qwen3.5's dt_bias: the fp32 one-process step is 2.5e-4 off its float64 value).
FLOOR = 1e-2


def assert_step_matches(ref, got, what: str, loss_rtol: float = 1e-5,
                        grad_rtol: float = 1e-4) -> None:
    ref_loss, ref_grads = ref
    loss, grads = got
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), f"{what}: loss {loss} vs {ref_loss}"
    largest = max(g.abs().max().item() for g in ref_grads.values())
    assert set(grads) >= set(ref_grads), f"{what}: gradients missing"
    for n, g_ref in ref_grads.items():
        scale = max(g_ref.abs().max().item(), FLOOR * largest)
        err = (grads[n] - g_ref).abs().max().item()
        assert err <= grad_rtol * scale, f"{what}: grad {n} off by {err:.3g} (scale {scale:.3g})"


def assert_differs(ref, got, what: str) -> None:
    """The ablation changes the result: the test can fail."""
    ref_loss, ref_grads = ref
    loss, grads = got
    moved = abs(loss - ref_loss) > 1e-3 * abs(ref_loss) or any(
        (grads[n] - g).abs().max() > 1e-2 * g.abs().max() for n, g in ref_grads.items())
    assert moved, f"{what}: the mixers alone give the reference: the test cannot fail"


def distances(step, truth) -> dict:
    """Relative distances of a step from the float64 truth: "loss", and each parameter's
    gradient ||g - g_truth|| / ||g_truth|| (Frobenius), a gradient under FLOOR of the largest
    one's norm relative to that (as assert_step_matches: such gradients are sums of cancelling
    terms, whose rounding is that of the terms, not of the sum)."""
    loss, grads = step
    truth_loss, truth_grads = truth
    out = {"loss": abs(loss - truth_loss) / abs(truth_loss)}
    largest = max(float(g.norm()) for g in truth_grads.values())
    for n, g in truth_grads.items():
        out[n] = float((grads[n].double() - g).norm()) / max(float(g.norm()), FLOOR * largest)
    return out


def assert_near_truth(one, got, truth, what: str, factor: float, floor: float) -> None:
    """Under CP (got) every distance from the truth (distances: the loss and each parameter's
    gradient) is at most `factor` times one process's own (one) for it, or for one process's
    median parameter (a parameter of a few entries can be lucky in one process: bf16 noise on 8
    numbers), or `floor`."""
    ref, mine = distances(one, truth), distances(got, truth)
    typical = sorted(ref.values())[len(ref) // 2]
    worst = [(n, mine[n], ref[n]) for n in ref
             if mine[n] > max(factor * max(ref[n], typical), floor)]
    assert not worst, (f"{what}: farther from the float64 truth than {factor}x one process "
                       f"(or {floor:g}): " + ", ".join(f"{n} {d:.3g} vs {r:.3g}"
                                                       for n, d, r in worst[:6]))
