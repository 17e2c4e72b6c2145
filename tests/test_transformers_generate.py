"""Greedy `model.generate` of tiny transformers models on W ranks (Llama at W = 2 and 3; at W = 2
also gpt-oss with sinks and sliding layers and Gemma 2 with softcap and sliding layers; at W = 3
Mistral's sliding window) through cpattn's sharded KV cache (ContextParallelCache:
prefill_attention, then decode_attention) gives the same tokens as single-process generation
with transformers' own attention and cache."""

import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import cpattn  # noqa: E402

from distributed import run_ranks  # noqa: E402
from transformers_models import tiny_config, tiny_model  # noqa: E402

PROMPT_LEN = 13  # not a multiple of 2W: the prompt's tail goes through decode_attention
NEW_TOKENS = 6


def _generate_matches(rank, world):
    kinds = ["llama", "gpt_oss", "gemma2"] if world == 2 else ["llama", "mistral"]
    for kind in kinds:
        overrides = {"initializer_range": 0.1} if kind == "gpt_oss" else {}
        _generate_kind(rank, world, tiny_config(kind, **overrides))


def _generate_kind(rank, world, config):
    from cpattn.integrations.transformers import ContextParallelCache, register

    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, config.vocab_size, (2, PROMPT_LEN), generator=g)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                    pad_token_id=0)
    # transformers' SDPA path has no sinks or softcap: the eager reference for those models
    ref_impl = "sdpa" if config.model_type in ("llama", "mistral") else "eager"
    ref = tiny_model(config, ref_impl).generate(prompts, **settings)
    # Each option changes the tokens, so that dropping it would fail the comparison below.
    if getattr(config, "sliding_window", None):  # 7 < the 19 tokens
        unwindowed = copy.deepcopy(config)
        unwindowed.sliding_window = 64
        assert not torch.equal(tiny_model(unwindowed, ref_impl).generate(prompts, **settings),
                               ref), f"{config.model_type}: the window changes nothing"
    if config.model_type == "gpt_oss":
        sinkless = tiny_model(config, ref_impl)
        with torch.no_grad():
            for layer in sinkless.model.layers:
                layer.self_attn.sinks.fill_(-1e9)
        assert not torch.equal(sinkless.generate(prompts, **settings), ref)
    if config.model_type == "gemma2":
        uncapped = copy.deepcopy(config)
        uncapped.attn_logit_softcapping = None
        assert not torch.equal(tiny_model(uncapped, ref_impl).generate(prompts, **settings), ref)

    cp = cpattn.ContextParallel()
    model = tiny_model(config, register(cp))
    cache = ContextParallelCache(cp, model.config, capacity=PROMPT_LEN + NEW_TOKENS)
    got = model.generate(prompts, cache=cache, **settings)
    assert torch.equal(got, ref), f"rank {rank} {config.model_type}: {got.tolist()} vs " \
        f"{ref.tolist()}"

    # Each token's K/V is held by exactly one rank.
    for layer in cache.layers:
        assert layer.shard.lengths.tolist() == [PROMPT_LEN + NEW_TOKENS - 1] * 2
        held = layer.shard.local_lengths()
        total = held.clone()
        dist.all_reduce(total)
        assert total.tolist() == layer.shard.lengths.tolist()
        assert held.max() < layer.shard.lengths.max() or world == 1


@pytest.mark.parametrize("world", [2, 3])
def test_generate_matches_single_process(world):
    run_ranks(world, _generate_matches)


def _llama4(rank, world):
    """Llama 4 (a chunked RoPE layer, a NoPE layer): the same tokens as one process with chunks
    longer than prompt + new tokens (64) and with chunks the prompt and the generation cross
    (8: the prompt attends in its chunks, each new token back to its chunk's start); the two
    give different tokens (so the chunks matter)."""
    from test_transformers_models import model_config

    from cpattn.integrations.transformers import ContextParallelCache, register

    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(5, 96, (2, PROMPT_LEN), generator=g)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                    pad_token_id=0)
    cp = cpattn.ContextParallel()
    name = register(cp)
    results = {}
    for chunk in (64, 8):
        config = model_config("llama4", attention_chunk_size=chunk, use_cache=True)
        ref = tiny_model(config, "sdpa").generate(prompts, **settings)
        model = tiny_model(config, name)
        cache = ContextParallelCache(cp, model.config, capacity=PROMPT_LEN + NEW_TOKENS)
        got = model.generate(prompts, cache=cache, **settings)
        assert torch.equal(got, ref), f"rank {rank} chunk {chunk}: {got.tolist()} vs " \
            f"{ref.tolist()}"
        results[chunk] = ref
    assert not torch.equal(results[64], results[8]), "the chunks change nothing"


def test_generate_llama4_chunks():
    run_ranks(2, _llama4)


def _mla(rank, world):
    """DeepSeek-V3 (MLA) caches latents: ContextParallelCache refuses it naming the cause, and
    so does the attention when such a model reaches it with a cache made another way."""
    from test_transformers_models import model_config

    from cpattn.integrations.transformers import ContextParallelCache, register

    cp = cpattn.ContextParallel()
    config = model_config("deepseek_v3", use_cache=True)
    with pytest.raises(ValueError, match="latent"):
        ContextParallelCache(cp, config, capacity=32)
    model = tiny_model(config, register(cp))
    # a cache made for the same number of layers from another config (past the constructor)
    cache = ContextParallelCache(cp, model_config("llama", use_cache=True), capacity=32)
    with pytest.raises(ValueError, match="changes what it caches"):
        model.generate(torch.randint(5, 96, (1, 8)), cache=cache, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)


def test_generate_mla_refused():
    run_ranks(2, _mla)


def _invariant_generation(rank, world):
    """ContextParallel(invariant=True) reaches the sharded cache's prefill / decode: with a cache
    of interleave 1 (blocks smaller than the invariant forward's key tiles) generation raises on
    every rank, never runs the default mode; with whole tiles per block it runs, and the
    scores of every generated token are bitwise those of the same generation over one rank."""
    from cpattn.integrations.transformers import ContextParallelCache, register

    config = tiny_config("llama")
    tile = torch.ops.cpattn.invariant_tile()
    prompts = torch.randint(0, config.vocab_size, (2, PROMPT_LEN),
                            generator=torch.Generator().manual_seed(5))
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                    pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    cp = cpattn.ContextParallel(invariant=True)
    model = tiny_model(config, register(cp))
    cache = ContextParallelCache(cp, model.config, capacity=PROMPT_LEN + NEW_TOKENS)
    with pytest.raises(ValueError, match=f"interleave=a multiple of {tile}"):
        model.generate(prompts, cache=cache, **settings)
    singles = [dist.new_group([r]) for r in range(world)]
    results = []
    for group in (None, singles[rank]):
        cp = cpattn.ContextParallel(group, invariant=True)
        model = tiny_model(config, register(cp))
        cache = ContextParallelCache(cp, model.config, capacity=PROMPT_LEN + NEW_TOKENS,
                                     interleave=tile)
        out = model.generate(prompts, cache=cache, **settings)
        results.append((out.sequences, torch.stack(out.scores)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1]), "scores differ between W and one rank"


def test_invariant_generation_over_ranks_equals_one_rank():
    run_ranks(2, _invariant_generation)


def _left_padded(rank, world):
    """Prompts of 13 and 6 tokens, left-padded with their attention_mask (generate's way to batch
    prompts of different lengths): each row's real tokens are prefilled alone on its view of the
    sharded cache, then decoded together; the tokens equal each prompt generated alone in one
    process. Ablation: padding treated as tokens (LeftPadding.real reporting every position)
    changes them."""
    from cpattn.integrations import _generation
    from cpattn.integrations.transformers import ContextParallelCache, register

    config = tiny_config("llama")
    g = torch.Generator().manual_seed(5)
    alone = [torch.randint(5, config.vocab_size, (1, n), generator=g) for n in (PROMPT_LEN, 6)]
    ids = torch.zeros(2, PROMPT_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(alone):
        ids[row, PROMPT_LEN - p.shape[1]:], mask[row, PROMPT_LEN - p.shape[1]:] = p[0], 1
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                    pad_token_id=0)
    ref_model = tiny_model(config, "sdpa")
    ref = torch.stack([torch.cat([ids[row, :PROMPT_LEN - p.shape[1]],
                                  ref_model.generate(p, **settings)[0]])
                       for row, p in enumerate(alone)])
    cp = cpattn.ContextParallel()
    model = tiny_model(config, register(cp))

    def generate():
        cache = ContextParallelCache(cp, model.config, capacity=PROMPT_LEN + NEW_TOKENS)
        return model.generate(ids, attention_mask=mask, cache=cache, **settings)

    got = generate()
    assert torch.equal(got, ref), f"rank {rank}: {got.tolist()} vs {ref.tolist()}"
    real = _generation.LeftPadding.real
    _generation.LeftPadding.real = lambda self, n: [n] * self.mask.shape[0]
    try:
        assert not torch.equal(generate(), ref), "padding as tokens: the test cannot fail"
    finally:
        _generation.LeftPadding.real = real


def test_generate_left_padded():
    run_ranks(2, _left_padded)
