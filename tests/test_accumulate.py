"""The backward adding into given gradients (the ring's and the all-gather's step: no temporary
per sub-problem), and dQ kept as split fp32 sums beside a bf16 result (high halves in the result,
low halves apart, rounded in place at the end): torch.ops.cpattn_testing.attention_bwd_add and
round_split_, against the backward that returns new gradients."""

from __future__ import annotations

import pytest
import torch

from conftest import make_qkv, randn

ops = torch.ops.cpattn
testing = torch.ops.cpattn_testing

CASES = [  # (batch, Sq, Sk, heads, kv heads, D, causal)
    (1, 700, 700, 4, 2, 64, True),  # several query chunks
    (2, 90, 130, 2, 1, 128, False),  # batch 2, more keys than queries
    (1, 70, 20, 3, 3, 40, True),  # empty rows; D not a multiple of 16 (sums apart, then added)
]
IDS = ["chunks", "batch2", "empty_rows_d40"]


def _problem(gen, case, dtype):
    b, sq, sk, h, hkv, d, causal = case
    q, k, v = make_qkv(gen, b, sq, sk, h, hkv, d, dtype=dtype)
    out, lse = ops.attention_fwd(q, k, v, softmax_scale=d**-0.5, causal=causal)
    return q, k, v, out, lse, d**-0.5, causal


@pytest.mark.parametrize("grouped", [False, True], ids=["one_call", "per_kv_head"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_split_dq_sums_are_fp32_sums(case, grouped, gen, request) -> None:
    """Bitwise: two backward calls adding dQ into split sums, rounded at the end, give the bf16
    rounding of the same calls adding into fp32 dQ; dK and dV are fp32 sums either way."""
    if grouped:
        request.getfixturevalue("one_kv_head_per_backward_call")
    q, k, v, out, lse, scale, causal = _problem(gen, case, torch.bfloat16)
    douts = [randn(q.shape, gen, torch.bfloat16) for _ in range(2)]
    f32 = dict(dtype=torch.float32)
    high, low = torch.zeros_like(q), torch.zeros(q.shape, dtype=torch.int16)
    wide = torch.zeros(q.shape, **f32)
    dk_a, dv_a, dk_b, dv_b = (torch.zeros(k.shape, **f32) for _ in range(4))
    for dout in douts:
        testing.attention_bwd_add(high, low, dk_a, dv_a, dout, q, k, v, out, lse, scale, causal)
        testing.attention_bwd_add(wide, None, dk_b, dv_b, dout, q, k, v, out, lse, scale, causal)
    # before rounding, the halves joined are the fp32 sums themselves
    joined = (high.view(torch.int16).to(torch.int32) << 16) | (low.to(torch.int32) & 0xFFFF)
    assert torch.equal(joined.view(torch.float32), wide)
    testing.round_split_(high, low)
    assert torch.equal(high, wide.to(torch.bfloat16))
    assert torch.equal(dk_a, dk_b) and torch.equal(dv_a, dv_b)
    assert wide.abs().sum() > 0 and dk_a.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_adds_the_gradients(case, dtype, gen) -> None:
    """Into random fp32 gradients: each becomes what it held plus the backward's new gradient (dQ
    bitwise when it held zeros: the same products, scaled the same way; dK / dV within fp32
    rounding, scaled block by block rather than once)."""
    q, k, v, out, lse, scale, causal = _problem(gen, case, dtype)
    dout = randn(q.shape, gen, dtype)
    fresh = ops.attention_bwd(dout, q, k, v, out, lse, None, None, torch.float32,
                              softmax_scale=scale, causal=causal)
    held = [randn(t.shape, gen) for t in (q, k, v)]
    grads = [t.clone() for t in held]
    testing.attention_bwd_add(grads[0], None, *grads[1:], dout, q, k, v, out, lse, scale, causal)
    for name, got, before, new in zip(("dq", "dk", "dv"), grads, held, fresh):
        torch.testing.assert_close(got, before + new, rtol=1e-5, atol=1e-5, msg=name)
    dq = torch.zeros(q.shape)
    testing.attention_bwd_add(dq, None, torch.zeros(k.shape), torch.zeros(v.shape), dout, q, k, v,
                              out, lse, scale, causal)
    assert torch.equal(dq, fresh[0])


def test_bad_targets_raise(gen) -> None:
    q, k, v, out, lse, scale, causal = _problem(gen, CASES[1], torch.bfloat16)
    dout = randn(q.shape, gen, torch.bfloat16)
    dk, dv = torch.zeros(k.shape), torch.zeros(v.shape)

    def add(dq, dq_low, dk=dk, dv=dv):
        testing.attention_bwd_add(dq, dq_low, dk, dv, dout, q, k, v, out, lse, scale, causal)

    with pytest.raises(RuntimeError, match="adds into Float gradients"):
        add(torch.zeros_like(q), None)  # bf16 dq without its low halves
    with pytest.raises(RuntimeError, match="adds into Float gradients"):
        add(torch.zeros(q.shape), None, dk=torch.zeros(k.shape, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="adds into Float gradients"):
        add(torch.zeros(q.shape[:-1] + (q.shape[-1] + 1,)), None)
    with pytest.raises(RuntimeError, match="adds into BFloat16 gradients"):
        add(torch.zeros(q.shape), torch.zeros(q.shape, dtype=torch.int16))
    with pytest.raises(RuntimeError, match="int16 low halves"):
        add(torch.zeros_like(q), torch.zeros(q.shape, dtype=torch.float32))
    with pytest.raises(RuntimeError, match="int16 low halves"):
        add(torch.zeros_like(q), torch.zeros(q.shape, dtype=torch.int16).transpose(1, 2)
            .contiguous().transpose(1, 2))
    with pytest.raises(RuntimeError, match="round_split_ needs"):
        testing.round_split_(torch.zeros(q.shape), torch.zeros(q.shape, dtype=torch.int16))
