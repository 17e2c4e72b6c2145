"""What the tests of cpattn.attention share: the masks, the dtypes and the comparison of the public
API (out, lse and gradients) with the float64 reference."""

from __future__ import annotations

import torch

import cpattn

from conftest import (
    Window,
    assert_close_baseline,
    assert_close_fp32,
    assert_close_low_out,
    reference_with_grads,
)

# name -> (causal, window)
MASKS: dict[str, tuple[bool, Window]] = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "left": (False, (16, -1)),
    "right": (False, (-1, 9)),
    "both": (False, (20, 5)),
    "zero": (False, (0, 0)),
    "causal_left": (True, (33, -1)),
}

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_public(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
    window: Window,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """cpattn.attention forward (out, lse) and the gradients of q, k, v for dout."""
    out, lse = cpattn.attention(
        q, k, v, causal=causal, window=window, softmax_scale=scale, return_lse=True
    )
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out, lse, grads


def check_against_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                            causal: bool, window: Window, scale: float | None = None) -> None:
    """Runs the public API and compares out, lse and gradients with the float64 reference."""
    dtype = q.dtype
    out, lse, (dq, dk, dv) = run_public(q, k, v, dout, causal, window, scale)
    ref = reference_with_grads(q, k, v, dout, causal=causal, window=window, scale=scale)
    r_out, r_lse, r_dq, r_dk, r_dv = ref

    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_close_fp32(lse, r_lse, "lse")  # fp32 from exactly upcast inputs, in every dtype
    if dtype == torch.float32:
        assert_close_fp32(out, r_out, "out")
        for name, got, want in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
            assert_close_fp32(got, want, name)
    else:
        base = reference_with_grads(
            q, k, v, dout, compute_dtype=dtype, causal=causal, window=window, scale=scale
        )
        assert_close_low_out(out, r_out, base[0], dtype)
        for name, got, want, low in (
            ("dq", dq, r_dq, base[2]),
            ("dk", dk, r_dk, base[3]),
            ("dv", dv, r_dv, base[4]),
        ):
            assert got.dtype == dtype
            assert_close_baseline(got, want, low, name)
