"""Op registration: opcheck, torch.compile(fullgraph=True) and meta-device tracing."""

from __future__ import annotations

import pytest
import torch

import cpattn

from conftest import assert_close_fp32, make_qkv, op_options, randn

ops = torch.ops.cpattn

# (seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal, window, q_offset, k_offset)
FWD_ARGS = [
    (9, 12, 4, 2, 16, True, (-1, -1), 3, 0),
    (8, 8, 2, 2, 24, False, (2, 3), 0, 0),
    (6, 10, 3, 1, 16, True, (-1, -1), 0, 4),  # some rows empty
    (5, 11, 2, 2, 16, True, (3, -1), None, None),  # no offsets: bottom-right aligned
]


@pytest.mark.parametrize("args", FWD_ARGS)
def test_opcheck_attention_fwd(args: tuple, gen: torch.Generator) -> None:
    """Schema, fake kernel, autograd registration and AOT dispatch of attention_fwd."""
    sq, sk, h, hkv, d, causal, (wl, wr), q_off, k_off = args
    q, k, v = make_qkv(gen, 2, sq, sk, h, hkv, d, requires_grad=True)
    torch.library.opcheck(
        ops.attention_fwd.default, (q, k, v, q_off, k_off, None),
        op_options(0.3, causal, (wl, wr)),
    )


def test_opcheck_attention_fwd_out_dtype(gen: torch.Generator) -> None:
    """The out_dtype argument goes through the fake kernel too."""
    q, k, v = make_qkv(gen, 1, 7, 9, 2, 1, 16, dtype=torch.bfloat16)
    torch.library.opcheck(
        ops.attention_fwd.default, (q, k, v, 2, 0, torch.float32), op_options(0.3, True)
    )


@pytest.mark.parametrize("grad_dtype", [None, torch.float32])
@pytest.mark.parametrize("args", FWD_ARGS)
def test_opcheck_attention_bwd(
    args: tuple, grad_dtype: torch.dtype | None, gen: torch.Generator
) -> None:
    """attention_bwd (no autograd of its own: inputs do not require grad)."""
    sq, sk, h, hkv, d, causal, (wl, wr), q_off, k_off = args
    q, k, v = make_qkv(gen, 2, sq, sk, h, hkv, d)
    opts = op_options(0.3, causal, (wl, wr))
    out, lse = ops.attention_fwd(q, k, v, q_off, k_off, None, **opts)
    dout = randn(q.shape, gen)
    torch.library.opcheck(
        ops.attention_bwd.default, (dout, q, k, v, out, lse, q_off, k_off, grad_dtype), opts
    )


@pytest.mark.parametrize("sq, sk", [(3, 11), (11, 3), (7, 7)])
def test_no_offsets_is_bottom_right(sq: int, sk: int, gen: torch.Generator) -> None:
    """Without offsets the op aligns the rows bottom-right (query i at i + sk - sq, keys from
    0), mask and ALiBi alike: the same out, LSE and gradients as those offsets given."""
    q, k, v = make_qkv(gen, 2, sq, sk, 2, 1, 16)
    dout = randn(q.shape, gen)
    opts = op_options(0.3, True, (4, -1), softcap=3.0, alibi_slopes=torch.tensor([0.3, 0.1]),
                      prefix_len=2)
    results = []
    for offsets in ((None, None), (sk - sq, 0)):
        out, lse = ops.attention_fwd(q, k, v, *offsets, None, **opts)
        grads = ops.attention_bwd(dout, q, k, v, out, lse, *offsets, None, None, **opts)
        results.append((out, lse, *grads))
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(got, want), name
    with pytest.raises(RuntimeError, match=r"cpattn.attention: give q_offset and k_offset, or "
                       r"neither \(bottom-right aligned\), got q_offset=None, k_offset=0"):
        ops.attention_fwd(q, k, v, None, 0, **op_options(0.3, True))
    with pytest.raises(RuntimeError, match=r"got q_offset=2, k_offset=None"):
        ops.attention_bwd(dout, q, k, v, out, lse, 2, None, **op_options(0.3, True))


@pytest.mark.parametrize("part_dtype", [torch.float32, torch.bfloat16])
def test_opcheck_merge_state(part_dtype: torch.dtype, gen: torch.Generator) -> None:
    """merge_state_ mutates exactly out and lse, as its schema declares."""
    out, part_out = randn((2, 5, 3, 8), gen), randn((2, 5, 3, 8), gen, part_dtype)
    lse, part_lse = randn((2, 3, 5), gen), randn((2, 3, 5), gen)
    lse[0, 1, 2] = float("-inf")
    torch.library.opcheck(ops.merge_state_.default, (out, lse, part_out, part_lse))


# ---------------------------------------------------------------------------------------------
# torch.compile


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Some surrounding math around cpattn.attention, as a model would have."""
    out, lse = cpattn.attention(q * 1.5, k, v, causal=True, window=(20, -1), return_lse=True)
    return out.tanh() + lse.transpose(1, 2)[..., None].detach() * 0.01


def test_compile_fullgraph_forward_and_backward(gen: torch.Generator) -> None:
    """torch.compile(fullgraph=True) traces through the op (no graph break) and matches eager,
    forward and backward."""
    torch._dynamo.reset()
    compiled = torch.compile(attention_block, fullgraph=True)
    q, k, v = make_qkv(gen, 2, 40, 56, 4, 2, 32, requires_grad=True)
    dout = randn(q.shape, gen)

    out_eager = attention_block(q, k, v)
    grads_eager = torch.autograd.grad(out_eager, (q, k, v), dout)
    out_comp = compiled(q, k, v)
    grads_comp = torch.autograd.grad(out_comp, (q, k, v), dout)

    assert_close_fp32(out_comp, out_eager, "out")
    for name, a, b in zip(("dq", "dk", "dv"), grads_comp, grads_eager):
        assert_close_fp32(a, b, name)


def test_compile_split_and_merge(gen: torch.Generator) -> None:
    """A compiled two-chunk attention with the in-place merge equals the eager full attention."""

    def two_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        half = k.shape[1] // 2
        out, lse = ops.attention_fwd(q, k[:, :half], v[:, :half], 16, 0,
                                     softmax_scale=0.25, causal=True)
        part = ops.attention_fwd(q, k[:, half:], v[:, half:], 16, half,
                                 softmax_scale=0.25, causal=True)
        cpattn.merge_state_(out, lse, part[0], part[1])
        return out

    torch._dynamo.reset()
    compiled = torch.compile(two_chunks, fullgraph=True)
    q, k, v = make_qkv(gen, 1, 24, 40, 2, 2, 16)
    want = cpattn.attention(q, k, v, causal=True, softmax_scale=0.25)
    assert_close_fp32(compiled(q, k, v), want, "merged")


# ---------------------------------------------------------------------------------------------
# Meta tensors


def test_meta_device_shapes() -> None:
    """On the meta device the fake kernels give every output's shape and dtype."""
    q = torch.empty(2, 17, 8, 40, device="meta", dtype=torch.bfloat16, requires_grad=True)
    k = torch.empty(2, 23, 2, 40, device="meta", dtype=torch.bfloat16, requires_grad=True)
    v = torch.empty(2, 23, 2, 40, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = cpattn.attention(q, k, v, causal=True, return_lse=True)
    assert out.device.type == "meta" and out.shape == (2, 17, 8, 40)
    assert out.dtype == torch.bfloat16
    assert lse.shape == (2, 8, 17) and lse.dtype == torch.float32
    out.backward(torch.empty_like(out))
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert q.grad.dtype == torch.bfloat16

    out32, _ = ops.attention_fwd(q, k, v, 0, 0, torch.float32, softmax_scale=0.1)
    assert out32.dtype == torch.float32 and out32.shape == q.shape
    grads = ops.attention_bwd(out, q, k, v, out, lse, 0, 0, torch.float32, softmax_scale=0.1)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert all(g.dtype == torch.float32 and g.device.type == "meta" for g in grads)

    o = torch.empty(2, 17, 8, 40, device="meta")
    lse32 = torch.empty(2, 8, 17, device="meta")
    cpattn.merge_state_(o, lse32, out, lse)  # no error, no data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_matches_real(dtype: torch.dtype, gen: torch.Generator) -> None:
    """Fake-tensor outputs have the real outputs' shapes, dtypes and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = make_qkv(gen, 2, 13, 21, 6, 3, 24, dtype=dtype)
    opts = op_options(0.2, True)
    real_fwd = ops.attention_fwd(q, k, v, 8, 0, None, **opts)
    real_bwd = ops.attention_bwd(real_fwd[0], q, k, v, *real_fwd, 8, 0, **opts)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(x) for x in (q, k, v))
        fake_fwd = ops.attention_fwd(fq, fk, fv, 8, 0, None, **opts)
        fake_bwd = ops.attention_bwd(fake_fwd[0], fq, fk, fv, *fake_fwd, 8, 0, **opts)
    for real, fake in zip((*real_fwd, *real_bwd), (*fake_fwd, *fake_bwd)):
        assert fake.shape == real.shape and fake.dtype == real.dtype
        assert fake.stride() == real.stride()
