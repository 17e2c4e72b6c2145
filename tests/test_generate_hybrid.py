"""Greedy `model.generate` of every hybrid family (tests/hybrid_models.py) through
ContextParallelCache on W = 2 and 3 gloo ranks, against one process's `generate` with the same
weights (eager, transformers' own cache): the same tokens on every rank, and every step's logits
within 1e-4 of the largest (fp32).

Four cases per family and W, each with an ablation (the prefill's handed-off conv and recurrent
states written as zeros) that changes the tokens:

- "sequences": six prompts of 13 tokens (not a multiple of the granularity 2W: the tail runs on
  every rank alike after the context-parallel lead);
- "chunked": six prompts of 21 tokens prefilled in chunks of 8 (`prefill_chunk_size`: each later
  chunk starts from the cached states); the reference is the unchunked generate (transformers'
  own chunked prefill raises for attention-free models and drifts by 8e-4 for Jamba);
- "padded": prompts of 21, 10, 15 and 7 tokens, left-padded (generate's way to batch prompts of
  different lengths). The reference is each prompt generated alone (what padding means); the
  tokens also equal transformers' own padded generate (whose MiniMax logits drift by 1.6e-2 from
  the prompts alone: its padding is not exact there);
- "padded chunked": the padded prompts prefilled in chunks of 8 (the 7-token row's padding spans
  the first chunk and part of the second: each chunk's padding is masked for the mixers and the
  attention).

Kimi delta attention runs in a Kimi-Linear config of KDA layers only ("kimi_delta"): Kimi-Linear's
attention layers are MLA, which ContextParallelCache refuses (it caches latents), and transformers'
own cached generate needs an attention layer, so its reference is generate without a cache.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

pytest.importorskip("transformers")

import hybrid_models as H  # noqa: E402

import cpattn  # noqa: E402

from distributed import run_ranks  # noqa: E402

NEW = 6
SETTINGS = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0,
                use_cache=True, output_logits=True, return_dict_in_generate=True)
KINDS = tuple(k for k in H.FAMILIES if k != "kimi_linear") + ("kimi_delta",)
CASES = ("sequences", "chunked", "padded", "padded chunked")
ROWS = 6  # prompts per batch (the ablation: more rows, more chances for a token to change)


def _model(cfg):
    """The tiny model with a long memory, so that the handed-off states steer the tokens: each
    decay slow (A_log = log 0.005, the scale of trained models' decays) and LFM2's short
    convolutions x20 (their state is the conv history alone); Falcon-H1's Mamba branch x10 (its
    config's ssm_out_multiplier)."""
    model = H.model(cfg, "eager")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.fill_(math.log(0.005))
            if type(module).__name__.endswith("ShortConv"):
                module.conv.weight.mul_(20.0)
    return model


def _config(kind: str):
    if kind == "falcon_h1":  # (its Mamba branch beside attention made loud: x10 out)
        return H.config(kind, ssm_out_multiplier=10.0)
    if kind != "kimi_delta":
        return H.config(kind)
    cfg = H.config("kimi_linear")
    cfg.layer_types = ["linear_attention"] * cfg.num_hidden_layers
    return cfg


LENGTHS = (21, 10, 15, 7)  # the padded case's prompts


def _prompts(case: str):
    """(input_ids, attention_mask or None, the prompts alone (padded case) or None)."""
    g = torch.Generator().manual_seed(5)
    if not case.startswith("padded"):
        return torch.randint(5, 96, (ROWS, 13 if case == "sequences" else 21), generator=g), \
            None, None
    alone = [torch.randint(5, 96, (1, n), generator=g) for n in LENGTHS]
    ids = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(alone):
        ids[row, ids.shape[1] - prompt.shape[1]:] = prompt[0]
        mask[row, ids.shape[1] - prompt.shape[1]:] = 1
    return ids, mask, alone


def _reference(cfg, kind: str, case: str):
    """(tokens (2, T), per step logits (2, V)) of one process, rows of the prompts alone."""
    settings = {**SETTINGS, "use_cache": kind != "kimi_delta"}
    ids, mask, alone = _prompts(case)
    model = _model(cfg)
    if alone is None:
        out = model.generate(ids, **settings)
        return out.sequences, list(out.logits)
    outs = [model.generate(p, **settings) for p in alone]
    padded = model.generate(ids, attention_mask=mask, **settings)
    tokens = torch.stack([torch.cat([ids[row, :ids.shape[1] - p.shape[1]], out.sequences[0]])
                          for row, (p, out) in enumerate(zip(alone, outs))])
    assert torch.equal(padded.sequences, tokens), f"{kind}: padded generate is not each alone"
    return tokens, [torch.cat(step) for step in zip(*(out.logits for out in outs))]


def _generate(model, cp, case: str):
    from cpattn.integrations.transformers import ContextParallelCache

    ids, mask, _ = _prompts(case)
    cache = ContextParallelCache(cp, model.config, capacity=ids.shape[1] + NEW)
    extra = {"prefill_chunk_size": 8} if case.endswith("chunked") else {}
    return model.generate(ids, attention_mask=mask, cache=cache, **extra, **SETTINGS)


@contextlib.contextmanager
def handed_off_zeros():
    """The ablation: the prefill's handed-off conv and recurrent states written as zeros."""
    from cpattn.integrations.hybrid import generation

    real = generation.store

    def zeros(layer, rows, conv, state, dtype, batch):
        real(layer, rows, None if conv is None else torch.zeros_like(conv),
             None if state is None else torch.zeros_like(state), dtype, batch)

    generation.store = zeros
    try:
        yield
    finally:
        generation.store = real


def _family(rank: int, world: int, kind: str) -> None:
    from cpattn.integrations.transformers import parallelize

    cfg = _config(kind)
    cp = cpattn.ContextParallel()
    model = _model(cfg)
    parallelize(model, cp)
    for case in CASES:
        what = f"{kind} {case} W={world} rank {rank}"
        tokens, logits = _reference(cfg, kind, case)
        got = _generate(model, cp, case)
        assert torch.equal(got.sequences, tokens), \
            f"{what}: {got.sequences.tolist()} vs {tokens.tolist()}"
        for step, (a, b) in enumerate(zip(got.logits, logits)):
            err = float((a - b).abs().max() / b.abs().max())
            assert err <= 1e-4, f"{what}: step {step} logits off by {err:.3g} (relative)"
        with handed_off_zeros():
            ablated = _generate(model, cp, case)
        assert not torch.equal(ablated.sequences, tokens), \
            f"{what}: zeroed handed-off states give the same tokens: the test cannot fail"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 3])
def test_generate_hybrid_matches_single_process(world, kind):
    run_ranks(world, _family, kind)


def _disagreeing_scans(rank: int, world: int) -> None:
    import os

    from cpattn.integrations.transformers import parallelize

    cfg = _config("qwen3_5")
    cp = cpattn.ContextParallel()
    model = _model(cfg)
    parallelize(model, cp)
    try:
        os.environ["CPATTN_MIXER_SCAN"] = ("tree", "allgather")[rank]
        with pytest.raises(ValueError, match="state scan"):
            _generate(model, cp, "sequences")
        os.environ["CPATTN_MIXER_SCAN"] = "tree"  # agreeing again: it generates
        _generate(model, cp, "sequences")
    finally:
        os.environ.pop("CPATTN_MIXER_SCAN")  # (the ranks serve this file's later tests)


def test_prefill_ranks_that_would_scan_differently_raise_on_every_rank():
    """$CPATTN_MIXER_SCAN set differently on the ranks: the prefill raises a ValueError on every
    rank naming the state scan, never ranks meeting in different collectives."""
    run_ranks(2, _disagreeing_scans)
