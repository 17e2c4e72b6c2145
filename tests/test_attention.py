"""Forward and backward of cpattn.attention against the float64 reference: shapes and masks, dtypes,
head dims, softmax scales, large scores, long sequences and query-block groups."""

from __future__ import annotations

import math

import pytest
import torch

import cpattn

from attention_checks import MASKS, check_against_reference
from conftest import Window, make_qkv, randn

# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
Shape = tuple[int, int, int, int, int, int]
SHAPES: list[Shape] = [
    (1, 1, 1, 1, 1, 64),  # a single token
    (2, 7, 7, 2, 2, 32),  # batch > 1, odd length
    (1, 63, 65, 3, 3, 64),  # Sq < Sk, both odd, around the 64-query block
    (1, 65, 63, 2, 1, 96),  # Sq > Sk, MQA
    (1, 129, 200, 4, 2, 80),  # GQA, several key blocks
    (1, 200, 129, 4, 2, 128),  # Sq > Sk, several query blocks
    (1, 1, 300, 4, 1, 72),  # decode: one query sees every key (odd head dim)
    (2, 64, 128, 2, 2, 256),  # exact blocks, largest head dim
    (1, 300, 300, 2, 1, 40),  # odd head dim, MQA
    (3, 17, 5, 6, 2, 16),  # Sq >> Sk: many empty rows under causal
]
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]

@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_fp32_shapes_and_masks(shape: Shape, mask: str, gen: torch.Generator) -> None:
    """fp32 forward and backward over shapes (Sq != Sk both ways, GQA/MQA, odd sizes) x masks."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, *shape, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, window)


LOW_SHAPES: list[Shape] = [SHAPES[2], SHAPES[4], SHAPES[6], SHAPES[9]]


@pytest.mark.parametrize("mask", ["full", "causal", "both"])
@pytest.mark.parametrize("shape", LOW_SHAPES, ids=["x".join(map(str, s)) for s in LOW_SHAPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision(dtype: torch.dtype, shape: Shape, mask: str, gen: torch.Generator) -> None:
    """bf16/fp16: out within twice its rounding, gradients within 2x torch's own error."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, *shape, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, causal, window)


@pytest.mark.parametrize("head_dim", [1, 8, 32, 40, 64, 72, 80, 96, 128, 160, 200, 256])
def test_head_dims(head_dim: int, gen: torch.Generator) -> None:
    """Any head_dim up to 256 works (the kernel pads to a multiple of 16 internally)."""
    q, k, v = make_qkv(gen, 1, 33, 70, 2, 1, head_dim, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal=True, window=(-1, -1))


@pytest.mark.parametrize("head_dim", [1, 8, 33, 40, 130, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_head_dims(dtype: torch.dtype, head_dim: int, gen: torch.Generator) -> None:
    """bf16/fp16 with odd and padded head dims (the bf16 kernel packs d pairs itself)."""
    q, k, v = make_qkv(gen, 1, 33, 70, 2, 1, head_dim, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, causal=True, window=(-1, -1))


@pytest.mark.parametrize("scale", [0.05, 0.37, 1.0, 2.5])
@pytest.mark.parametrize("mask", ["full", "causal", "both"])
def test_softmax_scale(scale: float, mask: str, gen: torch.Generator) -> None:
    """A non-default softmax_scale is applied in the forward and in every gradient."""
    causal, window = MASKS[mask]
    q, k, v = make_qkv(gen, 2, 45, 80, 2, 2, 64, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, window, scale=scale)


def test_default_scale_is_inverse_sqrt_head_dim(gen: torch.Generator) -> None:
    """softmax_scale=None means 1 / sqrt(head_dim)."""
    q, k, v = make_qkv(gen, 1, 20, 30, 2, 2, 48)
    out_default = cpattn.attention(q, k, v)
    out_explicit = cpattn.attention(q, k, v, softmax_scale=1 / math.sqrt(48))
    assert torch.equal(out_default, out_explicit)
    out_other = cpattn.attention(q, k, v, softmax_scale=0.5)
    assert not torch.allclose(out_default, out_other)


@pytest.mark.parametrize("causal", [False, True])
def test_large_scores_are_stable(causal: bool, gen: torch.Generator) -> None:
    """Scores in the hundreds (peaked softmax): no overflow, still fp32-accurate."""
    q, k, v = make_qkv(gen, 1, 70, 150, 2, 2, 64)
    q = (q * 12).requires_grad_(True)
    k = (k * 12).requires_grad_(True)
    v.requires_grad_(True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, (-1, -1))


@pytest.mark.parametrize(
    "causal, window", [(True, (100, -1)), (False, (37, 150)), (True, (-1, -1))]
)
def test_long_sequence(causal: bool, window: Window, gen: torch.Generator) -> None:
    """A longer sequence: key/query blocks skipped, masked and full in one call."""
    q, k, v = make_qkv(gen, 1, 520, 700, 2, 1, 64, requires_grad=True)
    dout = randn(q.shape, gen)
    check_against_reference(q, k, v, dout, causal, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (300, -1))]
)
def test_query_block_groups(
    dtype: torch.dtype, causal: bool, window: Window, gen: torch.Generator
) -> None:
    """K/V of a head past 1 MiB: the forward takes several query blocks through one pass over
    the keys (a partial last group here: 2100 queries are 33 blocks); with windows, blocks of a
    group see different key ranges."""
    q, k, v = make_qkv(gen, 1, 2100, 2100, 2, 1, 128, dtype=dtype, requires_grad=True)
    dout = randn(q.shape, gen, dtype)
    check_against_reference(q, k, v, dout, causal, window)
