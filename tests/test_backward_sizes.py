"""torch.ops.cpattn.cpu_backward_sizes, the CPU backward's own sizes that the memory model
(cpattn.plan.memory) reads: its contract, and that the bytes a local backward allocates follow
its grouping of KV heads (counted by cpattn.memory.counting) as the byte budget is lowered."""

import contextlib

import pytest
import torch

import cpattn
from cpattn import plan as P

sizes = torch.ops.cpattn.cpu_backward_sizes


@contextlib.contextmanager
def group_budget(nbytes: int):
    """The CPU backward's byte budget per kernel call lowered to `nbytes` inside the block."""
    previous = torch.ops.cpattn_testing.set_cpu_backward_group_bytes(nbytes)
    try:
        yield
    finally:
        torch.ops.cpattn_testing.set_cpu_backward_group_bytes(previous)


SHAPES = [  # batch, seqlen, heads, kv heads, head dim
    (1, 1, 1, 1, 16),
    (1, 1024, 4, 4, 64),
    (2, 333, 8, 2, 72),
    (3, 4096, 32, 1, 128),
    (1, 1 << 20, 64, 8, 128),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sizes_are_a_group_and_chunks_of_whole_query_blocks(shape):
    B, S, H, Hkv, D = shape
    for dtype in DTYPES:
        for grad in DTYPES:
            kv_per_call, splits, rows = sizes(B, S, S, H, Hkv, D, dtype, grad)
            assert 1 <= kv_per_call <= Hkv
            assert splits >= 1
            assert rows % 64 == 0 and 64 <= rows <= 512
            assert rows <= -(-S // 64) * 64  # never more rows than the sequence's blocks
            with group_budget(1):  # every KV head its own call, unless a head costs nothing
                assert sizes(B, S, S, H, Hkv, D, dtype, grad)[0] in (1, Hkv)
            # a function of the shape only: the same with any thread count
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                assert sizes(B, S, S, H, Hkv, D, dtype, grad) == [kv_per_call, splits, rows]
            finally:
                torch.set_num_threads(threads)


def test_fp32_operands_read_in_place_take_every_head_at_once():
    # fp32 inputs and gradients, D a multiple of 16: nothing to pack or sum beyond the gradients
    with group_budget(1):
        assert sizes(1, 4096, 4096, 32, 8, 64, torch.float32, torch.float32)[0] == 8
        assert sizes(1, 4096, 4096, 32, 8, 72, torch.float32, torch.float32)[0] == 1


def test_a_larger_budget_never_takes_fewer_heads_per_call():
    per_call = []
    for nbytes in (1, 1 << 16, 1 << 20, 1 << 24, 1 << 30):
        with group_budget(nbytes):
            per_call.append(sizes(2, 2048, 2048, 16, 8, 64, torch.float16, torch.float16)[0])
    assert per_call == sorted(per_call) and per_call[0] == 1 and per_call[-1] == 8


def test_bad_arguments_raise_naming_the_op():
    with pytest.raises(RuntimeError, match="cpu_backward_sizes: heads must be"):
        sizes(1, 64, 64, 6, 4, 64, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="cpu_backward_sizes: batch"):
        sizes(1, 0, 64, 4, 4, 64, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="cpu_backward_sizes: input_dtype"):
        sizes(1, 64, 64, 4, 4, 64, torch.int32, torch.float32)


@pytest.mark.parametrize("dtype,kv_heads,head_dim", [
    (torch.bfloat16, 4, 64), (torch.bfloat16, 2, 72), (torch.float16, 4, 64),
    (torch.float32, 4, 72)])
def test_local_backward_allocates_what_the_model_says_for_its_groups(dtype, kv_heads, head_dim):
    """cpattn.attention's backward on one rank: the model (its groups from the op) against the
    bytes counted, with the default budget and with one KV head per call."""
    S, H = 1024, 4
    p = P.Problem(S, H, kv_heads, head_dim, dtype=str(dtype).split(".")[1], causal=True)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, h, head_dim, dtype=dtype, requires_grad=True)
               for h in (H, kv_heads, kv_heads))
    g = torch.randn(1, S, H, head_dim, dtype=dtype)

    def measured() -> int:
        peaks = []
        for _ in range(2):  # the first call initialises lazily
            q.grad = k.grad = v.grad = None
            with cpattn.memory.counting() as c:
                cpattn.attention(q, k, v, causal=True).backward(g)
            peaks.append(c.peak)
        return min(peaks)

    whole, whole_model = measured(), P.memory(p, "none", 1)["peak"]
    with group_budget(1):
        grouped, grouped_model = measured(), P.memory(p, "none", 1)["peak"]
    # the groups save what a KV head's call allocates as tensors: its packing, which the brgemm
    # path has none of for bf16 with D a multiple of 16 (its dK / dV sums are the kernel's own)
    saves = grouped_model < whole_model
    if not saves:
        brgemm = cpattn.build_info()["cpu_gemm"]["bfloat16"].startswith("brgemm")
        assert dtype == torch.bfloat16 and head_dim % 16 == 0 and brgemm
    assert grouped < whole if saves else grouped == whole
    for got, model in ((whole, whole_model), (grouped, grouped_model)):
        assert abs(got - model) <= 0.02 * model, (got, model)


def _buffer_bytes_formula(B, n, h, hkv, D, dtype, grad) -> int:
    """The formula cpattn.plan.memory used to repeat for the kernel's buffers (one call of a
    group of KV heads): the chunk's query rows packed (Q^T, dO^T, Q, dO: 16 bytes a value in
    fp32, 8 in bf16), its fp32 dQ per key split, and the dK / dV sums beyond the gradients (none
    in fp32 gradients, low halves beside bf16 ones, fp32 sums otherwise or with D not a multiple
    of 16)."""
    from cpattn.plan.memory import bf16_dot

    c, splits, rows = sizes(B, n, n, h, hkv, D, dtype, grad)
    h, hkv = h // hkv * c, c
    dp = -(-D // 16) * 16
    bf16 = dtype == torch.bfloat16 and bf16_dot()
    per_value = 4 if D % 16 else {torch.float32: 0, torch.bfloat16: 2}.get(grad, 4)
    return ((8 if bf16 else 16) * B * h * rows * dp + splits * 4 * B * h * rows * dp
            + per_value * B * n * hkv * 2 * dp)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_buffer_bytes_are_the_kernels_own(shape):
    # the op reads the sizes the kernel allocates by (attention_kernel.h backward_buffer_bytes);
    # they are what the memory model's formula used to re-derive, on every dtype pair
    B, S, H, Hkv, D = shape
    for dtype in DTYPES:
        for grad in DTYPES:
            got = torch.ops.cpattn.cpu_backward_buffer_bytes(B, S, S, H, Hkv, D, dtype, grad)
            assert got == _buffer_bytes_formula(B, S, H, Hkv, D, dtype, grad), (dtype, grad)
    with pytest.raises(RuntimeError, match="cpu_backward_buffer_bytes: heads must be"):
        torch.ops.cpattn.cpu_backward_buffer_bytes(1, 8, 8, 3, 2, 16, torch.float32,
                                                   torch.float32)
