"""Score options of cpattn.attention (sinks, softcap, ALiBi, prefix-LM, head_dim_v != head_dim),
alone and combined, forward, LSE and every gradient (the sinks' too) against the float64
reference, in fp32 and bf16, on every instruction set the CPU has (tests/test_isa.py reruns the
suite per ISA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import cpattn

from conftest import (
    UNIT_ROUNDOFF,
    assert_close_baseline,
    assert_close_fp32,
    assert_close_low_out,
    randn,
    reference_attention,
)

# name -> options of cpattn.attention (sinks / alibi_slopes: True = draw per-head values)
OPTIONS: dict[str, dict] = {
    "sinks": {"sinks": True},
    "softcap": {"softcap": 5.0},
    "alibi": {"alibi_slopes": True},
    "prefix": {"prefix_len": 37},
    "dv": {"head_dim_v": 48},
    "sinks_window": {"sinks": True, "window": (20, 0)},
    "softcap_alibi": {"softcap": 3.0, "alibi_slopes": True},
    "prefix_sinks_softcap": {"prefix_len": 70, "sinks": True, "softcap": 8.0},
    "all": {"sinks": True, "softcap": 4.0, "alibi_slopes": True, "prefix_len": 5, "head_dim_v": 24},
    "dv_big_window": {"head_dim_v": 160, "window": (40, 3), "alibi_slopes": True},
}

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
SHAPES = [
    (1, 130, 130, 4, 2, 64),  # GQA, several blocks of both kinds
    (2, 40, 200, 2, 1, 32),  # Sq < Sk (bottom-right), MQA, batch 2
    (1, 1, 150, 2, 2, 40),  # decode row
    (1, 70, 20, 3, 3, 16),  # Sq > Sk: empty rows under causal (out 0, lse -inf or the sink)
]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]


def make_inputs(gen, shape, options, dtype):
    b, sq, sk, h, hkv, d = shape
    dv = options.get("head_dim_v", d)
    q = randn((b, sq, h, d), gen, dtype, True)
    k = randn((b, sk, hkv, d), gen, dtype, True)
    v = randn((b, sk, hkv, dv), gen, dtype, True)
    kwargs = {}
    if options.get("sinks"):
        kwargs["sinks"] = (randn((h,), gen) * 2).requires_grad_(True)
    if options.get("alibi_slopes"):
        kwargs["alibi_slopes"] = torch.rand(h, generator=gen) * 0.5 + 0.01
    for key in ("softcap", "prefix_len"):
        if key in options:
            kwargs[key] = options[key]
    dout = randn((b, sq, h, dv), gen, dtype)
    return q, k, v, kwargs, dout


def reference(q, k, v, dout, causal, window, kwargs, compute_dtype=torch.float64):
    """Reference out, lse and gradients of (q, k, v[, sinks]) in compute_dtype."""
    leaves = [t.detach().to(compute_dtype).requires_grad_(True) for t in (q, k, v)]
    ref_kwargs = dict(kwargs)
    if "sinks" in kwargs:
        sinks = kwargs["sinks"].detach().to(compute_dtype).requires_grad_(True)
        ref_kwargs["sinks"] = sinks
        leaves.append(sinks)
    out, lse = reference_attention(
        *leaves[:3], causal=causal, window=window, compute_dtype=compute_dtype, **ref_kwargs
    )
    grads = torch.autograd.grad(out, leaves, dout.to(compute_dtype))
    return out.detach(), lse.detach(), grads


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options_against_reference(dtype, name, shape, causal, gen) -> None:
    options = OPTIONS[name]
    window = options.get("window", (-1, -1))
    q, k, v, kwargs, dout = make_inputs(gen, shape, options, dtype)
    out, lse = cpattn.attention(
        q, k, v, causal=causal, window=window, return_lse=True, **kwargs
    )
    leaves = [q, k, v] + ([kwargs["sinks"]] if "sinks" in kwargs else [])
    grads = torch.autograd.grad(out, leaves, dout)
    r_out, r_lse, r_grads = reference(q, k, v, dout, causal, window, kwargs)
    names = ["dq", "dk", "dv", "dsinks"]
    assert out.dtype == dtype and out.shape == r_out.shape
    assert_close_fp32(lse, r_lse, "lse")  # fp32 from exactly upcast inputs in every dtype
    if dtype == torch.float32:
        assert_close_fp32(out, r_out, "out")
        for n, got, want in zip(names, grads, r_grads):
            assert_close_fp32(got, want, n)
        return
    _, _, low_grads = reference(q, k, v, dout, causal, window, kwargs, compute_dtype=dtype)
    low_out, _ = reference_attention(
        q.detach(), k.detach(), v.detach(), causal=causal, window=window, compute_dtype=dtype,
        **{key: (val.detach() if torch.is_tensor(val) else val) for key, val in kwargs.items()},
    )
    assert_close_low_out(out, r_out, low_out, dtype)
    for n, got, want, low in zip(names[:3], grads, r_grads, low_grads):
        assert_close_baseline(got, want, low, n)
    if "sinks" in kwargs:
        check_bf16_sink_grad(grads[3], r_grads[3], kwargs["sinks"], r_out, r_lse, dout)


def check_bf16_sink_grad(got, want, sinks, r_out, r_lse, dout) -> None:
    """The sink gradient sums one term per row, -p_sink * rowsum(dout * out), each from the
    output rounded to bf16: within twice that rounding of the sum of the terms' magnitudes (a
    single number per head, so torch's own bf16 error is no stable yardstick)."""
    p_sink = torch.exp(sinks.detach().double()[None, :, None] - r_lse)
    terms = p_sink * torch.einsum("bqhd,bqhd->bhq", dout.double(), r_out)
    bound = 2 * UNIT_ROUNDOFF[torch.bfloat16] * terms.abs().sum((0, 2)) + 1e-4
    err = (got.double() - want).abs()
    assert (err <= bound).all(), f"dsinks: error {err.tolist()} > bound {bound.tolist()}"


def test_lse_gradient_with_sinks(gen) -> None:
    """A loss on the LSE too: the sink gradient takes dL/dlse into account."""
    q, k, v, kwargs, dout = make_inputs(
        gen, SHAPES[0], {"sinks": True, "softcap": 6.0}, torch.float32
    )
    dlse = randn((1, 4, 130), gen)
    out, lse = cpattn.attention(q, k, v, causal=True, return_lse=True, **kwargs)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v, kwargs["sinks"]))
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, kwargs["sinks"])]
    r_out, r_lse = reference_attention(
        *leaves[:3], causal=True, sinks=leaves[3], softcap=6.0
    )
    want = torch.autograd.grad(
        (r_out * dout.double()).sum() + (r_lse * dlse.double()).sum(), leaves
    )
    for n, a, e in zip(["dq", "dk", "dv", "dsinks"], got, want):
        assert_close_fp32(a, e, n)


def test_empty_rows_with_sink(gen) -> None:
    """A row that sees no key: out 0 and lse = the sink (without a sink: -inf), no NaN."""
    q, k, v = (randn((1, 8, 2, 16), gen) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    out, lse = cpattn.attention(q, k[:, :3], v[:, :3], causal=True, sinks=sinks, return_lse=True)
    # Sq = 8 > Sk = 3: queries 0..4 sit before key 0
    assert torch.equal(out[:, :5], torch.zeros_like(out[:, :5]))
    assert torch.equal(lse[0, :, :5], sinks[:, None].expand(2, 5))


def test_plain_options_are_the_plain_path(gen) -> None:
    """Options at their neutral values give the bits of the call without them."""
    q, k, v = (randn((1, 100, 2, 32), gen) for _ in range(3))
    base = cpattn.attention(q, k, v, causal=True)
    same = cpattn.attention(q, k, v, causal=True, softcap=0.0, prefix_len=0)
    assert torch.equal(base, same)
    no_sink = cpattn.attention(q, k, v, causal=True, sinks=torch.full((2,), float("-inf")))
    assert torch.equal(base, no_sink)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"softcap": -1.0}, r"softcap=-1.0: must be finite and >= 0"),
        ({"softcap": float("inf")}, r"softcap=inf: must be finite and >= 0"),
        ({"prefix_len": -3}, r"prefix_len=-3: must be >= 0"),
        ({"prefix_len": 2.5}, r"prefix_len=2.5: must be an int"),
        ({"sinks": torch.zeros(3)}, r"sinks must have shape \(heads,\) = \(2,\)"),
        ({"sinks": torch.zeros(2, dtype=torch.int64)}, "sinks must be float32"),
        ({"alibi_slopes": torch.zeros(2, 1)}, r"alibi_slopes must have shape \(heads,\)"),
        ({"alibi_slopes": torch.ones(2, requires_grad=True)}, r"alibi_slopes=.*are fixed"),
    ],
)
def test_bad_options_raise(kwargs, match, gen) -> None:
    q, k, v = (randn((1, 8, 2, 16), gen) for _ in range(3))
    with pytest.raises((ValueError, RuntimeError), match=match):
        cpattn.attention(q, k, v, causal=True, **kwargs)


def test_head_dim_v_mismatch_raises(gen) -> None:
    q, k = randn((1, 8, 2, 16), gen), randn((1, 8, 2, 16), gen)
    v = randn((1, 9, 2, 32), gen)
    with pytest.raises(
        RuntimeError, match=r"k and v must have the same \(batch, seqlen, kv_heads\)"
    ):
        cpattn.attention(q, k, v)


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512"])
def test_every_isa(isa: str) -> None:
    """The options on every instruction-set path (CPATTN_CPU_ISA is read once per process):
    this file's checks on one shape (several key and query blocks), in a subprocess."""
    env = dict(os.environ, CPATTN_CPU_ISA=isa)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider",
         "-k", "not every_isa and (130x130 or bad or empty or lse_gradient)"],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


GROUP_SHAPES = [
    (1, 130, 130, 4, 2, 40),  # GQA, D not a multiple of 16: fp32 packs too
    (2, 96, 96, 6, 3, 32),  # batch 2: the groups' LSE and delta rows are copies
    (1, 70, 20, 3, 3, 16),  # empty rows under causal
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", GROUP_SHAPES, ids=["x".join(map(str, s)) for s in GROUP_SHAPES])
@pytest.mark.parametrize("name", ["all", "dv_big_window", "softcap_alibi", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_options_in_kv_head_groups(one_kv_head_per_backward_call, dtype, name, shape, causal,
                                   gen) -> None:
    """Each group's heads get their own slopes, LSE and delta rows and write only their own
    gradients' heads (outputs are poisoned under CPATTN_POISON=1)."""
    test_options_against_reference(dtype, name, shape, causal, gen)


def test_group_budget_must_be_positive() -> None:
    with pytest.raises(RuntimeError, match="must be positive"):
        torch.ops.cpattn_testing.set_cpu_backward_group_bytes(0)
