"""The fake (meta) kernels of the context-parallel ops agree with the real ones
(torch.library.opcheck: shapes, dtypes, strides of the outputs, schema), so torch.compile traces
them. The ring ops run on a one-rank gloo group; the gathered ops need no group."""

import torch
import torch.distributed as dist

import cpattn  # noqa: F401  (registers the fake kernels)
from cpattn.testing.emulation import load_ops

from distributed import run_ranks

ops = torch.ops.cpattn
TESTS = ("test_schema", "test_faketensor")


def _inputs(seed: int, world: int = 2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, 4, 16, generator=g)
    kv_all = torch.randn(world, 2, 8, 2, 16 + 8, generator=g)  # (W, B, S, Hkv, D + Dv)
    return q, kv_all


def test_gathered_ops_fakes_match():
    q, kv_all = _inputs(0)
    k_all, v_all = kv_all[..., :16], kv_all[..., 16:]  # views of one gathered buffer
    layout = 1
    opts = dict(softmax_scale=0.25, causal=True, window_left=3, window_right=-1)
    torch.library.opcheck(ops.gathered_fwd, (q, k_all, v_all, 1, layout), opts, test_utils=TESTS)
    out, lse = ops.gathered_fwd(q, k_all, v_all, 1, layout, **opts)
    dout = torch.randn_like(out)
    torch.library.opcheck(ops.gathered_bwd, (dout, q, k_all, v_all, out, lse, 1, layout), opts,
                          test_utils=TESTS)
    torch.library.opcheck(ops.gathered_fwd,
                          (q.bfloat16(), k_all.bfloat16(), v_all.bfloat16(), 0, layout), opts,
                          test_utils=TESTS)
    score = dict(opts, softcap=2.0, alibi_slopes=torch.rand(4), prefix_len=3)
    torch.library.opcheck(ops.gathered_fwd, (q, k_all, v_all, 1, layout),
                          {**score, "sinks": torch.randn(4)}, test_utils=TESTS)
    torch.library.opcheck(ops.gathered_bwd, (dout, q, k_all, v_all, out, lse, 1, layout), score,
                          test_utils=TESTS)


def test_attention_varlen_ops_fakes_match():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 12, 4, 16, generator=g)
    k, v = torch.randn(1, 12, 2, 16, generator=g), torch.randn(1, 12, 2, 8, generator=g)
    docs = torch.tensor([5, 0, 7])
    opts = dict(softmax_scale=0.25, causal=True, window_left=3, window_right=-1)
    torch.library.opcheck(ops.attention_varlen_fwd, (q, k, v, docs), opts, test_utils=TESTS)
    out, lse = ops.attention_varlen_fwd(q, k, v, docs, **opts)
    torch.library.opcheck(ops.attention_varlen_bwd, (torch.randn_like(out), q, k, v, out, lse,
                                                     docs), opts, test_utils=TESTS)


def test_positions_fakes_match():
    torch.library.opcheck(ops.layout_positions, (24, 3, 1, 1), test_utils=TESTS)
    torch.library.opcheck(ops.cache_positions, (10, 1, 3, 2), test_utils=TESTS)
    # the mask rule's ops over query positions (-1: padding)
    pos = torch.tensor([0, 7, -1, 3])
    torch.library.opcheck(ops.visible_keys, (pos.clamp(min=0), 8, True, 2, -1, 1),
                          test_utils=TESTS)
    torch.library.opcheck(ops.visible_key_ranges, (pos, True, 2, -1, 1), test_utils=TESTS)


def _ring_ops(rank, world):
    q, kv_all = _inputs(1, world=1)
    k, v = kv_all[0, ..., :16].contiguous(), kv_all[0, ..., 16:].contiguous()  # Dv != D
    name = dist.group.WORLD.group_name
    args = (name, 1, 60.0)  # group_name, layout, timeout_s
    opts = dict(softmax_scale=0.25, causal=True)
    torch.library.opcheck(ops.ring_fwd, (q, k, v, *args), opts, test_utils=TESTS)
    out, lse = ops.ring_fwd(q, k, v, *args, **opts)
    torch.library.opcheck(ops.ring_bwd, (torch.randn_like(out), q, k, v, out, lse, *args), opts,
                          test_utils=TESTS)
    score = dict(opts, softcap=2.0, alibi_slopes=torch.rand(4), prefix_len=3)
    torch.library.opcheck(ops.ring_fwd, (q, k, v, *args), {**score, "sinks": torch.randn(4)},
                          test_utils=TESTS)
    out, lse = ops.ring_fwd(q, k, v, *args, **score)
    torch.library.opcheck(ops.ring_bwd, (torch.randn_like(out), q, k, v, out, lse, *args),
                          score, test_utils=TESTS)
    load_ops()
    torch.library.opcheck(torch.ops.cpattn_testing.ring_fwd_emulated,
                          ([q, q], [k, k], [v, v], 1), opts, test_utils=TESTS)


def _separate_gradients(rank, world):
    """dK and dV are separate tensors: accumulating a second backward into leaf K's gradient
    must not change V's (they once were views of one buffer)."""
    q, kv_all = _inputs(2, world=1)
    k, v = (t.clone().requires_grad_() for t in (kv_all[0, ..., :16], kv_all[0, ..., 16:]))
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


# torch.compile(fullgraph=True) of every strategy's attention, forward and backward: 0 graph
# breaks and the same output and gradients (q, k, v and the sinks') as eager. aot_eager traces
# what inductor would receive (fake kernels, AOT autograd's joint graph) without code generation.


def _fresh(shape, seed: int, requires_grad: bool = True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


def _compiled_vs_eager(fn, inputs: list, what: str) -> None:
    """fn(*inputs) compiled (fullgraph) and eager: equal outputs and gradients, no graph break."""
    from torch._dynamo.utils import counters

    counters.clear()
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        out = f(*xs)
        out.backward(_fresh(out.shape, 9, requires_grad=False))
        results.append([out.detach(), *(x.grad for x in xs)])
    assert sum(counters["graph_break"].values()) == 0, (what, dict(counters["graph_break"]))
    for name, e, c in zip(["out", *range(len(inputs))], *results):
        assert e is not None and bool(e.abs().max() > 0), f"{what}: {name} is zero: cannot fail"
        torch.testing.assert_close(c, e, rtol=1e-6, atol=1e-6, msg=f"{what}: {name}")


def _strategies_compile(rank, world):
    """ring / allgather / ulysses (W = 2) or hybrid 2 x 2 (W = 4), with sinks and a window."""
    from torch.distributed.device_mesh import init_device_mesh

    if world == 4:
        cases = [cpattn.ContextParallel(init_device_mesh("cpu", (2, 2)), strategy="hybrid")]
    else:
        cases = [cpattn.ContextParallel(strategy=s) for s in ("ring", "allgather", "ulysses")]
    q, k, v = _fresh((2, 8, 4, 16), 1), _fresh((2, 8, 2, 16), 2), _fresh((2, 8, 2, 16), 3)
    sinks = _fresh((4,), 4)
    for cp in cases:
        torch._dynamo.reset()

        def fn(q, k, v, sinks, cp=cp):
            return cp.attention(q, k, v, causal=True, window=(5, -1), sinks=sinks)

        _compiled_vs_eager(fn, [q, k, v, sinks], f"compiled {cp}")


def _compile_w2(rank, world):
    _strategies_compile(rank, world)
    _varlen_compile(rank, world)


def test_fullgraph_compile_strategies_and_varlen_w2():
    run_ranks(2, _compile_w2)


def test_fullgraph_compile_hybrid_w4():
    run_ranks(4, _strategies_compile)


def _varlen_compile(rank, world):
    """ring_attention_varlen compiled: cu_seqlens (a list) read while tracing, checked by the
    agreement once per compiled signature (new boundaries: traced and checked again); a tensor
    cu_seqlens or boundaries that differ across ranks raise on every rank."""
    import pytest

    from cpattn.core import agreement as _agreement

    for strategy in ("ring", "allgather"):
        torch._dynamo.reset()

        def fn(q, k, v, sinks, cu, strategy=strategy):
            return cpattn.ring_attention_varlen(q, k, v, cu, causal=True, strategy=strategy,
                                                sinks=sinks, softcap=3.0)

        for cu in ([0, 5, 16, 24], [0, 11, 13, 24]):
            q, k, v = (cpattn.shard_varlen(_fresh((24, 4, 8), 10 + j, False), cu)
                       for j in range(3))
            before = _agreement.header_rounds
            _compiled_vs_eager(lambda q, k, v, s, cu=cu: fn(q, k, v, s, cu), [q, k, v,
                               _fresh((4,), 5)], f"compiled varlen {strategy} {cu}")
            # eager checks twice (forward only once per call: once here), compiled once
            assert _agreement.header_rounds - before == 2, _agreement.header_rounds - before
    f = torch.compile(fn, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="cu_seqlens.*list or tuple of ints under torch.compile"):
        f(q, k, v, None, torch.tensor([0, 11, 13, 24]))
    torch._dynamo.reset()
    cu = [0, 5, 16, 24] if rank == 0 else [0, 6, 16, 24]
    with pytest.raises(Exception, match="disagree on document_lengths"):
        f(q, k, v, None, cu)
    torch._dynamo.reset()
    cu = [0, 5, 3, 24] if rank == 0 else [0, 5, 16, 24]  # invalid on rank 0 only
    with pytest.raises(Exception, match=r"invalid on rank\(s\) 0 \(.*rank\(s\) 0: ValueError"):
        f(q, k, v, None, cu)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cu_seqlens=.0, 5.0, 16, 24.: must hold ints only"):
        f(q, k, v, None, [0, 5.0, 16, 24])
