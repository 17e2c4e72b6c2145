"""`parallelize(model, cp, name)`: makes one model instance context-parallel, and the handle that
undoes it. Public through cpattn.integrations.transformers.parallelize (which registers `name`).

What it changes, on this instance only (nothing process-wide, no class touched):
- its attention implementation becomes `name` (cpattn's attention for cp), in its own copy of
  its config objects (transformers keeps the implementation there, and models built from one
  config object share it); remove() puts the originals back;
- each token-mixer module with an adapter (registry.py) gets a per-instance forward
  (types.MethodType, so that copy.deepcopy rebinds it to the copy) running the adapter on this
  rank's pieces (forward.py);
- each layer above a mixer gets a per-instance forward binding the documents of its call, and the
  model (and each model nested in it) a forward pre-hook and hook recording them
  (documents.py);
- the handle is kept on the model (`model._cpattn_parallel`), so a deep copy carries its own.

Before that, on every rank, in the model's dtype and device: the parameters must be real tensors
(not DTensors of FSDP2 / tensor parallelism, not on the meta device: parallelize before
fully_shard, after loading the weights); one module of each mixer class is checked against its own
forward, forward and backward; the model is checked structurally for token mixing that has no
adapter (probe.py). Any refusal raises the same ValueError on every rank.
"""

from __future__ import annotations

import copy
import types
from typing import Optional

import torch

from cpattn.integrations._model_checks import agree
from cpattn.integrations.hybrid import adapters  # noqa: F401 - registers the adapters
from cpattn.integrations.hybrid.documents import LayerRole, ModelState, layer_forward
from cpattn.integrations.hybrid.forward import MixerRole, mixer_forward, positional_parameters
from cpattn.integrations.hybrid.probe import equivalence, token_mixing
from cpattn.integrations.hybrid.registry import adapter_of
from cpattn.mixers.sharded import check_settings
from cpattn.parallel import ContextParallel

WHAT = "cpattn.integrations.transformers.parallelize"


class ParallelHandle:
    """What parallelize changed on one model instance; `remove()` restores it (its own config
    objects and forwards: the same outputs, bitwise). A deep copy of the model holds its own
    handle (`handle_of(copy)`)."""

    def __init__(self, model: torch.nn.Module, state: ModelState, name: str) -> None:
        self.model, self.state, self.name = model, state, name
        self.configs: list[tuple[torch.nn.Module, str, object]] = []  # (module, attribute, old)
        self.forwards: list[tuple[torch.nn.Module, str, object]] = []  # (module, role, old)
        self.hooks: list = []

    @property
    def cp(self) -> ContextParallel:
        return self.state.cp

    @property
    def mixers(self) -> list[torch.nn.Module]:
        """The parallelized token-mixer modules."""
        return [m for m, role, _ in self.forwards if role == "_cpattn_mixer"]

    def own_configs(self) -> None:
        """Gives the model its own copy of its config objects: transformers keeps the attention
        implementation in the config, which from_config shares between the models built from
        one config object (the probes and `name` must change this instance only)."""
        from transformers import PretrainedConfig

        memo: dict = {}
        copy.deepcopy(self.model.config, memo)  # (its sub-configs with it)
        for module in self.model.modules():
            for attribute, value in list(vars(module).items()):
                if isinstance(value, PretrainedConfig):
                    mine = memo.get(id(value))
                    module.__dict__[attribute] = mine if mine is not None else \
                        copy.deepcopy(value, memo)
                    self.configs.append((module, attribute, value))

    def install(self, mixers: list[torch.nn.Module], layers: list[torch.nn.Module]) -> None:
        from transformers import PreTrainedModel

        self.model.set_attn_implementation(self.name)
        if self.model.config._attn_implementation != self.name:
            raise RuntimeError(f"{WHAT}: {type(self.model).__name__} did not take the attention "
                               f"implementation {self.name!r}")
        for module, role in [(m, "_cpattn_layer") for m in layers] + \
                            [(m, "_cpattn_mixer") for m in mixers]:
            old = module.__dict__.get("forward")  # (an instance forward of its own, or None)
            if role == "_cpattn_mixer":
                value = MixerRole(self.state, adapter_of(module), positional_parameters(module))
                forward = mixer_forward
            else:
                value = LayerRole(self.state, old)
                forward = layer_forward
            module.__dict__[role] = value
            module.forward = types.MethodType(forward, module)
            self.forwards.append((module, role, old))
        for module in self.model.modules():
            if isinstance(module, PreTrainedModel):
                self.hooks.append(module.register_forward_pre_hook(self.state.enter,
                                                                   with_kwargs=True))
                self.hooks.append(module.register_forward_hook(self.state.leave,
                                                               with_kwargs=True,
                                                               always_call=True))
        self.model.__dict__["_cpattn_parallel"] = self

    def remove(self) -> None:
        """Restores the model instance as it was before parallelize (its config objects, its
        modules' forwards, no hooks)."""
        if self.model.__dict__.get("_cpattn_parallel") is not self:
            raise ValueError(f"{WHAT}: this handle was removed already")
        for module, role, old in reversed(self.forwards):
            del module.__dict__["forward"]
            del module.__dict__[role]
            if old is not None:
                module.forward = old
        for hook in self.hooks:
            hook.remove()
        self.restore_configs()
        self.forwards, self.hooks = [], []
        del self.model.__dict__["_cpattn_parallel"]

    def restore_configs(self) -> None:
        for module, attribute, old in reversed(self.configs):
            module.__dict__[attribute] = old
        self.configs = []


def handle_of(model: torch.nn.Module) -> Optional[ParallelHandle]:
    """The handle of a parallelized model instance (also of a deep copy of one), else None."""
    return model.__dict__.get("_cpattn_parallel")


def parallelize(model: torch.nn.Module, cp: ContextParallel, name: str) -> ParallelHandle:
    """See the module docstring. `name`: the attention implementation registered for cp."""
    if not isinstance(model, torch.nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"{WHAT}: model must be a transformers PreTrainedModel, got "
                        f"{type(model).__name__}")
    if handle_of(model) is not None:
        raise ValueError(f"{WHAT}: this model is parallelized already (a copy of a parallelized "
                         "model is too): call remove() on its handle first "
                         "(cpattn.integrations.transformers.handle_of(model))")
    mixers = [m for m in model.modules() if adapter_of(m) is not None]

    def check():
        if mixers:
            check_settings(cp, WHAT)
        _check_parameters(model)
        for module in _one_per_class(mixers):
            refusal = verdict(module)
            if refusal:
                raise ValueError(refusal)
        try:
            mixing = token_mixing(model, mixers)
        except Exception as e:  # noqa: BLE001 - refused, with the reason, on every rank
            raise ValueError(f"{WHAT}: the check that nothing but attention and the adapted "
                             f"mixers mixes tokens could not run {type(model).__name__} on a "
                             f"short input ({type(e).__name__}: {e}); cpattn refuses a model "
                             "it cannot check") from e
        if mixing:
            raise ValueError(
                f"{WHAT}: {type(model).__name__} mixes tokens along the sequence outside "
                f"attention in {mixing}, which has no cpattn adapter: under context parallelism "
                "it would see each rank's shard only, so cpattn refuses the model")

    handle = ParallelHandle(model, ModelState(cp), name)
    handle.own_configs()
    try:
        agree(cp, WHAT, check)
        handle.install(mixers, _layers_above(model, mixers))
    except BaseException:
        handle.restore_configs()
        raise
    return handle


def _check_parameters(model: torch.nn.Module) -> None:
    """Raises ValueError for parameters the checks cannot run on (the same on every rank)."""
    from torch.distributed.tensor import DTensor

    for n, p in model.named_parameters():
        if isinstance(p, DTensor):
            raise ValueError(f"{WHAT}: parameter {n} is a DTensor (FSDP2's fully_shard or tensor "
                             "parallelism): call parallelize before sharding the model (the "
                             "parallelized model is then sharded as usual)")
        if p.device.type == "meta":
            raise ValueError(f"{WHAT}: parameter {n} is on the meta device: load the weights "
                             "(or materialize the model) before parallelize")


def _one_per_class(mixers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The first module of each mixer class (the modules of one class share its code and the
    model's config)."""
    seen, first = set(), []
    for m in mixers:
        if type(m) not in seen:
            seen.add(type(m))
            first.append(m)
    return first


def verdict(module: torch.nn.Module) -> str:
    """"" when the adapter of the mixer `module` matches the module's own forward (probe.py),
    else the refusal: the class, its adapter, the transformers version, the dtype and what
    differed (or the exception raised)."""
    import transformers

    differs = equivalence(module, adapter_of(module))
    if not differs:
        return ""
    dtype = next(p.dtype for p in module.parameters())
    return (f"{WHAT}: cpattn's exact version of {type(module).__name__} "
            f"({adapter_of(module).name}) checked against the module's own forward "
            f"(transformers {transformers.__version__}, {dtype}, one process): {differs}; "
            "cpattn refuses the model under context parallelism (it would not train the same "
            "model)")


def _layers_above(model: torch.nn.Module, mixers: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The modules between the model and the mixers (exclusive of both ends, of containers and
    of nested models): each binds the documents of its call."""
    from transformers import PreTrainedModel

    modules = dict(model.named_modules())
    names = {m: n for n, m in modules.items()}
    above: dict[str, torch.nn.Module] = {}
    for mixer in mixers:
        parts = names[mixer].split(".")
        for i in range(1, len(parts)):
            prefix = ".".join(parts[:i])
            if not isinstance(modules[prefix], (PreTrainedModel, torch.nn.ModuleList,
                                                torch.nn.ModuleDict)):
                above[prefix] = modules[prefix]
    return list(above.values())
