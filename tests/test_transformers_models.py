"""Real transformers model code under context parallelism: every case matches one process (fp32:
loss 1e-5, gradients 1e-4) or raises on every rank, promptly.

Exact: packed documents from DataCollatorWithFlattening (position ids that restart, and its
cu_seq_lens form) and a padded batch (unpadded into documents), with ring, all-gather and
Ulysses; families beyond the ones of test_transformers (Qwen3, Gemma 3, Cohere2, DeepSeek-V3's
MLA, Llama 4 with chunks longer than the sequence), encoders (BERT, ModernBERT's bidirectional
local window), Qwen3-MoE's load-balancing loss over the whole sequence. Each exact case has an
ablation showing that its feature changes the one-process result (so the test can fail).
Refused on every rank: token mixers outside attention that cpattn does not make exact
(RecurrentGemma's RG-LRU; the exact ones: tests/test_transformers_hybrid.py), a sparse-attention
indexer (DeepSeek-V3.2), Llama 4's chunks shorter than the sequence with the ring (Ulysses
applies them exactly), its temperature tuning past floor_scale, and its attention without
position ids; and the one-rank-only triggers (a padding mask whose zeros lie in one shard, a
document boundary in one shard, local positions that are global on rank 0 only) raise on every
rank within a second."""


import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import transformers as T  # noqa: E402

import cpattn  # noqa: E402
from cpattn.integrations.transformers import register  # noqa: E402

from distributed import run_ranks  # noqa: E402
from failure_cases import raises_same_everywhere  # noqa: E402
from transformers_models import assert_step_matches  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, use_cache=False)


def model_config(kind: str, **overrides):
    if kind == "llama":
        return T.LlamaConfig(**{**COMMON, **overrides})
    if kind == "qwen3":
        return T.Qwen3Config(**{**COMMON, "head_dim": 8, **overrides})
    if kind == "gemma3":
        return T.Gemma3TextConfig(**{**COMMON, "head_dim": 8, "query_pre_attn_scalar": 8,
                                     "sliding_window": 5, "layer_types": ["sliding_attention",
                                                                          "full_attention"],
                                     "initializer_range": 0.05, **overrides})
    if kind == "cohere2":
        return T.Cohere2Config(**{**COMMON, "sliding_window": 5, "logit_scale": 1.0,
                                  "layer_types": ["sliding_attention", "full_attention"],
                                  **overrides})
    if kind == "deepseek_v3":
        return T.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4, "kv_lora_rank": 16,
                                     "q_lora_rank": 16, "qk_rope_head_dim": 8,
                                     "qk_nope_head_dim": 8, "v_head_dim": 8,
                                     "first_k_dense_replace": 2, "n_routed_experts": 4,
                                     "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                     "n_group": 1, "topk_group": 1, **overrides})
    if kind == "gpt_oss":
        return T.GptOssConfig(**{**COMMON, "head_dim": 8, "sliding_window": 5,
                                 "initializer_range": 0.1,
                                 "num_local_experts": 4, "num_experts_per_tok": 2,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 1e4},
                                 **overrides})
    if kind == "qwen3_moe":
        return T.Qwen3MoeConfig(**{**COMMON, "head_dim": 8, "num_experts": 4,
                                   "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                   "decoder_sparse_step": 1, **overrides})
    if kind == "llama4":  # layer 0: RoPE and chunked attention; layer 1: NoPE, full attention
        return T.Llama4TextConfig(**{**COMMON, "head_dim": 8, "intermediate_size_mlp": 64,
                                     "num_local_experts": 2, "no_rope_layers": [1, 0],
                                     "attention_chunk_size": 64, "initializer_range": 0.1,
                                     **overrides})
    if kind == "bert":
        return T.BertConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4,
                            attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0,
                            max_position_embeddings=256, **overrides)
    if kind == "modernbert":
        return T.ModernBertConfig(**{"vocab_size": 96, "hidden_size": 32,
                                     "intermediate_size": 64, "num_hidden_layers": 2,
                                     "num_attention_heads": 4, "pad_token_id": 0,
                                     "eos_token_id": 1, "bos_token_id": 2, "cls_token_id": 3,
                                     "sep_token_id": 4, "local_attention": 6,
                                     "global_attn_every_n_layers": 2, "attention_dropout": 0.0,
                                     "embedding_dropout": 0.0, "mlp_dropout": 0.0,
                                     "initializer_range": 0.1,
                                     **overrides})
    raise AssertionError(kind)


ENCODERS = ("bert", "modernbert")


def _model(config, implementation: str):
    torch.manual_seed(0)
    auto = T.AutoModelForMaskedLM if config.model_type in ENCODERS else T.AutoModelForCausalLM
    model = auto.from_config(config, attn_implementation=implementation, dtype=torch.float32)
    with torch.no_grad():  # logits with a real spread
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.eval()  # (no dropout anywhere; the reference and the ranks run the same graph)
    return model


def _shifted_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                             labels[:, 1:].flatten())


def reference(config, batch: dict, aux=None, lengths=None) -> tuple[float, dict]:
    """One process: the loss over the shifted labels (+ the load-balancing loss), gradients.
    lengths: packed documents, each run as a sequence of its own (the definition: transformers'
    own packed mask is not trusted here, its eager gpt-oss lets documents see each other)."""
    implementation = "eager" if config.model_type in ("gpt_oss",) else "sdpa"
    model = _model(config, implementation)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    extra = {"output_router_logits": True} if aux else {}
    if lengths is None:
        out = model(**inputs, **extra)
        logits, router = out.logits, getattr(out, "router_logits", None)
    else:
        parts = [model(input_ids=part, **extra)
                 for part in batch["input_ids"].split(list(lengths), dim=1)]
        logits = torch.cat([p.logits for p in parts], dim=1)
        router = aux and tuple(torch.cat(layer) for layer in zip(*(p.router_logits
                                                                    for p in parts)))
    loss = _shifted_loss(logits, batch["labels"])
    if aux:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        loss = loss + aux * load_balancing_loss_func(router, config.num_experts,
                                                     config.num_experts_per_tok)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                         if p.grad is not None and not n.endswith(_ZERO_GRADIENT)}


# A key bias adds the same amount to every score of a row: its exact gradient is 0, and what
# either side computes for it is rounding noise.
_ZERO_GRADIENT = ("attention.self.key.bias",)


def cp_step(config, batch: dict, cp, aux=None, compile_backend=None,
            check=None, **shard) -> tuple[float, dict]:
    """Loss and gradients (averaged over cp's group) of one step under CP; the model compiled
    (fullgraph) with compile_backend. shard: shard_batch's keywords; check(local) sees the
    sharded batch."""
    model = _model(config, register(cp, f"cpattn_{cp.strategy}"))
    forward = (torch.compile(model, fullgraph=True, backend=compile_backend) if compile_backend
               else model)
    local = cpattn.shard_batch(batch, cp, **shard)
    if check is not None:
        check(local)
    labels = local.pop("shift_labels")  # the README's recipe
    out = forward(**local, **({"output_router_logits": True} if aux else {}))
    loss = cpattn.cross_entropy(out.logits, labels, cp)
    if aux:
        loss = loss + aux * cpattn.load_balancing_loss(
            out.router_logits, cp, config.num_experts, config.num_experts_per_tok,
            documents=local["cpattn_documents"])
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=cp.group)
        grads[n] = g / cp.world_size
    return loss.item(), grads


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 96, (n,), generator=g).tolist()


def packed(lengths, flash: bool = False) -> dict:
    collator = T.DataCollatorWithFlattening(return_flash_attn_kwargs=flash)
    return collator([{"input_ids": _ids(n, i)} for i, n in enumerate(lengths)])


def _sequences(rows: int = 2, seqlen: int = 24, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 96, (rows, seqlen), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _exact(what, config, batch, cp, ablation=None, aux=None, lengths=None):
    ref = reference(config, batch, aux, lengths)
    if ablation is not None:
        off_config, off_batch, *off_aux = ablation
        off = reference(off_config, off_batch, off_aux[0] if off_aux else aux)
        assert abs(off[0] - ref[0]) > 1e-3, f"{what}: the ablation does not change the loss"
    assert_step_matches(ref, cp_step(config, batch, cp, aux), what)


LENGTHS = [7, 13, 4, 9, 15]  # documents of the packed batches (48 tokens)


def _unpacked(batch: dict) -> dict:
    """The same tokens as one sequence: documents attending to each other."""
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}


def _packed_cases(cp):
    for kind in ("llama", "gpt_oss"):
        config = model_config(kind)
        batch = packed(LENGTHS)
        _exact(f"packed {kind} {cp.strategy}", config, batch, cp, (config, _unpacked(batch)),
               lengths=LENGTHS)
    config = model_config("llama")
    flash = packed(LENGTHS, flash=True)
    assert_step_matches(reference(config, flash, lengths=LENGTHS), cp_step(config, flash, cp),
                        f"packed (cu_seq_lens) llama {cp.strategy}")
    # A padded batch: each row's real tokens become a document; padding labels -100. Row 0 is
    # right-padded, row 1 left-padded (its first real token is predicted by padding: -100 too;
    # its positions count the padding, as transformers' default positions do).
    padded = _sequences()
    mask = torch.ones_like(padded["input_ids"])
    mask[0, -5:] = 0
    mask[1, :11] = 0
    padded["labels"] = padded["labels"].masked_fill(mask == 0, -100)
    padded["labels"][1, 11] = -100
    padded["attention_mask"] = mask
    _exact(f"padded llama {cp.strategy}", config, padded, cp,
           (config, {k: v for k, v in padded.items() if k != "attention_mask"}))


# Packed documents under a DocumentPlan (shard_batch's default for ring / allgather): at W = 2
# and 3 the 30-token document is split over every rank, short ones stay whole.
PLAN_LENGTHS = [30, 5, 4, 9]


def _plan_cases(cp):
    """shard_batch's plan path: the Documents carry a plan with split and whole documents, and
    one step equals one process running each document alone (Llama; gpt-oss, whose sliding
    and full layers alternate: the plan balances full causal attention, the sliding layers run
    on the same tokens; the collator's cu_seq_lens form); documents="per-document" (the
    opt-out) too; cp.unshard(documents=) gives back the packed tokens."""
    batch = packed(PLAN_LENGTHS)
    ref = {kind: reference(model_config(kind), batch, lengths=PLAN_LENGTHS)
           for kind in ("llama", "gpt_oss")}

    def planned(local):
        docs = local["cpattn_documents"]
        plan = docs.plan
        assert plan is not None, "shard_batch made no plan"
        whole = sum(len(w) for w in plan.whole)
        assert 0 in plan.split and whole > 0, plan.describe()  # split and whole documents
        assert len(set(plan.tokens)) > 1, plan.tokens  # (ranks hold different numbers)
        assert local["input_ids"].shape[1] == plan.tokens[cp.rank]
        ids = cp.unshard(local["input_ids"], documents=docs)
        assert torch.equal(ids, batch["input_ids"]), "unshard(documents=) lost tokens"

    for kind in ("llama", "gpt_oss"):
        assert_step_matches(ref[kind], cp_step(model_config(kind), batch, cp, check=planned),
                            f"plan {kind} {cp.strategy} W={cp.world_size}")
    flash = packed(PLAN_LENGTHS, flash=True)
    assert_step_matches(ref["llama"], cp_step(model_config("llama"), flash, cp, check=planned),
                        f"plan (cu_seq_lens) llama {cp.strategy} W={cp.world_size}")

    def per_document(local):
        assert local["cpattn_documents"].plan is None
        ids = cp.unshard(local["input_ids"], documents=local["cpattn_documents"])
        assert torch.equal(ids, batch["input_ids"])

    assert_step_matches(ref["llama"], cp_step(model_config("llama"), batch, cp,
                                              check=per_document, documents="per-document"),
                        f"per-document llama {cp.strategy} W={cp.world_size}")


def _plan_w3(rank, world):
    pair = dist.new_group([0, 1])  # every rank makes every group
    if rank < 2:
        for strategy in ("ring", "allgather"):
            _plan_cases(cpattn.ContextParallel(pair, strategy=strategy))
    _plan_cases(cpattn.ContextParallel(strategy="ring"))
    # documents="plan" needs the ring or the all-gather; "auto" shards per document for Ulysses.
    ulysses = cpattn.ContextParallel(strategy="ulysses", layout="contiguous")
    with pytest.raises(ValueError, match="documents='plan' needs strategy"):
        cpattn.shard_batch(packed(PLAN_LENGTHS), ulysses, documents="plan")
    assert cpattn.shard_batch(packed(PLAN_LENGTHS), ulysses)["cpattn_documents"].plan is None
    # The plan balances the mask it is given (the model's; default causal full attention).
    plan = cpattn.shard_batch(packed(PLAN_LENGTHS), cpattn.ContextParallel(), window=(4, -1),
                              split="all")["cpattn_documents"].plan
    assert (plan.causal, plan.window, len(plan.split)) == (True, (4, -1), len(PLAN_LENGTHS))
    # A plan's batch given to a model whose cpattn runs Ulysses: raised on every rank.
    local = cpattn.shard_batch(packed(PLAN_LENGTHS), cpattn.ContextParallel())
    model = _model(model_config("llama"), register(ulysses, "cpattn_plan_ulysses"))
    _raises_everywhere("sharded by a DocumentPlan run with strategies", model,
                       **{k: v for k, v in local.items() if k not in ("shift_labels", "labels")})


def test_packed_plan_w2_w3():
    """One spawn of 3 ranks: the plan path at W = 2 (ring, all-gather) and W = 3 (ring)."""
    run_ranks(3, _plan_w3)


def _family_cases(cp):
    for kind, ablation in (("qwen3", None), ("gemma3", {"sliding_window": 1000}),
                           ("cohere2", {"sliding_window": 1000}), ("deepseek_v3", None)):
        config = model_config(kind)
        off = None if ablation is None else (model_config(kind, **ablation), _sequences())
        _exact(f"{kind} {cp.strategy}", config, _sequences(), cp, off)
    for kind in ENCODERS:  # bidirectional; ModernBERT's local window (6) on global positions
        config = model_config(kind)
        off = None if kind == "bert" else (model_config(kind, local_attention=1000), _sequences())
        _exact(f"{kind} {cp.strategy}", config, _sequences(), cp, off)
    # Llama 4 with chunks longer than the sequence (exact: its chunked layer is causal then),
    # given the whole batch (its attention gets no position_ids). Ablation: chunks of 8.
    config = model_config("llama4")
    _exact(f"llama4 {cp.strategy}", config, _sequences(), cp,
           (model_config("llama4", attention_chunk_size=8), _sequences()))
    config = model_config("qwen3_moe")
    _exact(f"qwen3_moe load balancing {cp.strategy}", config, _sequences(), cp,
           (config, _sequences(), None), aux=0.5)  # (ablation: without the auxiliary loss)
    _exact(f"qwen3_moe packed load balancing {cp.strategy}", config, packed(LENGTHS), cp,
           aux=0.5, lengths=LENGTHS)


def _raises_everywhere(match: str, fn, *args, **kwargs) -> None:
    """fn raises ValueError matching `match` on this rank within a second, with the same text as
    on every other rank (every rank runs it: a rank that did not raise would leave the others
    waiting)."""
    raises_same_everywhere(match, fn, *args, **kwargs)


def _refusals(cp):
    name = register(cp, "cpattn_refusals")
    ids = _sequences()["input_ids"]
    local = cpattn.shard_batch({"input_ids": ids}, cp)
    refused = {
        # (LFM2, Mamba, the delta rules and lightning attention are exact now:
        # tests/test_transformers_hybrid.py; RecurrentGemma's RG-LRU is not)
        "recurrent_gemma": (T.RecurrentGemmaConfig(
            vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, lru_width=32,
            attention_window_size=16, block_types=["recurrent", "attention"]),
            r"\['linear_attention'\]"),
        "deepseek_v32": (T.DeepseekV32Config(vocab_size=96, hidden_size=32,
                                              intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=4,
                                              kv_lora_rank=16, q_lora_rank=16,
                                              qk_rope_head_dim=8, qk_nope_head_dim=8,
                                              v_head_dim=8, first_k_dense_replace=1,
                                              n_routed_experts=4, num_experts_per_tok=2,
                                              moe_intermediate_size=16, n_group=1,
                                              topk_group=1, index_n_heads=2,
                                              index_head_dim=16, index_topk=4), "indexer"),
        # Llama 4 given the whole batch: temperature tuning at floor_scale 16 < 48 tokens (it
        # changes the one-process loss: checked below)
        "llama4 temperature": (model_config("llama4", floor_scale=16), "temperature tuning"),
    }
    tuned = reference(model_config("llama4", floor_scale=16), _sequences())[0]
    assert abs(tuned - reference(model_config("llama4"), _sequences())[0]) > 1e-3
    whole = {k: v for k, v in local.items() if k != "shift_labels"}
    for kind, (config, match) in refused.items():
        try:
            model = T.AutoModelForCausalLM.from_config(config, attn_implementation=name)
        except Exception as e:  # noqa: BLE001 - a config this transformers cannot build
            pytest.fail(f"{kind}: the tiny config does not build: {e}")
        _raises_everywhere(match, model, **whole, use_cache=False)
    # Llama 4's attention gets no position_ids: without the whole batch it cannot be checked.
    model = _model(model_config("llama4"), name)
    _raises_everywhere("gets no position_ids", model, input_ids=local["input_ids"],
                       position_ids=local["position_ids"])
    # One-rank-only triggers, each raising on every rank within a second.
    model = _model(model_config("llama"), name)
    mask = torch.ones_like(local["input_ids"])
    if cp.rank == 1:
        mask[0, 2] = 0  # zeros in rank 1's shard only
    one_rank = r"invalid on rank\(s\) 1 \(every rank .*\)\. rank\(s\) 1: ValueError: \S"
    _raises_everywhere(one_rank, model, input_ids=local["input_ids"],
                       position_ids=local["position_ids"], use_cache=False,
                       attention_mask=mask)
    # Contiguous layout: rank 1 holds tokens 24..47, so a document boundary at token 30 lies in
    # its shard only, and local positions 0..23 (none given) are right on rank 0 only.
    contiguous = cpattn.ContextParallel(cp.group, layout="contiguous")
    c_model = _model(model_config("llama"), register(contiguous, "cpattn_contiguous"))
    two = packed([30, 18])
    restart = contiguous.shard(two["position_ids"])
    assert bool((restart == contiguous.positions(48)).all()) == (cp.rank == 0)
    _raises_everywhere(one_rank, c_model, input_ids=contiguous.shard(two["input_ids"]),
                       position_ids=restart, use_cache=False)
    _raises_everywhere(one_rank, c_model, input_ids=contiguous.shard(ids), use_cache=False)
    # After the errors the group still works.
    _exact("llama after errors", model_config("llama"), _sequences(), cp)


def _llama4_chunks(cp, **shard):
    """Llama 4's chunked attention past one chunk (chunks of 8 in 48 tokens): exact for
    sequences and for packed documents (chunks on positions within each document): Ulysses
    cuts the attention at every multiple of 8 of the documents' positions, the ring and the
    all-gather gather K and V and attend each local run of a chunk to its chunk's keys (a
    chunk's keys on other ranks too: zigzag pieces of 6 tokens). Ablation: chunks of 64 (the
    layer then attends causally over all 48). shard: shard_batch's keywords."""
    config = model_config("llama4", attention_chunk_size=8)
    what = f"llama4 chunks {cp.strategy} {cp.layout} {shard}"
    _exact(what, config, _sequences(), cp, (model_config("llama4"), _sequences()))
    lengths = [20, 11, 17]  # every document longer than a chunk
    batch = packed(lengths)
    assert_step_matches(reference(config, batch, lengths=lengths),
                        cp_step(config, batch, cp, **shard), f"packed {what}")


def _w2(rank, world):
    for strategy in ("ring", "allgather", "ulysses"):
        cp = cpattn.ContextParallel(strategy=strategy)
        _packed_cases(cp)
    _family_cases(cpattn.ContextParallel())
    for strategy in ("ulysses", "ring", "allgather"):
        _llama4_chunks(cpattn.ContextParallel(strategy=strategy))
    # the ring over contiguous shards, packed documents split per document
    _llama4_chunks(cpattn.ContextParallel(strategy="ring", layout="contiguous"),
                   documents="per-document")
    _refusals(cpattn.ContextParallel())


def test_models_exact_or_refused_w2():
    """One spawn of 2 ranks (CI time) for every case."""
    run_ranks(2, _w2)
