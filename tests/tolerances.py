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
# A fixed bound for a low-precision run whose reference is not yet computed in the low dtype
# (test_ulysses_backward's loss through the LSE); 15-60 % of a typical output: loose.
FIXED_LOW = 3e-2
# A low-precision result may be off by this times torch's own error in that dtype.
LOW_PRECISION_MARGIN = 2.0


@dataclass(frozen=True)
class Bound:
    atol: float
    rtol: float


class Tolerance:
    """Bounds per compared tensor: "out", "lse", "dq", "dk", "dv", "dsinks"."""

    def __init__(self, bounds: dict[str, Bound] | None = None, grad_factor: float = 1.0) -> None:
        self._bounds = bounds  # None: FP32 for out, scaled for gradients
        self._grad_factor = grad_factor

    def bound(self, name: str, expected: torch.Tensor) -> Bound:
        if self._bounds is not None and name != "lse":
            return self._bounds[name]
        if name == "lse":
            return Bound(FP32, FP32)
        if name == "out":
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


def allowed_low_precision_error(torch_error: float, slack: float) -> float:
    """The largest error a bf16 / fp16 result may have: LOW_PRECISION_MARGIN times torch's own
    error in that dtype on the same problem, plus an fp32-sized slack."""
    return LOW_PRECISION_MARGIN * torch_error + slack


def _largest_error(low: torch.Tensor, expected: torch.Tensor) -> float:
    finite = expected.isfinite()
    if not finite.any():
        return 0.0
    return (low.detach().double()[finite] - expected.detach().double()[finite]).abs().max().item()


def _size(t: torch.Tensor) -> float:
    finite = t[t.isfinite()]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def expected_of(out: torch.Tensor, lse: torch.Tensor, grads, dsinks=None) -> dict:
    """A run's results by the names Tolerance checks."""
    named = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if dsinks is not None:
        named["dsinks"] = dsinks
    return named


def low_precision_run(inputs: tuple, **reference_options) -> dict[str, torch.Tensor]:
    """torch's own attention on inputs (q, k, v, dout) in their dtype (reference_attention
    computed in that dtype), forward and gradients, by name."""
    q, k, v, dout = inputs
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    sinks = reference_options.pop("sinks", None)
    if sinks is not None:
        sinks = sinks.detach().to(q.dtype).requires_grad_()
    out, lse = reference_attention(*leaves, compute_dtype=q.dtype, sinks=sinks,
                                   **reference_options)
    out.backward(dout.to(q.dtype))
    return expected_of(out, lse, [t.grad for t in leaves], None if sinks is None else sinks.grad)


def tolerance(expected: dict[str, torch.Tensor], low: dict[str, torch.Tensor] | None = None,
              grad_factor: float = 1.0) -> Tolerance:
    """The tolerance for a run whose float64 results are `expected` (by name: out, lse, dq, dk,
    dv and, with sinks, dsinks). low: the same problem computed by torch in the run's low dtype
    (low_precision_run); None for fp32 runs, whose gradient bound grad_factor widens (long
    sums)."""
    if low is None:
        return Tolerance(grad_factor=grad_factor)
    bounds = {name: Bound(allowed_low_precision_error(_largest_error(low[name], want),
                                                      FP32 * _size(want)), 0.0)
              for name, want in expected.items() if name != "lse"}
    return Tolerance(bounds)


def dense_tolerance(inputs: tuple, expected: dict[str, torch.Tensor], grad_factor: float = 1.0,
                    **reference_options) -> Tolerance:
    """tolerance() for a run on inputs (q, k, v, dout), one sequence per batch row;
    reference_options go to reference_attention (causal, window, sinks, softcap, ...) so that
    torch's own low-precision run is the same problem."""
    if inputs[0].dtype == torch.float32:
        return tolerance(expected, grad_factor=grad_factor)
    return tolerance(expected, low_precision_run(inputs, **reference_options))


# ---------------------------------------------------------------------------------------------
# The local kernel: one process against the float64 reference

# Unit roundoff of each dtype (half the distance from 1 to the next number).
UNIT_ROUNDOFF = {
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
# Absolute error allowed for fp32 work on unit-normal inputs (relative to the size of the values).
FP32_ATOL = 1e-4

def fp32_atol(expected: torch.Tensor) -> float:
    """fp32 absolute tolerance, relative to the size of the values (1e-4 for unit-sized ones)."""
    finite = expected[torch.isfinite(expected)]
    size = finite.abs().max().item() if finite.numel() else 0.0
    return FP32_ATOL * max(1.0, size)


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor, name: str = "") -> None:
    """actual (any float dtype) equals the float64 expected to fp32 accuracy; infs must match."""
    a = actual.detach().double()
    e = expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{name}: NaN in result"
    inf_e, inf_a = torch.isinf(e), torch.isinf(a)
    assert torch.equal(inf_a, inf_e), f"{name}: inf positions differ"
    assert torch.equal(a[inf_a], e[inf_e]), f"{name}: inf signs differ"
    err = (a - e).masked_fill(inf_e, 0.0).abs().max().item() if a.numel() else 0.0
    tol = fp32_atol(e)
    assert err <= tol, f"{name}: max abs error {err:.3g} > {tol:.3g}"


def assert_close_rounded(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str = ""
) -> None:
    """actual is expected computed in fp32 then rounded once to dtype: per element,
    |actual - expected| <= 2 * u(dtype) * |expected| + fp32 tolerance (a 2x margin on rounding).
    """
    if dtype == torch.float32:
        assert_close_fp32(actual, expected, name)
        return
    a = actual.detach().double()
    e = expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values in result"
    bound = 2 * UNIT_ROUNDOFF[dtype] * e.abs() + fp32_atol(e)
    excess = ((a - e).abs() - bound).max().item()
    assert excess <= 0, f"{name}: error exceeds the rounding bound by {excess:.3g}"


def assert_close_baseline(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor,
    name: str = "",
) -> None:
    """actual's max error vs the float64 expected is within allowed_low_precision_error of torch's
    own computation in the low dtype (baseline) (flash-attn's criterion).
    """
    a = actual.detach().double()
    e = expected.detach().double()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), f"{name}: non-finite values in result"
    err = (a - e).abs().max().item()
    base_err = (baseline.detach().double() - e).abs().max().item()
    tol = allowed_low_precision_error(base_err, fp32_atol(e))
    assert err <= tol, (f"{name}: max error {err:.3g} > {LOW_PRECISION_MARGIN:g} * torch's "
                        f"{base_err:.3g} + slack")


def assert_close_low_out(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor,
    dtype: torch.dtype,
    name: str = "out",
) -> None:
    """A forward output from bf16/fp16 inputs. fp16 (computed in fp32 from exactly upcast inputs)
    must be within twice its rounding; bf16 may use bf16 dot products with the probabilities
    rounded to bf16 (as flash-attn on GPUs), so it must be within 2x torch's own bf16 error
    (baseline: the computation done in bf16), the rule of issue 7."""
    if dtype == torch.bfloat16:
        assert_close_baseline(actual, expected, baseline, name)
    else:
        assert_close_rounded(actual, expected, dtype, name)
