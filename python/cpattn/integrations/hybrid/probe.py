"""The checks `parallelize` runs on every rank, in the model's dtype and on its device, before it
changes anything:

- `equivalence(module, adapter)`: the adapter against the module's own forward, forward and
  backward (the output, the input's gradient and every trained parameter's), in one process
  standing in for the ranks: packed documents whose pieces are held out of order (one piece
  shorter than any convolution halo, a document in one piece, documents split in two and three
  pieces), and rows of whole sequences (the branch without summaries). "" when they agree (within
  the dtype's tolerance, or, beyond it, no farther from a float64 run of the module than
  TRUTH_FACTOR x the module's own run: rounding, where the module's own may be the less precise),
  else what differed and by how much, or the exception the adapter or the forward raised.
- `token_mixing(model, mixers)`: the structural check of everything else. The model runs twice
  on a short random input that differs in its first token only, with attention made per-token
  (each query gets its own value) and the adapted mixers silenced (zeros); any submodule whose
  outputs then change at other tokens while its inputs there did not mixes tokens along the
  sequence, whatever its class is called: the model is refused, naming it. The k-th calls of
  each module in the two runs are compared; a module called a different number of times with
  token tensors (control flow that depends on the tokens' values) cannot be compared that way:
  the model is refused too (`Unpaired`), naming it.
"""

from __future__ import annotations

import copy
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
TRUTH_FACTOR = 4.0  # beyond the tolerance: at most this x the module's own distance from float64


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
    what differed. Runs with gradients whatever the caller's mode (parallelize is often called
    under torch.no_grad or inference_mode, right after loading)."""
    try:
        with torch.inference_mode(False), torch.enable_grad():
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
    for case, (rows, order, bounds) in CASES.items():
        x = torch.randn(rows, bounds[-1], _input_size(module), generator=gen)
        x = x.to(device, dtype).requires_grad_()
        expected = _own_forward(module, adapter, x, bounds)
        local = order.to(device)
        mix = Mixing(build_piece_map([order], bounds), 0, stacked, rows)
        got = _first(adapter.fn(module, x[:, local], mix))
        got = torch.zeros_like(got).index_copy(1, local, got)  # (back to the global order)
        cotangent = torch.randn(expected.shape, generator=gen).to(device, dtype)
        truth = _Truth(module, adapter, x, bounds, cotangent, trained)
        differs = _differs(got, expected, tolerance, float(expected.detach().abs().max()))
        if differs and not truth.as_close_as_own(0, got, expected):
            return f"on {case}: its output differs by {differs}{truth.say(0, got, expected)}"
        inputs = [x] + [p for _, p in trained]
        names = ["the input"] + [n for n, _ in trained]
        reference = torch.autograd.grad(expected, inputs, cotangent, allow_unused=True)
        grads = torch.autograd.grad(got, inputs, cotangent, allow_unused=True)
        largest = max((float(g.abs().max()) for g in reference if g is not None), default=0.0)
        for i, (name, g, g_ref) in enumerate(zip(names, grads, reference)):
            if (g is None) != (g_ref is None):
                return (f"on {case}: the gradient of {name} is "
                        f"{'missing' if g is None else 'not zero'} (the module's own: "
                        f"{'none' if g_ref is None else 'some'})")
            scale = max(float(g_ref.abs().max()), FLOOR * largest) if g is not None else 0.0
            differs = _differs(g, g_ref, tolerance, scale) if g is not None else ""
            if differs and not truth.as_close_as_own(1 + i, g, g_ref):
                return (f"on {case}: the gradient of {name} differs by {differs}"
                        f"{truth.say(1 + i, g, g_ref)}")
    return ""


def _own_forward(module: torch.nn.Module, adapter: Adapter, x: torch.Tensor,
                 bounds: tuple) -> torch.Tensor:
    """The module's own forward, one document at a time."""
    own = type(module).forward
    return torch.cat([_first(own(module, x[:, s:e], **adapter.call))
                      for s, e in zip(bounds, bounds[1:])], 1)


class _Truth:
    """The module's own forward and backward in float64 on a copy (made on first use): where the
    adapter and the module's own run differ by more than the tolerance, the adapter is still
    accepted when it is no farther from this truth than TRUTH_FACTOR x the module's own run (its
    rounding in the model's dtype, not a different computation)."""

    def __init__(self, module, adapter, x, bounds, cotangent, trained):
        self.args = module, adapter, x, bounds, cotangent, trained
        self.values = None

    def _compute(self) -> list:
        module, adapter, x, bounds, cotangent, trained = self.args
        if self.values is None:
            exact = copy.deepcopy(module).to(torch.float64)
            params = dict(exact.named_parameters())
            x64 = x.detach().double().requires_grad_()
            out = _own_forward(exact, adapter, x64, bounds)
            inputs = [x64] + [params[n] for n, _ in trained]
            grads = torch.autograd.grad(out, inputs, cotangent.double(), allow_unused=True)
            self.values = [out.detach()] + list(grads)
        return self.values

    def distances(self, index: int, got: torch.Tensor, own: torch.Tensor) -> tuple:
        truth = self._compute()[index]
        if truth is None:
            return float("inf"), 0.0
        return (float((got.detach().double() - truth).abs().max()),
                float((own.detach().double() - truth).abs().max()))

    def as_close_as_own(self, index: int, got: torch.Tensor, own: torch.Tensor) -> bool:
        if got.dtype == torch.float64 or got.shape != own.shape:
            return False
        mine, theirs = self.distances(index, got, own)
        return mine <= TRUTH_FACTOR * theirs

    def say(self, index: int, got: torch.Tensor, own: torch.Tensor) -> str:
        if got.dtype == torch.float64 or got.shape != own.shape:
            return ""
        mine, theirs = self.distances(index, got, own)
        return (f"; from a float64 run of the module {mine:.3g}, the module's own run "
                f"{theirs:.3g} ({TRUTH_FACTOR:g}x allowed)")


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
    found, unpaired = compare_runs(runs, TOLERANCE.get(embeddings.dtype, 1e-4))
    if unpaired:
        raise Unpaired(", ".join(f"{names[m] or 'the model itself'} ({type(m).__name__}: "
                                 f"{a} and {b} calls)" for m, (a, b) in unpaired.items()))
    mixing = {names[m] for m in found}
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


class Unpaired(ValueError):
    """The two runs of the structural check called some module with token tensors a different
    number of times (its text: those modules, with their counts)."""


def compare_runs(runs: list[list], tolerance: float) -> tuple[list, dict]:
    """(the modules whose output changed at tokens after the first while their input there did
    not, in a k-th call of the module in both runs (tensors of shape (1, tokens, ...)); the
    modules with token tensors called a different number of times in the two runs, with their
    two counts)."""
    calls: list[dict] = [{}, {}]
    for run, by_module in zip(runs, calls):
        for module, t_in, t_out in run:
            by_module.setdefault(module, []).append((t_in, t_out))
    found, unpaired = [], {}
    for module in dict.fromkeys([*calls[0], *calls[1]]):  # (in call order: the same text)
        a_calls, b_calls = calls[0].get(module, []), calls[1].get(module, [])
        if len(a_calls) != len(b_calls):
            if any(t is not None for call in a_calls + b_calls for t in call):
                unpaired[module] = (len(a_calls), len(b_calls))
            continue
        for (a_in, a_out), (b_in, b_out) in zip(a_calls, b_calls):
            if any(t is None for t in (a_in, a_out, b_in, b_out)):
                continue
            if _same_after_first(a_in, b_in, tolerance) and \
                    not _same_after_first(a_out, b_out, tolerance):
                found.append(module)
                break
    return found, unpaired


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
