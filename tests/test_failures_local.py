"""Silently wrong before, now exact or an error: double backward, windows beyond the sequence,
positions near the int64 limit, the emulated Ulysses layout and an aliased merge_state_ output
(the single-process cases; their cross-rank counterparts are in test_failures.py)."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.testing.emulation import ring_attention_emulated

from failure_cases import qkv


def test_double_backward_raises_locally():
    q, k, v = (t.double().float().requires_grad_() for t in qkv(0, h=4))
    out, lse = cpattn.attention(q, k, v, causal=True, return_lse=True)
    (dq,) = torch.autograd.grad(out.square().sum() + lse.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match=r"cpattn.attention: double backward"):
        dq.sum().backward()
    outs = torch.randn(2, 1, 3, 2, 4, requires_grad=True)
    lses = torch.randn(2, 1, 2, 3, requires_grad=True)
    merged, _ = cpattn.merge_attention_states(outs, lses)
    (douts,) = torch.autograd.grad(merged.square().sum(), outs, create_graph=True)
    with pytest.raises(RuntimeError, match=r"cpattn.merge_attention_states: double backward"):
        douts.sum().backward()


def test_window_beyond_the_sequence_is_unbounded():
    q, k, v = qkv(3, h=4)
    expected = cpattn.attention(q, k, v)
    for window in [(-1, 2**63 - 1), (2**63 - 1, -1), (2**62, 2**61), (2**61 - 1, 2**40)]:
        # (a finite window beyond the sequence may sum in another order: fp32 tolerance)
        torch.testing.assert_close(cpattn.attention(q, k, v, window=window), expected)
        out, _ = torch.ops.cpattn.attention_fwd(q, k, v, 0, 0, softmax_scale=0.25,
                                                window_left=window[0], window_right=window[1])
        torch.testing.assert_close(out, expected)
    causal = cpattn.attention(q, k, v, causal=True)
    torch.testing.assert_close(cpattn.attention(q, k, v, causal=True, window=(2**63 - 1, 0)),
                               causal, atol=0, rtol=0)
    qs, ks, vs = ([t] for t in (q, k, v))  # the ring's rule too (one emulated rank)
    outs, _ = ring_attention_emulated(qs, ks, vs, window=(-1, 2**63 - 1))
    torch.testing.assert_close(outs[0], expected)  # (merged in the ring's fp32 state)


def test_positions_near_the_int64_limit_raise():
    q, k, v = qkv(4, h=4)
    causal = cpattn.attention(q, k, v, causal=True)
    far = 2**61 - 2 - 8  # the last offset that keeps 8 positions in range: exact
    out, _ = torch.ops.cpattn.attention_fwd(q, k, v, far, far, softmax_scale=0.25, causal=True)
    torch.testing.assert_close(out, causal, atol=0, rtol=0)
    for offset in [far + 1, 2**62, 2**63 - 10, -(2**62)]:
        with pytest.raises(RuntimeError, match=r"q_offset = .* puts positions outside"):
            torch.ops.cpattn.attention_fwd(q, k, v, offset, 0, softmax_scale=0.25, causal=True)
        with pytest.raises(RuntimeError, match=r"k_offset = .* puts positions outside"):
            torch.ops.cpattn.attention_bwd(q, q, k, v, q, torch.zeros(1, 4, 8), 0, offset,
                                           softmax_scale=0.25, causal=True)


def test_emulated_ulysses_needs_the_contiguous_layout():
    shards = [qkv(r, h=4) for r in range(2)]
    q, k, v = ([s[i] for s in shards] for i in range(3))
    for layout in ("zigzag", "striped"):
        with pytest.raises(ValueError, match=r"cpattn.ring_attention_emulated: strategy "
                                             "'ulysses' shards the sequence contiguously: "
                                             f"layout must be 'contiguous', got '{layout}'"):
            ring_attention_emulated(q, k, v, strategy="ulysses", layout=layout)
    outs, _ = ring_attention_emulated(q, k, v, strategy="ulysses", layout="contiguous",
                                      causal=True)
    expected, _ = ring_attention_emulated(q, k, v, layout="contiguous", causal=True)
    for a, b in zip(outs, expected):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)


def test_merge_state_refuses_an_aliased_out():
    part_out, part_lse = torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    out = torch.zeros(1, 1, 2, 8).expand(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match=r"merge_state_ out .* share memory"):
        cpattn.merge_state_(out, torch.full((1, 2, 4), -float("inf")), part_out, part_lse)
    lse = torch.full((1, 2, 1), -float("inf")).expand(1, 2, 4)
    with pytest.raises(RuntimeError, match=r"merge_state_ lse .* share memory"):
        cpattn.merge_state_(torch.zeros(1, 4, 2, 8), lse, part_out, part_lse)
