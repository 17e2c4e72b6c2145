"""Greedy `model.generate` of a tiny transformers Llama (and a gpt-oss with sinks at W = 2) on W
ranks through cpattn's sharded KV cache (ContextParallelCache: prefill_attention, then
decode_attention) gives the same tokens as single-process generation with transformers' own
attention and cache."""

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
    # W = 2 also: a gpt-oss-like model (attention sinks; full-attention layers only, as the
    # sharded cache has no sliding window), the sinks through prefill and decode.
    kinds = ["llama", "gpt_oss"] if world == 2 else ["llama"]
    for kind in kinds:
        overrides = ({"layer_types": ["full_attention"] * 2, "initializer_range": 0.1}
                     if kind == "gpt_oss" else {})
        _generate_kind(rank, world, tiny_config(kind, **overrides))


def _generate_kind(rank, world, config):
    from cpattn.integrations.transformers import ContextParallelCache, register

    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, config.vocab_size, (2, PROMPT_LEN), generator=g)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                    pad_token_id=0)
    ref_impl = "eager" if config.model_type == "gpt_oss" else "sdpa"
    ref = tiny_model(config, ref_impl).generate(prompts, **settings)
    if config.model_type == "gpt_oss":  # the sinks change the tokens: dropping them would fail
        sinkless = tiny_model(config, ref_impl)
        with torch.no_grad():
            for layer in sinkless.model.layers:
                layer.self_attn.sinks.fill_(-1e9)
        assert not torch.equal(sinkless.generate(prompts, **settings), ref)

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
