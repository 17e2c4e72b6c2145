"""Greedy `model.generate` of a tiny transformers Llama on W ranks through cpattn's sharded KV
cache (ContextParallelCache: prefill_attention, then decode_attention) gives the same tokens as
single-process generation with SDPA and transformers' own cache."""

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
    from cpattn.integrations.transformers import ContextParallelCache, register

    config = tiny_config()
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, config.vocab_size, (2, PROMPT_LEN), generator=g)
    settings = dict(max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                    pad_token_id=0)
    ref = tiny_model(config, "sdpa").generate(prompts, **settings)

    cp = cpattn.ContextParallel()
    model = tiny_model(config, register(cp))
    cache = ContextParallelCache(cp, model.config, capacity=PROMPT_LEN + NEW_TOKENS)
    got = model.generate(prompts, cache=cache, **settings)
    assert torch.equal(got, ref), f"rank {rank}: {got.tolist()} vs {ref.tolist()}"

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
