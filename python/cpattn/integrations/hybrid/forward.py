"""The sharded forward of a parallelized mixer module: its call's checks (agreed over the ranks),
the piece map of this call's documents, and the module's adapter on this rank's pieces.

Refused on every rank: a cache (generation, use_cache=True), a padding mask reaching the mixer, a
call whose documents cannot be known (outside a forward of its model, without a
`cpattn_documents` keyword), a model not given shard_batch's whole batch, a packed batch of more
than one row, a local length that is not this rank's share."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from cpattn.integrations._model_checks import TRAINER_ADVICE
from cpattn.integrations.hybrid.documents import ModelState
from cpattn.integrations.hybrid.registry import Adapter
from cpattn.mixers.mixing import Mixing
from cpattn.mixers.sharded import check_settings, exchange_of, piece_map_of
from cpattn.sharding.packing import KEYWORD, Documents

WHAT = "cpattn.integrations.transformers"
_CACHES = ("cache", "cache_params", "past_key_values")  # the names transformers gives a cache


@dataclass
class MixerRole:
    """What a parallelized mixer needs at its call: the model's state, its adapter, and the
    names of its forward's positional parameters (to find hidden_states, the attention mask and
    a cache however they are passed)."""

    state: ModelState
    adapter: Adapter
    parameters: tuple


def positional_parameters(module: torch.nn.Module) -> tuple:
    """The names of the module's forward parameters that can be passed positionally, after
    self."""
    signature = inspect.signature(type(module).forward)
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in signature.parameters.values() if p.kind in kinds]
    return tuple(names[1:])


def mixer_forward(module: torch.nn.Module, *args, **kwargs):
    """The per-instance forward of a parallelized mixer (bound with types.MethodType)."""
    role: MixerRole = module.__dict__["_cpattn_mixer"]
    call = dict(zip(role.parameters, args))
    call.update(kwargs)
    hidden = call.get(role.parameters[0]) if role.parameters else None
    if hidden is None:
        hidden = call.get("hidden_states")
    return _sharded_forward(role, module, hidden, call)


def _sharded_forward(role: MixerRole, module: torch.nn.Module, hidden: torch.Tensor,
                     call: dict[str, Any]):
    cp = role.state.cp
    name = type(module).__name__
    cache = next((call[k] for k in _CACHES if call.get(k) is not None), None)
    mask = call.get("attention_mask")
    binding = role.state.binding() if KEYWORD not in call else None
    documents = call[KEYWORD] if KEYWORD in call else getattr(binding, "documents", None)
    passed = KEYWORD in call or getattr(binding, "passed", False)
    local = hidden.shape[1]

    def check():
        check_settings(cp, WHAT)
        if cache is not None:
            raise ValueError(_cache_refusal(name, cache))
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2
                                     and bool(mask.all())):
            raise ValueError(f"{WHAT}: {name} got an attention mask (padding): under context "
                             "parallelism give the padded batch to cpattn.shard_batch (it unpads "
                             "the rows into documents) and pass no attention_mask to the model")
        if KEYWORD not in call and binding is None:
            raise ValueError(
                f"{WHAT}: {name} was called outside a forward of its parallelized model (a "
                "recompute, or a direct call) without cpattn_documents, or a layer above it "
                "lost the forward parallelize gave it, so cpattn cannot know how its tokens were "
                "sharded: run it inside the model's forward, checkpoint the model's layers "
                "(model.gradient_checkpointing_enable(), or torch.utils.checkpoint(..., "
                f"use_reentrant=False)), or pass {KEYWORD}=")
        if not passed:
            raise ValueError(
                f"{WHAT}: {name} mixes tokens along the sequence, so cpattn needs to know how "
                "the batch was sharded: pass the whole batch of cpattn.shard_batch to the model "
                f"(model(**batch) without 'shift_labels': its {KEYWORD!r}, None for rows of "
                f"whole sequences). {TRAINER_ADVICE}")
        if documents is not None and not isinstance(documents, Documents):
            raise ValueError(f"{WHAT}: {KEYWORD} must be the cpattn.sharding.packing.Documents "
                             "that cpattn.shard_batch made")
        if documents is not None and hidden.shape[0] != 1:
            raise ValueError(f"{WHAT}: packed documents are one row, got a batch of "
                             f"{hidden.shape[0]}")
        piece_map = piece_map_of(cp, local, documents)
        if piece_map.local_len[cp.rank] != local:
            raise ValueError(f"{WHAT}: {name} got {local} tokens; this rank holds "
                             f"{piece_map.local_len[cp.rank]} of the batch "
                             "(pass shard_batch's tokens)")
        # (not the local length: under a document plan the ranks hold different numbers)
        return piece_map, [("mixer", name), ("piece map", piece_map.signature),
                           ("hidden_states.batch", hidden.shape[0]),
                           ("hidden_states.hidden", hidden.shape[-1]),
                           ("hidden_states.dtype", hidden.dtype),
                           ("hidden_states.device", hidden.device.type)]

    piece_map = cp.agree(WHAT, check)
    mix = Mixing(piece_map, cp.rank, exchange_of(cp), hidden.shape[0])
    return role.adapter.fn(module, hidden, mix)


def _cache_refusal(name: str, cache) -> str:
    if type(cache).__name__ == "ContextParallelCache":
        return (f"{WHAT}: generate with ContextParallelCache does not support models with "
                f"token-mixing layers outside attention yet ({name}: its convolution and "
                "recurrent states are not kept in the sharded cache); generate without context "
                "parallelism for this model")
    return (f"{WHAT}: {name} got a cache (use_cache=True, transformers' default): pass "
            "use_cache=False to the model (or set config.use_cache = False) for training")
