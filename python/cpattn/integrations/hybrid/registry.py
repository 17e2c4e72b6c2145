"""The adapters of the token-mixer classes, registered next to their code (`adapters.py`): one
line per class, keyed by the class's transformers module and name.

An adapter is the module's forward written against its own submodules and parameters, with the
convolution and the recurrence replaced by cpattn.mixers' primitives on this rank's pieces.
`adapter_of(module)` finds the adapter of a module's class (or of a class it derives from, such as
the class FSDP2 makes); a module without one is not a mixer cpattn knows (the structural check of
`probe.token_mixing` refuses it if it mixes tokens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from cpattn.mixers.mixing import Mixing

# adapter(module, hidden_states (B, L, hidden), mixing) -> what the module's forward returns
AdapterFn = Callable[[torch.nn.Module, torch.Tensor, Mixing], Any]


@dataclass(frozen=True)
class Adapter:
    """fn: the adapter; call: keywords the module's own forward needs besides hidden_states when
    the probe calls it (MiniMax's lightning attention takes position_embeddings and
    attention_mask positionally)."""

    fn: AdapterFn
    call: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.fn.__name__

    def __deepcopy__(self, memo) -> "Adapter":  # (stateless: a copied model shares it)
        return self


# "transformers.models.<family>.modeling_<family>.<Class>" -> its adapter
ADAPTERS: dict[str, Adapter] = {}


def adapts(*classes: str, **call) -> Callable[[AdapterFn], AdapterFn]:
    """Registers the decorated function as the adapter of each class, given as
    "<family>.<Class>" (transformers.models.<family>.modeling_<family>.<Class>). call: as
    Adapter.call."""
    def register(fn: AdapterFn) -> AdapterFn:
        for spelled in classes:
            family, _, name = spelled.partition(".")
            key = f"transformers.models.{family}.modeling_{family}.{name}"
            if key in ADAPTERS:
                raise RuntimeError(f"cpattn: two adapters for {key}")
            ADAPTERS[key] = Adapter(fn, dict(call))
        return fn
    return register


def adapter_of(module: torch.nn.Module) -> Optional[Adapter]:
    """The adapter registered for the module's class or the nearest class it derives from, or
    None."""
    for cls in type(module).__mro__:
        found = ADAPTERS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            return found
    return None
