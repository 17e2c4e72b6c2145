"""How shard_batch's documents reach the token mixers of one parallelized model, also in the
recompute of activation checkpointing.

The documents (`cpattn_documents`, None for rows of whole sequences) tell a mixer which tokens
this rank holds (its piece map). They come with the model's call; many models do not hand them
down to their mixers. So, per model instance (`ModelState`, referenced by the model's hooks and
wrappers, never by a global table):

- a forward pre-hook on the model (and on each model nested in it) records the call's documents
  as a `Binding` for the duration of the call (`ModelState.enter` / `leave`);
- each layer above a mixer gets a per-instance forward (`layer_forward`) that binds the documents
  of *this* call (its own `cpattn_documents` keyword if it got one, else the model call's) while
  it runs, so the mixers below read them (`ModelState.binding`). Under transformers' gradient
  checkpointing (the layer's class forward runs `self._gradient_checkpointing_func(partial(
  forward, self, **kwargs), *args)`) the function the checkpoint saves is wrapped to bind the
  same documents, so its recompute in backward uses the documents of the forward it recomputes,
  even if another forward with other documents ran in between;
- a plain non-reentrant torch.utils.checkpoint around a layer runs `layer_forward` again in
  backward, outside the model's call: the binding then comes from the layer's hidden states
  (the same tensor object as in the forward, tagged with its binding there). A reentrant one
  detaches the inputs, so the recompute could not know them: a layer that gets no
  `cpattn_documents` keyword refuses it in the forward (grad disabled inside a model call with
  grad enabled).

Under torch.compile the model is traced once, with the model call's documents: the layers bind
nothing and the mixers read the model call's documents. torch.compile together with gradient
checkpointing of a mixer's layer is refused at W > 1 (AOT autograd cannot save the mixers'
ordered exchange inside a compiled checkpoint).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch

from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import KEYWORD, Documents

WHAT = "cpattn.integrations.transformers"
_TAG = "_cpattn_binding"  # the tensor attribute that carries a layer input's binding


class Binding(NamedTuple):
    """The documents of one model call: shard_batch's `cpattn_documents` (None: rows of whole
    sequences) and whether the call got them (the whole batch of shard_batch)."""

    documents: Optional[Documents]
    passed: bool


class _Frame(NamedTuple):
    binding: Binding
    grad: bool  # grad mode when the model call started


class ModelState:
    """One parallelized model's settings and the documents of its calls in progress. A deep copy
    of the model gets a fresh one with the same settings."""

    def __init__(self, cp: ContextParallel) -> None:
        self.cp = cp
        self.frames: list[_Frame] = []  # model calls in progress (nested models: innermost last)
        self.bindings: list[Optional[Binding]] = []  # layer calls in progress

    def __deepcopy__(self, memo) -> "ModelState":
        return ModelState(self.cp)

    # --- the model's hooks (bound methods: a deep copy of the model rebinds them to its state) ---
    def enter(self, module, args, kwargs) -> None:
        """Forward pre-hook (with kwargs) of the model and the models nested in it."""
        if KEYWORD in kwargs:
            binding = Binding(kwargs[KEYWORD], True)
        elif self.frames:  # (a nested model called without them: the outer call's)
            binding = self.frames[-1].binding
        else:
            binding = Binding(None, False)
        self.frames.append(_Frame(binding, torch.is_grad_enabled()))

    def leave(self, module, args, kwargs, output) -> None:
        """Forward hook (always called, also when the forward raised)."""
        self.frames.pop()

    def binding(self) -> Optional[Binding]:
        """The documents of the layer call in progress, or None (unknown). While torch.compile
        traces, the model call's (the layers bind nothing: see layer_forward)."""
        if self.bindings:
            return self.bindings[-1]
        if torch.compiler.is_compiling() and self.frames:
            return self.frames[-1].binding
        return None

    # --- a layer's call ---------------------------------------------------------------------------
    def binding_of_call(self, layer: torch.nn.Module, args: tuple, kwargs: dict) -> \
            Optional[Binding]:
        """The documents of this call of a layer above a mixer: its own keyword; an enclosing
        layer's (or the checkpoint recompute's) binding; the model call's; else the binding its
        hidden states carry from the forward this call recomputes; else None."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if KEYWORD in kwargs:
            binding = Binding(kwargs[KEYWORD], True)
        elif self.bindings:
            binding = self.bindings[-1]
        elif self.frames:
            frame = self.frames[-1]
            if frame.grad and not torch.is_grad_enabled():
                raise ValueError(
                    f"{WHAT}: {type(layer).__name__} runs without gradients inside a forward of "
                    "its model with gradients: a reentrant torch.utils.checkpoint around it "
                    "detaches its inputs, so its recompute in backward could not know the packed "
                    "documents of this forward. Use torch.utils.checkpoint(..., "
                    "use_reentrant=False) or model.gradient_checkpointing_enable()")
            binding = frame.binding
        else:
            tag = getattr(hidden, _TAG, None)
            binding = tag[1] if tag is not None and tag[0] is self else None
        if binding is not None and isinstance(hidden, torch.Tensor) and \
                not torch.compiler.is_compiling():
            setattr(hidden, _TAG, (self, binding))  # (for a plain checkpoint's recompute)
        return binding


@dataclass
class LayerRole:
    """What a layer above a mixer needs at its call: the model's state, and the forward it had
    as an instance attribute before (None: its class's)."""

    state: ModelState
    inner: Any = field(default=None)


def layer_forward(layer: torch.nn.Module, *args, **kwargs):
    """The per-instance forward of a layer above a mixer (bound with types.MethodType): its
    own forward, with the documents of this call bound for the mixers below, in the forward
    and in a checkpoint's recompute."""
    role: LayerRole = layer.__dict__["_cpattn_layer"]
    if torch.compiler.is_compiling():
        # Traced once, with the model call's documents (ModelState.binding)
        if _checkpointing(layer) and layer.training and torch.is_grad_enabled() and \
                role.state.cp.world_size > 1:
            raise ValueError(
                f"{WHAT}: torch.compile of {type(layer).__name__} under gradient checkpointing "
                "is not supported yet (AOT autograd cannot save the mixers' exchange, an "
                "ordered collective, inside a compiled checkpoint): compile without "
                "checkpointing, or checkpoint without torch.compile")
        return _inner(role, layer, args, kwargs)
    state = role.state
    binding = state.binding_of_call(layer, args, kwargs)
    checkpoint = layer.__dict__.get("_gradient_checkpointing_func")
    if checkpoint is not None and _checkpointing(layer):
        layer._gradient_checkpointing_func = functools.partial(_checkpoint_bound, checkpoint,
                                                               state, binding)
    state.bindings.append(binding)
    try:
        return _inner(role, layer, args, kwargs)
    finally:
        state.bindings.pop()
        if checkpoint is not None and _checkpointing(layer):
            layer._gradient_checkpointing_func = checkpoint


def _checkpointing(layer: torch.nn.Module) -> bool:
    """Whether transformers' gradient checkpointing is on for the layer (this instance's)."""
    return bool(layer.__dict__.get("gradient_checkpointing", False)) and \
        "_gradient_checkpointing_func" in layer.__dict__


def _inner(role: LayerRole, layer: torch.nn.Module, args: tuple, kwargs: dict):
    """The layer's own forward: its earlier instance forward, else its class's."""
    if role.inner is not None:
        return role.inner(*args, **kwargs)
    return type(layer).forward(layer, *args, **kwargs)


def _checkpoint_bound(checkpoint, state: ModelState, binding: Optional[Binding], function,
                      *args, **kwargs):
    """transformers' checkpoint function, given a function that binds `binding` while it runs
    (the forward, and the recompute in backward)."""
    return checkpoint(functools.partial(_run_bound, state, binding, function), *args, **kwargs)


def _run_bound(state: ModelState, binding: Optional[Binding], function, *args, **kwargs):
    state.bindings.append(binding)
    try:
        return function(*args, **kwargs)
    finally:
        state.bindings.pop()
