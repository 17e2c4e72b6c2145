"""How close a context-parallel run must come to the float64 reference: the one home of the
tests' tolerances for sharded runs.

fp32: within FP32, absolute and relative (a gradient's absolute bound scaled by its largest
element, times a factor the test names): the ranks sum in another order than one process does,
nothing more.

LSE: within FP32 in every dtype (cpattn returns it in fp32, from scores summed in fp32).

bf16 / fp16 outputs and gradients: within twice torch's own error in that dtype on the same
problem (the reference computed in the low dtype, cpattn.testing.reference), plus the fp32
allowance: the rule conftest.assert_close_low_out states for the local kernel, here for every
compared tensor. A fixed bf16 tolerance (3e-2 was used) is 15-60 % of a typical attention output
and lets real errors through.
"""

from dataclasses import dataclass

import torch

from cpattn.testing.reference import reference_attention

FP32 = 2e-5
# A low-precision result may be off by this times torch's own error in that dtype.
LOW_PRECISION_MARGIN = 2.0


@dataclass(frozen=True)
class Bound:
    atol: float
    rtol: float


class Tolerance:
    """Bounds per compared tensor: "out", "lse", "dq", "dk", "dv", "dsinks"."""

    def __init__(self, bounds: dict[str, Bound] | None = None, grad_factor: float = 1.0) -> None:
        self._bounds = bounds  # None: fp32
        self._grad_factor = grad_factor

    def bound(self, name: str, expected: torch.Tensor) -> Bound:
        if self._bounds is not None and name != "lse":
            return self._bounds[name]
        if name in ("out", "lse"):
            return Bound(FP32, FP32)
        scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
        return Bound(self._grad_factor * FP32 * scale, self._grad_factor * FP32)

    def check(self, name: str, got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        """got (any dtype) against the float64 expected; -inf entries must match exactly."""
        expected = expected.detach().double()
        got = got.detach().double()
        finite = expected.isfinite()
        assert torch.equal(got.isfinite(), finite), f"{name} {what}: non-finite entries differ"
        assert torch.equal(got[~finite], expected[~finite]), f"{name} {what}: infinities differ"
        b = self.bound(name, expected[finite])
        torch.testing.assert_close(got[finite], expected[finite], atol=b.atol, rtol=b.rtol,
                                   msg=lambda m: f"{name} {what}: {m}")


def _largest_error(low: torch.Tensor, expected: torch.Tensor) -> float:
    finite = expected.isfinite()
    if not finite.any():
        return 0.0
    return (low.detach().double()[finite] - expected.detach().double()[finite]).abs().max().item()


def _size(t: torch.Tensor) -> float:
    finite = t[t.isfinite()]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def tolerance(inputs: tuple, expected: dict[str, torch.Tensor], grad_factor: float = 1.0,
              **reference_options) -> Tolerance:
    """The tolerance for a run on inputs (q, k, v, dout) in their dtype, whose float64 results are
    `expected` (by name: out, lse, dq, dk, dv and, with sinks, dsinks). grad_factor widens fp32's
    gradient bound (long sums); reference_options go to reference_attention (causal, window,
    sinks, softcap, ...) so that torch's own low-precision run is the same problem."""
    q, k, v, dout = inputs
    if q.dtype == torch.float32:
        return Tolerance(grad_factor=grad_factor)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sinks = reference_options.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().to(q.dtype).requires_grad_()
    out, lse = reference_attention(*leaves, compute_dtype=q.dtype, sinks=sinks,
                                   **reference_options)
    out.backward(dout.to(q.dtype))
    low = {"out": out, "lse": lse, "dq": leaves[0].grad, "dk": leaves[1].grad,
           "dv": leaves[2].grad}
    if sinks is not None:
        low["dsinks"] = sinks.grad
    bounds = {name: Bound(LOW_PRECISION_MARGIN * _largest_error(low[name], want)
                          + FP32 * _size(want), 0.0)
              for name, want in expected.items() if name != "lse"}
    return Tolerance(bounds)
