"""Bad inputs raise, with a message that names the offending argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import cpattn

ops = torch.ops.cpattn
Errors = (RuntimeError, ValueError)
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def t(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """A small non-zero tensor of the given shape."""
    fill = 0.5 if dtype.is_floating_point else 1
    return torch.full(shape, fill, dtype=dtype, device=device)


def good() -> QKV:
    """Valid q (1, 5, 4, 32), k and v (1, 6, 2, 32)."""
    return t(1, 5, 4, 32), t(1, 6, 2, 32), t(1, 6, 2, 32)


def with_(index: int, value: torch.Tensor) -> QKV:
    """The valid q, k, v with one of them replaced."""
    qkv = list(good())
    qkv[index] = value
    return qkv[0], qkv[1], qkv[2]


# name -> (builder of q, k, v, message pattern)
QKV_CASES: dict[str, tuple[Callable[[], QKV], str]] = {
    "q_rank3": (lambda: with_(0, t(5, 4, 32)), r"q .*(4 dims|\(batch, seqlen)"),
    "k_rank5": (lambda: with_(1, t(1, 1, 6, 2, 32)), r"k .*(4 dims|\(batch, seqlen)"),
    "v_rank3": (lambda: with_(2, t(6, 2, 32)), r"v must have 4 dims"),
    "heads_not_multiple": (
        lambda: (t(1, 5, 3, 32), t(1, 6, 2, 32), t(1, 6, 2, 32)),
        r"query heads \(3\).*multiple.*key/value heads \(2\)",
    ),
    "head_dim_mismatch": (
        lambda: (t(1, 5, 4, 32), t(1, 6, 2, 64), t(1, 6, 2, 64)),
        r"q and k must have the same head_dim",
    ),
    "head_dim_300": (
        lambda: (t(1, 5, 4, 300), t(1, 6, 2, 300), t(1, 6, 2, 300)),
        r"unsupported head_dim 300",
    ),
    "dtype_mismatch": (
        lambda: with_(1, t(1, 6, 2, 32, dtype=torch.bfloat16)),
        r"q, k and v must have the same dtype",
    ),
    "int_q": (lambda: with_(0, t(1, 5, 4, 32, dtype=torch.int32)), r"q must be float32"),
    "int_v": (lambda: with_(2, t(1, 6, 2, 32, dtype=torch.int64)), r"v must be float32"),
    "double_k": (lambda: with_(1, t(1, 6, 2, 32, dtype=torch.float64)), r"k must be float32"),
    "device_k_meta": (
        lambda: with_(1, t(1, 6, 2, 32, device="meta")),
        r"must be on the same device",
    ),
    "device_q_meta": (
        lambda: with_(0, t(1, 5, 4, 32, device="meta")),
        r"must be on the same device",
    ),
    "q_last_dim_strided": (
        lambda: with_(0, t(1, 5, 4, 64)[..., ::2]),
        r"q must be contiguous in its last dim",
    ),
    "v_last_dim_strided": (
        lambda: with_(2, t(1, 6, 2, 32, 2)[..., 0]),
        r"v must be contiguous in its last dim",
    ),
    "q_seqlen_0": (lambda: with_(0, t(1, 0, 4, 32)), r"q is empty"),
    "k_seqlen_0": (
        lambda: (t(1, 5, 4, 32), t(1, 0, 2, 32), t(1, 0, 2, 32)),
        r"k is empty",
    ),
    "batch_0": (lambda: (t(0, 5, 4, 32), t(0, 6, 2, 32), t(0, 6, 2, 32)), r"q is empty"),
    "kv_heads_0": (lambda: (t(1, 5, 4, 32), t(1, 6, 0, 32), t(1, 6, 0, 32)), r"k is empty"),
    "kv_shape_mismatch": (
        lambda: with_(2, t(1, 7, 2, 32)),
        r"k and v must have the same \(batch, seqlen, kv_heads\)",
    ),
    "batch_mismatch": (
        lambda: (t(2, 5, 4, 32), t(1, 6, 2, 32), t(1, 6, 2, 32)),
        r"q and k must have the same batch size",
    ),
}


@pytest.mark.parametrize("case", list(QKV_CASES))
def test_attention_fwd_bad_qkv(case: str) -> None:
    """The raw op rejects the inputs with a message naming the argument."""
    build, pattern = QKV_CASES[case]
    q, k, v = build()
    with pytest.raises(Errors, match=pattern):
        ops.attention_fwd(q, k, v, 0, 0, None, softmax_scale=0.1)


@pytest.mark.parametrize("case", list(QKV_CASES))
def test_public_api_bad_qkv(case: str) -> None:
    """cpattn.attention rejects the same inputs (its own checks or the op's)."""
    build, pattern = QKV_CASES[case]
    q, k, v = build()
    with pytest.raises(Errors, match=pattern):
        cpattn.attention(q, k, v, causal=True)


@pytest.mark.parametrize("case", [c for c in QKV_CASES if c != "q_rank3"])
def test_attention_bwd_bad_qkv(case: str) -> None:
    """attention_bwd checks q, k, v like the forward (dout, out and lse follow q)."""
    build, pattern = QKV_CASES[case]
    q, k, v = build()
    dout, out = torch.ones_like(q), torch.ones_like(q)
    lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    with pytest.raises(Errors, match=pattern):
        ops.attention_bwd(dout, q, k, v, out, lse, 0, 0, softmax_scale=0.1)


@pytest.mark.parametrize("window", [(-2, 0), (0, -2), (-5, -5)])
def test_bad_window(window: tuple[int, int]) -> None:
    """Window sides must be >= 0 or -1."""
    q, k, v = good()
    with pytest.raises(ValueError, match=r"window"):
        cpattn.attention(q, k, v, window=window)
    with pytest.raises(RuntimeError, match=r"window"):
        ops.attention_fwd(q, k, v, 0, 0, None, softmax_scale=0.1, window_left=window[0],
                          window_right=window[1])
    with pytest.raises(RuntimeError, match=r"window"):
        ops.attention_bwd(q, q, k, v, q, t(1, 4, 5), 0, 0, softmax_scale=0.1,
                          window_left=window[0], window_right=window[1])


@pytest.mark.parametrize("window", [(1, 2, 3), (1,), ("a", 1), 5])
def test_window_not_a_pair(window: object) -> None:
    """The public API wants a pair of ints."""
    q, k, v = good()
    with pytest.raises(ValueError, match=r"cpattn.attention: window.*must be .*int"):
        cpattn.attention(q, k, v, window=window)  # type: ignore[arg-type]


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan"), float("inf"), 1e-50, 1e39])
def test_bad_softmax_scale(scale: float) -> None:
    """softmax_scale must be finite and positive (as the kernels' float32)."""
    q, k, v = good()
    with pytest.raises(ValueError, match=r"cpattn.attention: softmax_scale=.*finite and > 0"):
        cpattn.attention(q, k, v, softmax_scale=scale)
    with pytest.raises(RuntimeError, match=r"softmax_scale"):
        ops.attention_bwd(q, q, k, v, q, t(1, 4, 5), 0, 0, softmax_scale=scale)


def test_bad_out_and_grad_dtype() -> None:
    """out_dtype / grad_dtype must be floating types the kernel writes."""
    q, k, v = good()
    with pytest.raises(RuntimeError, match=r"out_dtype"):
        ops.attention_fwd(q, k, v, 0, 0, torch.int32, softmax_scale=0.1)
    with pytest.raises(RuntimeError, match=r"grad_dtype"):
        ops.attention_bwd(q, q, k, v, q, t(1, 4, 5), 0, 0, torch.int64, softmax_scale=0.1)


# name -> (dout, out, lse for the valid q (1, 5, 4, 32), message pattern)
BWD_CASES: dict[str, tuple[Callable[[], tuple[torch.Tensor, ...]], str]] = {
    "lse_transposed": (
        lambda: (t(1, 5, 4, 32), t(1, 5, 4, 32), t(1, 5, 4)),
        r"lse must have shape",
    ),
    "lse_rank2": (lambda: (t(1, 5, 4, 32), t(1, 5, 4, 32), t(4, 5)), r"lse must have shape"),
    "lse_bf16": (
        lambda: (t(1, 5, 4, 32), t(1, 5, 4, 32), t(1, 4, 5, dtype=torch.bfloat16)),
        r"lse must be float32",
    ),
    "dout_shape": (lambda: (t(1, 5, 4, 16), t(1, 5, 4, 32), t(1, 4, 5)), r"dout must have q's"),
    "dout_rank": (lambda: (t(5, 4, 32), t(1, 5, 4, 32), t(1, 4, 5)), r"dout must have 4 dims"),
    "dout_int": (
        lambda: (t(1, 5, 4, 32, dtype=torch.int32), t(1, 5, 4, 32), t(1, 4, 5)),
        r"dout must be float32",
    ),
    "out_shape": (lambda: (t(1, 5, 4, 32), t(1, 6, 4, 32), t(1, 4, 5)), r"out must have q's"),
    "out_strided": (
        lambda: (t(1, 5, 4, 32), t(1, 5, 4, 64)[..., ::2], t(1, 4, 5)),
        r"out must be contiguous in its last dim",
    ),
    "lse_meta": (
        lambda: (t(1, 5, 4, 32), t(1, 5, 4, 32), t(1, 4, 5, device="meta")),
        r"must be on (the same device|q's device)",
    ),
    "dout_meta": (
        lambda: (t(1, 5, 4, 32, device="meta"), t(1, 5, 4, 32), t(1, 4, 5)),
        r"must be on (the same device|q's device)",
    ),
}


@pytest.mark.parametrize("case", list(BWD_CASES))
def test_attention_bwd_bad_args(case: str) -> None:
    """attention_bwd's dout, out and lse are checked against q."""
    build, pattern = BWD_CASES[case]
    dout, out, lse = build()
    q, k, v = good()
    with pytest.raises(Errors, match=pattern):
        ops.attention_bwd(dout, q, k, v, out, lse, 0, 0, softmax_scale=0.1)


def merge_args() -> list[torch.Tensor]:
    """Valid merge arguments: out (2, 5, 3, 8), lse (2, 3, 5) and a part of the same shapes."""
    return [t(2, 5, 3, 8), t(2, 3, 5), t(2, 5, 3, 8), t(2, 3, 5)]


# name -> (index of the argument to replace, replacement, message pattern)
MERGE_CASES: dict[str, tuple[int, Callable[[], torch.Tensor], str]] = {
    "part_out_shape": (2, lambda: t(2, 5, 3, 9), r"part_out must have out's shape"),
    "part_out_heads": (2, lambda: t(2, 5, 2, 8), r"part_out must have out's shape"),
    "lse_shape": (1, lambda: t(2, 5, 3), r"lse and part_lse must have shape"),
    "part_lse_shape": (3, lambda: t(2, 3, 6), r"lse and part_lse must have shape"),
    "out_rank": (0, lambda: t(2, 5, 24), r"merge out must be \(batch, seqlen, heads, head_dim\)"),
    "out_bf16": (0, lambda: t(2, 5, 3, 8, dtype=torch.bfloat16), r"must be float32"),
    "lse_fp16": (1, lambda: t(2, 3, 5, dtype=torch.float16), r"must be float32"),
    "part_lse_bf16": (3, lambda: t(2, 3, 5, dtype=torch.bfloat16), r"must be float32"),
    "part_out_int": (2, lambda: t(2, 5, 3, 8, dtype=torch.int32), r"part_out must be float32"),
    # Strided views of out / lse are merged in place (the ring merges into views); only the
    # head_dim must be contiguous.
    "out_last_dim_strided": (
        0,
        lambda: t(2, 5, 3, 16)[..., ::2],
        r"out must be contiguous in its last dim",
    ),
    "part_out_meta": (2, lambda: t(2, 5, 3, 8, device="meta"), r"same device|one device"),
    "out_meta": (0, lambda: t(2, 5, 3, 8, device="meta"), r"same device|one device"),
}


@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merge_bad_args(case: str) -> None:
    """merge_state_ checks shapes, dtypes, contiguity and devices; nothing is modified."""
    index, build, pattern = MERGE_CASES[case]
    args = merge_args()
    args[index] = build()
    before = [a.clone() for a in args if a.device.type == "cpu"]
    with pytest.raises(Errors, match=pattern):
        cpattn.merge_state_(*args)
    after = [a for a in args if a.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
