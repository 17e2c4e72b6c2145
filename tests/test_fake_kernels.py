"""The fake (meta) kernels of the context-parallel ops agree with the real ones
(torch.library.opcheck: shapes, dtypes, strides of the outputs, schema), so torch.compile traces
them. The ring ops run on a one-rank gloo group; the gathered ops need no group."""

import torch
import torch.distributed as dist
from distributed import run_ranks

import cpattn  # noqa: F401  (registers the fake kernels)

ops = torch.ops.cpattn
TESTS = ("test_schema", "test_faketensor")


def _inputs(seed: int, world: int = 2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, 4, 16, generator=g)
    kv_all = torch.randn(world, 2, 2, 8, 2, 16, generator=g)
    return q, kv_all


def test_gathered_ops_fakes_match():
    q, kv_all = _inputs(0)
    args = (0.25, True, 3, -1, 1)
    torch.library.opcheck(ops.gathered_fwd, (q, kv_all, 1, *args), test_utils=TESTS)
    out, lse = ops.gathered_fwd(q, kv_all, 1, *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.gathered_bwd, (dout, q, kv_all, out, lse, 1, *args),
                          test_utils=TESTS)
    torch.library.opcheck(ops.gathered_fwd, (q.bfloat16(), kv_all.bfloat16(), 0, *args),
                          test_utils=TESTS)


def test_positions_fakes_match():
    torch.library.opcheck(ops.layout_positions, (24, 3, 1, 1), test_utils=TESTS)
    torch.library.opcheck(ops.cache_positions, (10, 1, 3, 2), test_utils=TESTS)


def _ring_ops(rank, world):
    q, kv_all = _inputs(1, world=1)
    k, v = kv_all[0, 0].contiguous(), kv_all[0, 1].contiguous()
    name = dist.group.WORLD.group_name
    args = (name, 0.25, True, -1, -1, 1, 60.0)
    torch.library.opcheck(ops.ring_fwd, (q, k, v, *args), test_utils=TESTS)
    out, lse = ops.ring_fwd(q, k, v, *args)
    torch.library.opcheck(ops.ring_bwd, (torch.randn_like(out), q, k, v, out, lse, *args),
                          test_utils=TESTS)
    torch.library.opcheck(torch.ops.cpattn_testing.ring_fwd_emulated,
                          ([q, q], [k, k], [v, v], 0.25, True, -1, -1, 1), test_utils=TESTS)


def _separate_gradients(rank, world):
    """dK and dV are separate tensors: accumulating a second backward into leaf K's gradient
    must not change V's (they once were views of one buffer)."""
    q, kv_all = _inputs(2, world=1)
    k, v = (kv_all[0, i].clone().requires_grad_() for i in range(2))
    cpattn.ring_attention(q, k, v, causal=True).sum().backward()
    dv = v.grad.clone()
    cpattn.ring_attention(q, k, v, causal=True).sum().backward()
    assert k.grad.untyped_storage().data_ptr() != v.grad.untyped_storage().data_ptr()
    torch.testing.assert_close(v.grad, 2 * dv)


def _ring_checks(rank, world):
    _ring_ops(rank, world)
    _separate_gradients(rank, world)


def test_ring_ops_fakes_match():
    run_ranks(1, _ring_checks)
