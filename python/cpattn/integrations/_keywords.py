"""What transformers passes to an attention function, mapped to cpattn's options (or refused):
the one place that decides, for every keyword, whether it is honoured, inert, or raises."""

from __future__ import annotations

from typing import Any

import torch

from cpattn.options import AttentionOptions
from cpattn.packing import KEYWORD

WHAT = "cpattn.integrations.transformers"

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
