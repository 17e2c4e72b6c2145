"""The sharded runs' tolerances (tests/tolerances.py) accept cpattn's own results and reject a
result just outside them: a bound that cannot fail is no test."""

import pytest
import torch

import cpattn

from conftest import randn, reference_attention
from tolerances import FP32, dense_tolerance, expected_of


def _problem(gen, dtype):
    q, k, v, dout = (randn((1, 48, 4, 32), gen, dtype) for _ in range(4))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = reference_attention(*leaves, causal=True)
    out.backward(dout.double())
    return (q, k, v, dout), expected_of(out, lse, [t.grad for t in leaves])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bounds_accept_cpattn_and_reject_just_outside(gen, dtype):
    inputs, expected = _problem(gen, dtype)
    tol = dense_tolerance(inputs, expected, causal=True)
    leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    out, lse = cpattn.attention(*leaves, causal=True, return_lse=True)
    out.backward(inputs[3])
    got = expected_of(out, lse, [t.grad for t in leaves])
    for name, want in expected.items():
        tol.check(name, got[name], want, dtype)
        bound = tol.bound(name, want)
        off = got[name].detach().double().contiguous()
        first = want.detach().reshape(-1)[0].item()
        off.view(-1)[0] = first + 1.5 * (bound.atol + bound.rtol * abs(first))
        with pytest.raises(AssertionError, match=name):
            tol.check(name, off, want, dtype)
    if dtype == torch.bfloat16:  # derived from torch's own bf16 error: wider than fp32's
        assert tol.bound("out", expected["out"]).atol > 10 * FP32
        assert tol.bound("lse", expected["lse"]).atol == FP32  # cpattn's LSE is fp32
