"""The checks `parallelize` runs on every rank, in the model's dtype and on its device, before it
changes anything:

- `equivalence(module, adapter)`: the adapter against the module's own forward, forward and
  backward (the output, the input's gradient and every trained parameter's), in one process
  standing in for the ranks: packed documents whose pieces are held out of order (one piece
  shorter than any convolution halo, a document in one piece, documents split in two and three
  pieces), and rows of whole sequences (the branch without summaries). "" when they agree, else
  what differed and by how much, or the exception the adapter or the forward raised.
- `token_mixing(model, mixers)`: the structural check of everything else. The model runs twice
  on a short random input that differs in its first token only, with attention made per-token
  (each query gets its own value) and the adapted mixers silenced (zeros); any submodule whose
  outputs then change at other tokens while its inputs there did not mixes tokens along the
  sequence, whatever its class is called: the model is refused, naming it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from cpattn.integrations.hybrid.registry import Adapter
from cpattn.mixers import build_piece_map, stacked
from cpattn.mixers.mixing import Mixing

# relative tolerance of a comparison in a dtype (the adapter and the module's own forward round
# differently; a changed class differs by far more)
TOLERANCE = {torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 1e-2,
             torch.bfloat16: 5e-2}
FLOOR = 1e-2  # gradients under 1 % of the largest are held to 1 % of it (cancelling sums)


def _packed_case() -> tuple[int, torch.Tensor, tuple]:
    """(rows, one rank's local order of the global tokens, the documents' bounds): documents of
    133, 19 and 40 tokens; the first in three pieces ([2, 72), [0, 2), [72, 133)), the second
    whole, the third in two, all out of order."""
    a, b, c = 0, 133, 152
    runs = [(a + 2, a + 72), (b, c), (a, a + 2), (c + 20, c + 40), (a + 72, b), (c, c + 20)]
    return 1, torch.cat([torch.arange(s, e) for s, e in runs]), (a, b, c, c + 40)


CASES = {"packed documents": _packed_case(),
         "whole sequences": (2, torch.arange(48), (0, 48))}


def equivalence(module: torch.nn.Module, adapter: Adapter) -> str:
    """"" when the adapter matches the module's own forward (see the module docstring), else
    what differed."""
    try:
        return _equivalence(module, adapter)
    except Exception as e:  # noqa: BLE001 - any failure of either side refuses, naming it
        return f"raised {type(e).__name__}: {e}"


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _input_size(module: torch.nn.Module) -> int:
    size = getattr(module, "hidden_size", None)
    if isinstance(size, int):
        return size
    return next(m.in_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def _equivalence(module: torch.nn.Module, adapter: Adapter) -> str:
    param = next(p for p in module.parameters() if p.is_floating_point())
    dtype, device = param.dtype, param.device
    tolerance = TOLERANCE.get(dtype, 1e-4)
    trained = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1234)
    own = type(module).forward
    for case, (rows, order, bounds) in CASES.items():
        x = torch.randn(rows, bounds[-1], _input_size(module), generator=gen)
        x = x.to(device, dtype).requires_grad_()
        expected = torch.cat([_first(own(module, x[:, s:e], **adapter.call))
                              for s, e in zip(bounds, bounds[1:])], 1)
        local = order.to(device)
        mix = Mixing(build_piece_map([order], bounds), 0, stacked, rows)
        got = _first(adapter.fn(module, x[:, local], mix))
        got = torch.zeros_like(got).index_copy(1, local, got)  # (back to the global order)
        differs = _differs(got, expected, tolerance, float(expected.detach().abs().max()))
        if differs:
            return f"on {case}: its output differs by {differs}"
        cotangent = torch.randn(expected.shape, generator=gen).to(device, dtype)
        inputs = [x] + [p for _, p in trained]
        names = ["the input"] + [n for n, _ in trained]
        reference = torch.autograd.grad(expected, inputs, cotangent, allow_unused=True)
        grads = torch.autograd.grad(got, inputs, cotangent, allow_unused=True)
        largest = max((float(g.abs().max()) for g in reference if g is not None), default=0.0)
        for name, g, g_ref in zip(names, grads, reference):
            if (g is None) != (g_ref is None):
                return (f"on {case}: the gradient of {name} is "
                        f"{'missing' if g is None else 'not zero'} (the module's own: "
                        f"{'none' if g_ref is None else 'some'})")
            scale = max(float(g_ref.abs().max()), FLOOR * largest) if g is not None else 0.0
            differs = _differs(g, g_ref, tolerance, scale) if g is not None else ""
            if differs:
                return f"on {case}: the gradient of {name} differs by {differs}"
    return ""


def _differs(got: torch.Tensor, expected: torch.Tensor, tolerance: float, scale: float) -> str:
    """"" when got is within tolerance * scale of expected (and finite), else the difference."""
    if got.shape != expected.shape:
        return f"its shape: {tuple(got.shape)} instead of {tuple(expected.shape)}"
    error = float((got.detach().double() - expected.detach().double()).abs().max()) \
        if got.numel() else 0.0
    if error <= tolerance * max(scale, 1e-30):
        return ""
    return f"{error:.3g} (largest {scale:.3g}, tolerance {tolerance:g} of it)"


# --- the structural check --------------------------------------------------------------------

PROBE_NAME = "cpattn_token_mixing_probe"  # the per-token attention the check runs the model with
PROBE_TOKENS = 16
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # (never called)


def _per_token_attention(module, query, key, value, attention_mask, **kwargs):
    """Each query gets the value of its own token (query (B, H, S, D), value (B, Hkv, S, Dv)):
    attention with no mixing, the shape transformers expects (B, S, H, Dv)."""
    heads = query.shape[1]
    return value.repeat_interleave(heads // value.shape[1], dim=1).transpose(1, 2), None


def _no_mask(*args, **kwargs):
    return None


def register_probe_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROBE_NAME, _per_token_attention)
    AttentionMaskInterface.register(PROBE_NAME, _no_mask)


def token_mixing(model: torch.nn.Module, mixers: list[torch.nn.Module]) -> str:
    """"" when nothing but attention and the adapted `mixers` mixes tokens in the model (see the
    module docstring), else the submodules that do, by name and class. Restores the model's
    attention implementation and training modes."""
    embeddings = model.get_input_embeddings().weight
    gen = torch.Generator().manual_seed(4321)
    x = torch.randn(1, PROBE_TOKENS, embeddings.shape[-1], generator=gen)
    y = x.clone()
    y[:, 0] = 3 * torch.randn(embeddings.shape[-1], generator=gen)
    names = {m: n for n, m in model.named_modules()}
    silenced = {m for mixer in mixers for m in mixer.modules()}
    runs: list[list] = []
    hooks = []
    adapted = set(mixers)
    for module in model.modules():
        if module in adapted:
            hooks.append(module.register_forward_hook(_silence))
        elif module not in silenced and not isinstance(module, _CONTAINERS):
            hooks.append(module.register_forward_hook(
                lambda m, args, kwargs, out: runs[-1].append((m, _token_major(
                    _first_tensor((args, kwargs))), _token_major(_first_tensor(out)))),
                with_kwargs=True))
    previous = model.config._attn_implementation
    modes = [(m, m.training) for m in model.modules()]
    register_probe_attention()
    try:
        model.set_attn_implementation(PROBE_NAME)
        model.eval()
        with torch.no_grad():
            keywords = {"use_cache": False} if _accepts(model, "use_cache") else {}
            for inputs in (x, y):
                runs.append([])
                model(inputs_embeds=inputs.to(embeddings.device, embeddings.dtype), **keywords)
    finally:
        for hook in hooks:
            hook.remove()
        for m, mode in modes:
            m.training = mode
        model.set_attn_implementation(previous)
    mixing = {names[m] for m in _mixing(runs, TOLERANCE.get(embeddings.dtype, 1e-4))}
    # the deepest ones: a module whose submodules already explain its mixing is not named
    deepest = sorted(n for n in mixing if not any(_inside(o, n) for o in mixing))
    return ", ".join(f"{n or 'the model itself'} ({type(model.get_submodule(n)).__name__})"
                     for n in deepest)


def _inside(name: str, outer: str) -> bool:
    """Whether the module named `name` lies strictly inside the one named `outer` ("": the
    model)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _accepts(model: torch.nn.Module, keyword: str) -> bool:
    parameters = inspect.signature(type(model).forward).parameters
    return keyword in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                        for p in parameters.values())


def _silence(module, args, output):
    """The adapted mixer's output as zeros (per token), whatever its structure."""
    if isinstance(output, torch.Tensor):
        return torch.zeros_like(output)
    if isinstance(output, tuple):
        return tuple(_silence(module, args, o) for o in output)
    return output


def _first_tensor(value: Any):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
        return None
    values = getattr(value, "values", None)  # (transformers' ModelOutput)
    return _first_tensor(list(values())) if callable(values) else None


def _mixing(runs: list[list], tolerance: float) -> list[torch.nn.Module]:
    """The modules whose output changed at tokens after the first while their input there did
    not (tensors of shape (1, tokens, ...))."""
    found = []
    for (module, a_in, a_out), (other, b_in, b_out) in zip(*runs):
        if module is not other:
            break
        if any(t is None for t in (a_in, a_out, b_in, b_out)):
            continue
        if _same_after_first(a_in, b_in, tolerance) and \
                not _same_after_first(a_out, b_out, tolerance):
            found.append(module)
    return found


def _token_major(t):
    """t if it is a (1, tokens, ...) floating tensor (kept for the comparison), else None."""
    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == 1 and \
            t.shape[1] == PROBE_TOKENS and t.is_floating_point():
        return t
    return None


def _same_after_first(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    a, b = a[:, 1:].double(), b[:, 1:].double()
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return float((a - b).abs().max()) <= tolerance * scale
