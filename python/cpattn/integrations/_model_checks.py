"""What a transformers model passes to the attention call and computes outside it, checked for
context parallelism: the one place that decides what is honoured, made exact, or refused.

The keywords the model passes to an attention function (`score_options`): each one honoured (mapped
to cpattn's options), inert, or refused.

Under context parallelism each rank runs the model on its shard of the tokens; only the attention
call sees the whole sequence. Everything else must be per token, or be made exact, or be refused:
- token mixers outside attention (convolutions, Mamba / SSM, linear or lightning attention, a
  sparse-attention indexer) would mix each rank's shard only. `parallelize` makes the ones with
  an adapter exact and refuses any other by the model's structure (integrations/hybrid/); a model
  given to `register`'s attention implementation alone is refused from its config
  (`check_config`: its `layer_types`, else the class names of its modeling module), naming
  `parallelize`, and a sparse-attention indexer is refused either way;
- masks the model builds (`mask_function` handed to the mask hook): the ones cpattn applies on
  global positions (causal, bidirectional, sliding windows, chunks, packed documents, padding
  handled by shard_batch) pass, any other raises (`check_mask_function`);
- per-layer position arithmetic: Llama 4's chunked attention is exact only while every position
  lies in the first chunk, its attention-temperature tuning (computed from the local length)
  only while the sequence is shorter than `floor_scale` (`check_layer`).
Every check depends only on what every rank has the same (config, module, global lengths), so a
refusal raises on every rank; `agree` makes a check on local values (positions, a padding mask)
raise on every rank too.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any, Optional

import torch

from cpattn.core.options import AttentionOptions
from cpattn.sharding.packing import KEYWORD

WHAT = "cpattn.integrations.transformers"
# What a model given whole batches (a plain transformers Trainer's) is told, as a sentence.
TRAINER_ADVICE = ("A transformers Trainer gives the model whole batches: train with "
                  "cpattn.integrations.trainer.ContextParallelTrainer (or "
                  "with_context_parallel(YourTrainer); ContextParallelSFTTrainer for TRL), "
                  "which shards every batch")

# Keywords transformers passes that do not change the attention math.
_INERT = frozenset({"use_cache", "output_hidden_states", "output_router_logits",
                    "num_items_in_batch", "return_dict", "cache_position", "layer_idx",
                    "deterministic"})  # (ModernBERT: flash-attn's deterministic backward)
# Keywords mapped to cpattn's options (in score_options).
_MAPPED = frozenset({"position_ids", "is_causal", "sliding_window", "softcap", "s_aux", "sinks",
                     "alibi_slopes", KEYWORD})
# Keywords that change the math and that cpattn cannot honour: value -> whether it is in use.
_UNSUPPORTED = {
    "position_bias": lambda v: v is not None,  # a general additive score bias (T5-like)
    "output_attentions": bool,
    "cu_seq_lens_q": lambda v: v is not None,  # packed sequences (flash varlen)
    "cu_seq_lens_k": lambda v: v is not None,
    "max_length_q": lambda v: v is not None,
    "max_length_k": lambda v: v is not None,
    "seq_idx": lambda v: v is not None,
    "encoder_hidden_states": lambda v: v is not None,  # cross-attention (BERT: None in encoders)
}
_MISPLACED = {"labels", "shift_labels"}  # reach attention when a batch is passed as **batch


def score_options(module: torch.nn.Module, head_dim: int, scaling, dropout: float,
                  kwargs: dict[str, Any]) -> AttentionOptions:
    """Maps what transformers passes to cpattn's options, or raises. transformers 5.24 passes:
    `sliding_window` (int or None; Mistral, Gemma 2, gpt-oss: key j visible iff i - j <
    sliding_window), `softcap` (Gemma 2's attn_logit_softcapping, None: off), `s_aux` (gpt-oss:
    the module's `sinks` parameter, one logit per head; its gradient flows through cpattn).
    `alibi_slopes` (heads,) is honoured for a model that passes it (FlashAttention's name and
    convention: -slope * |i - j| added to the scaled score); transformers' own ALiBi models (Bloom,
    Falcon, MPT) compute attention in their own code and never call an attention interface."""
    if dropout:
        raise ValueError(f"{WHAT}: attention dropout {dropout} cannot be honoured (cpattn has no "
                         "attention dropout): set config.attention_dropout = 0.0")
    for name, value in kwargs.items():
        if name in _UNSUPPORTED:
            if _UNSUPPORTED[name](value):
                raise ValueError(f"{WHAT}: the model passes {name}={short(value)}, which cpattn "
                                 "cannot honour; use another attention implementation")
        elif name in _MISPLACED:
            raise ValueError(f"{WHAT}: '{name}' reached the attention layer: pass the batch's "
                             "labels to cpattn.cross_entropy, not to the model")
        elif name not in _INERT and name not in _MAPPED:
            raise ValueError(f"{WHAT}: unknown keyword {name}={short(value)} passed to the "
                             "attention; cpattn does not know whether it changes the math")
    causal = kwargs.get("is_causal")
    causal = bool(getattr(module, "is_causal", True) if causal is None else causal)
    scale = float(scaling) if scaling is not None else head_dim ** -0.5
    window = (-1, -1)
    sliding = kwargs.get("sliding_window")
    if sliding is not None:
        if isinstance(sliding, bool) or not isinstance(sliding, int) or sliding < 1:
            raise ValueError(f"{WHAT}: sliding_window must be a positive int, got {sliding!r}")
        # transformers' (and flash-attn's) convention: key j visible iff |i - j| < sliding
        # (causal: i - j < sliding); its masks for ModernBERT's bidirectional window agree
        window = (sliding - 1, -1) if causal else (sliding - 1, sliding - 1)
    if kwargs.get("s_aux") is not None and kwargs.get("sinks") is not None:
        raise ValueError(f"{WHAT}: the model passes both s_aux and sinks; pass one")
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))
    alibi = kwargs.get("alibi_slopes")
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ValueError(f"{WHAT}: {name} must be a tensor of one value per head, got "
                             f"{short(t)}")
    softcap = kwargs.get("softcap")
    softcap = 0.0 if softcap is None else softcap  # None and 0: off; cpattn checks the rest
    return AttentionOptions(softmax_scale=scale, causal=causal, window=window, softcap=softcap,
                            alibi_slopes=alibi, sinks=sinks)  # checked by the attention call


def short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    return repr(value)


_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
_PER_TOKEN_LAYERS = frozenset({"mlp", "moe", "dense"})  # (Nemotron-H lists its MLP layers too)
_MIXER_CLASS = re.compile(r"(Conv|Mamba|SSM|Mixer|LinearAttention|Lightning|DeltaNet|Recurrent|"
                          r"RWKV|Retention|Hyena|Indexer|ShortConv|GatedDelta)")
_MIXER_EXEMPT = re.compile(r"(Embedding|Norm|Rotary|MLP|Expert|Router|Gate$)")


def check_config(config, parallelized: bool = False) -> None:
    """Raises ValueError naming the layer type (or class) when the model mixes tokens outside the
    attention call in a way the attention implementation cannot see to: any token mixer for a
    model that was not parallelized (`parallelize` checks its modules instead), a
    sparse-attention indexer for every model."""
    if config is None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    message = _config_refusal(getattr(text, "model_type", "") or "",
                              tuple(getattr(text, "layer_types", None) or ()), parallelized)
    if message:
        raise ValueError(message)


@torch._dynamo.assume_constant_result
def _config_refusal(model_type: str, layer_types: tuple, parallelized: bool) -> str:
    """"" or why the model cannot run under context parallelism (a compile-time constant)."""
    return _cached_config_refusal(model_type, layer_types, parallelized)


_USE_PARALLELIZE = ("; cpattn.integrations.transformers.parallelize(model, cp) makes the token "
                    "mixers it has adapters for exact (docs/hybrid-models.md): register(cp) "
                    "alone is for models whose only token mixing is attention")


@functools.lru_cache(maxsize=64)
def _cached_config_refusal(model_type: str, layer_types: tuple, parallelized: bool) -> str:
    """_config_refusal, cached (the mask hook asks at every forward)."""
    others = sorted(set(layer_types) - _ATTENTION_LAYERS - _PER_TOKEN_LAYERS)
    if "indexed_attention" in others:
        return (f"{WHAT}: the {model_type!r} model's sparse attention selects keys with an "
                "indexer (top-k over the scores of the whole sequence) before the attention "
                "call; under context parallelism the indexer would see each rank's shard "
                "only, so cpattn refuses it (no exact sharded indexer yet)")
    if parallelized:
        return ""
    if others:
        first = next(i for i, t in enumerate(layer_types) if t in others)
        return (f"{WHAT}: the {model_type!r} model has layers of type {others} (layer "
                f"{first} first), which mix tokens outside the attention call (convolution, "
                "state-space or linear attention); under context parallelism they would "
                f"see each rank's shard only{_USE_PARALLELIZE}")
    mixers = [] if layer_types else _mixer_classes(model_type)
    if mixers:
        return (f"{WHAT}: the {model_type!r} model defines token-mixing layers outside attention "
                f"({', '.join(mixers)}); under context parallelism they would see each rank's "
                f"shard only{_USE_PARALLELIZE}")
    return ""


def _mixer_classes(model_type: str) -> list[str]:
    """Classes of the model type's modeling module whose names say they mix tokens (the guess
    for a model given to register's implementation without layer_types: only parallelize sees
    its modules)."""
    module = sys.modules.get(f"transformers.models.{model_type}.modeling_{model_type}")
    if module is None:
        return []
    return sorted(name for name, obj in vars(module).items()
                  if isinstance(obj, type) and issubclass(obj, torch.nn.Module)
                  and obj.__module__ == module.__name__ and _MIXER_CLASS.search(name)
                  and not _MIXER_EXEMPT.search(name))


# transformers.masking_utils' mask functions that cpattn applies itself, on global positions, by
# qualified name; and_masks / or_masks combine them (their parts are checked).
_KNOWN_MASKS = frozenset({
    "causal_mask_function", "bidirectional_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",  # sliding_window (causal)
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",  # ModernBERT's local attention
    "chunked_overlay.<locals>.inner_mask",  # Llama 4 (check_layer)
    "packed_sequence_mask_function.<locals>.inner_mask",  # packed documents (shard_batch)
    "remap_positions_for_packed_sequence.<locals>.inner_mask",
    "padding_mask_function.<locals>.inner_mask",  # padding (shard_batch unpads)
    "add_offsets_to_mask_function.<locals>.inner_mask",
})
_COMBINERS = frozenset({"and_masks.<locals>.and_mask", "or_masks.<locals>.or_mask"})


def check_mask_function(mask_function: Optional[Callable]) -> None:
    """Raises ValueError for a mask function cpattn does not apply (an image-token overlay, a
    user's function): never silently dropped. Not while torch.compile traces (the function is
    then dynamo's; the eager run of the same model checks it)."""
    if mask_function is None or torch.compiler.is_compiling():
        return
    unknown = _unknown_masks(mask_function)
    if unknown:
        raise ValueError(
            f"{WHAT}: the model builds an attention mask from {', '.join(unknown)}, which cpattn "
            "does not apply (it applies causal, bidirectional, sliding-window and chunked masks "
            "and packed documents on global positions); running without it would train another "
            "model, so it raises. Use another attention implementation for this model")


def _unknown_masks(fn: Callable) -> list[str]:
    name = getattr(fn, "__qualname__", repr(fn))
    if getattr(fn, "__module__", None) != "transformers.masking_utils":
        return [f"{getattr(fn, '__module__', '?')}.{name}"]
    if name in _KNOWN_MASKS and name != "remap_positions_for_packed_sequence.<locals>.inner_mask":
        return []
    cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    if name in _COMBINERS:
        return [u for part in cells.get("mask_functions", ()) for u in _unknown_masks(part)]
    if name in _KNOWN_MASKS:  # the remap wraps the mask it remaps
        return _unknown_masks(cells["mask_function"])
    return [name]


def attention_chunk(module: torch.nn.Module) -> Optional[int]:
    """The chunk size of a layer with chunked attention (Llama 4: keys in the query's chunk of
    `attention_chunk_size` positions only), else None."""
    config = getattr(module, "config", None)
    layer_types = getattr(config, "layer_types", None)
    layer = getattr(module, "layer_idx", None)
    if layer_types and layer is not None and layer < len(layer_types) and (
            layer_types[layer] == "chunked_attention"):
        return getattr(config, "attention_chunk_size", None)
    return None


def check_layer(module: torch.nn.Module, tokens: int, max_position: int,
                chunks: bool = False) -> None:
    """Per-layer position arithmetic of the model that cpattn cannot make exact beyond a length.
    tokens: the sequence's (or packed batch's) number of tokens; max_position: its largest
    position id; chunks: whether the caller applies chunked attention's chunks. The same on
    every rank."""
    layer = getattr(module, "layer_idx", None)
    chunk = attention_chunk(module)
    if chunk is not None and max_position >= chunk and not chunks:
        raise ValueError(
            f"{WHAT}: layer {layer} uses chunked attention (attention_chunk_size={chunk}) and "
            f"positions reach {max_position}: past one chunk, strategies 'ring', 'allgather' "
            "and 'ulysses' apply the chunks exactly; 'hybrid' runs only while every position "
            "is below the chunk size")
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        floor = getattr(module, "floor_scale", None)
        if floor is not None and tokens >= floor:
            raise ValueError(
                f"{WHAT}: layer {layer} scales its queries by attention-temperature tuning, "
                f"which transformers computes from the local length; with {tokens} tokens "
                f"(>= floor_scale {floor}) each rank would scale by its own shard's positions. "
                "Set config.attn_temperature_tuning = False, or keep sequences shorter than "
                "floor_scale")


def agree(cp, what: str, check: Callable[[], None]) -> None:
    """Runs check() (which raises ValueError on a bad local value) so that every rank of cp's
    sequence raises when any rank's check fails (ContextParallel.agree: over each of its
    groups). In rank-check mode "once" too (a valid check's fields are the same at every
    call)."""
    def validated():
        check()
        return None, []

    cp.agree(what, validated, every_call=True)
