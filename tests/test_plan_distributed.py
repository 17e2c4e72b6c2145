"""The cost model against real gloo ranks: the bytes it predicts are those the transports send
(counted by the kernel: /proc/self/io wchar, every byte handed to write / send), calibrate()
gives every rank the same machine, and strategy="auto" (ring_attention, ring_attention_varlen,
context_attention) gives the float64 reference's results, as the strategy it names does."""

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn import plan as P

from conftest import assert_matches, seeded_problem
from distributed import run_ranks
from reference import reference_attention
from tolerances import FP32

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/io"),
                                reason="needs /proc/self/io to count bytes sent")


def _bytes_written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def _bytes_cases(rank: int, world: int) -> None:
    seqlen, heads, kv_heads, dim = 96 * world, 4, 2, 32
    torch.manual_seed(rank)
    q = torch.randn(1, seqlen // world, heads, dim, requires_grad=True)
    k, v = (torch.randn(1, seqlen // world, kv_heads, dim, requires_grad=True) for _ in range(2))
    # bf16 inputs: K/V travel in bf16, the ring's dK/dV accumulators in fp32
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    calls = [
        (P.Candidate("ring", "zigzag"), "float32",
         lambda: cpattn.ring_attention(q, k, v, causal=True)),
        (P.Candidate("ring", "zigzag"), "bfloat16",
         lambda: cpattn.ring_attention(qb, kb, vb, causal=True)),
        (P.Candidate("allgather", "striped", chunk=1), "float32", lambda: cpattn.ring_attention(
            q, k, v, causal=True, layout="striped", strategy="allgather", allgather_chunk=1)),
        (P.Candidate("ulysses", "contiguous", world), "float32", lambda: cpattn.ulysses_attention(
            q, k, v, causal=True)),
    ]
    machine = P.PRESETS["cpu-gloo"]  # gloo: reduce-scatter sent as an all-reduce
    for (cand, dtype, call), mode in ((c, m) for c in calls for m in ("forward", "train")):
        if cand.strategy == "ulysses" and heads % world:
            continue
        dist.barrier()
        before = _bytes_written()
        out = call()
        if mode == "train":
            out.backward(torch.ones_like(out))
        sent = _bytes_written() - before
        dist.barrier()
        p = P.Problem(seqlen, heads, kv_heads, dim, dtype=dtype, causal=True, mode=mode)
        (pred,) = P.predict(p, machine, world, [cand])
        # gloo adds a small header per message and the agreement check one small all-gather
        assert abs(sent - pred.bytes_sent) <= 0.02 * pred.bytes_sent + 8192, (
            f"{cand.name} {dtype} {mode} W={world}: sent {sent}, predicted {pred.bytes_sent}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_predicted_bytes_are_the_bytes_sent(world):
    run_ranks(world, _bytes_cases)


def _calibrate_case(rank: int, world: int, cache: str) -> None:
    os.environ["CPATTN_PLAN_CACHE"] = cache
    m = P.calibrate(refresh=True)
    everyone = [None] * world
    dist.all_gather_object(everyone, m.to_json())
    assert len(set(everyone)) == 1  # the same machine on every rank
    assert m.source.startswith("measured") and m.ranks_per_node == world
    assert all(f > 1e8 for f in list(m.fwd_flops.values()) + list(m.bwd_flops.values()))
    assert m.intra.bandwidth > 1e6 and 0 < m.intra.latency < 0.1
    dist.barrier()
    assert P.calibrate() == m  # from the cache file now (rank 0's, broadcast)


def test_calibrate_gives_every_rank_the_same_machine(tmp_path):
    run_ranks(2, _calibrate_case, str(tmp_path))
    assert len(list(tmp_path.glob("machine-*.json"))) == 1


# Links that make one or the other win: the ring sends W fp32 dK/dV shards, the all-gather W - 1
# (sent once more by gloo's reduce-scatter), so only bandwidth -> ring; latency only -> the ring
# has fewer messages than the chunked gathers.
def _machine(bandwidth: float, latency: float) -> P.Machine:
    return dataclasses.replace(P.PRESETS["cpu-gloo"], intra=P.Link(bandwidth, latency),
                               inter=P.Link(bandwidth, latency), reduce_scatter_factor=1.0)


def _auto_ring_cases(rank: int, world: int) -> None:
    from cpattn.core.options import AttentionOptions
    from cpattn.strategies.ring import auto_strategy

    chosen = set()
    for n, (machine, layout, causal, window) in enumerate([
            (_machine(1e3, 0.0), "zigzag", True, (-1, -1)),
            (_machine(1e15, 1.0), "striped", True, (5, 0)),
            (_machine(1e3, 0.0), "contiguous", False, (-1, -1)),
            (_machine(1e15, 1.0), "zigzag", False, (3, 7))]):
        P.set_machine(machine)
        (q, k, v, dout), ref_out, ref_lse, ref_in, tol = seeded_problem(n, 8 * world, 4, 2,
                                                                   torch.float32, causal, window)
        results = {}
        for strategy in ("auto", "ring", "allgather"):
            shards = [cpattn.shard(t, layout=layout).requires_grad_() for t in (q, k, v)]
            out, lse = cpattn.ring_attention(*shards, causal=causal, window=window,
                                             layout=layout, strategy=strategy, return_lse=True)
            out.backward(cpattn.shard(dout, layout=layout))
            un = lambda t, d=1: cpattn.unshard(t, layout=layout, dim=d)  # noqa: E731
            results[strategy] = [un(out.detach()), un(lse.detach(), 2),
                                 *(un(s.grad) for s in shards)]
            assert_matches(f"ring_attention {strategy} {layout} W={world}",
                           *results[strategy][:2], results[strategy][2:], ref_out, ref_lse,
                           [r.grad for r in ref_in], tol)
        opts = AttentionOptions.checked("ring_attention", q.shape[-1], causal=causal,
                                        window=window)
        named = auto_strategy(shards[0], shards[1], world, None, opts, layout, None, None, None,
                              "ring_attention").strategy
        chosen.add(named)
        for a, b in zip(results["auto"], results[named]):
            assert torch.equal(a, b), f"auto ({named}) differs from {named}"
    assert chosen == {"ring", "allgather"}, chosen  # both choices exercised
    P.set_machine(None)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_auto_matches_reference_and_the_named_strategy(world):
    run_ranks(world, _auto_ring_cases)


def _auto_varlen_case(rank: int, world: int) -> None:
    P.set_machine(_machine(1e3, 0.0))
    lengths = [5, 2 * world * 3, 11]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    total = int(cu[-1])
    torch.manual_seed(7)
    q = torch.randn(total, 4, 16)
    k, v = (torch.randn(total, 2, 16) for _ in range(2))
    outs = {}
    for strategy in ("auto", "ring", "allgather"):
        shards = [cpattn.shard_varlen(t, cu) for t in (q, k, v)]
        out = cpattn.ring_attention_varlen(*shards, cu, causal=True, strategy=strategy)
        outs[strategy] = cpattn.unshard_varlen(out, cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref, _ = reference_attention(q[None, a:b].double(), k[None, a:b].double(),
                                     v[None, a:b].double(), causal=True, window=(-1, -1))
        torch.testing.assert_close(outs["auto"][a:b].double(), ref[0], atol=FP32, rtol=FP32)
    assert any(torch.equal(outs["auto"], outs[s]) for s in ("ring", "allgather"))
    P.set_machine(None)


def test_ring_attention_varlen_auto_matches_reference():
    run_ranks(2, _auto_varlen_case)


def _context_cases(rank: int, world: int) -> None:
    P.set_machine(P.PRESETS["cpu-gloo"])
    names = ["auto", "none", "ring/zigzag", "allgather/striped", "ulysses",
             "hybrid 2x2/zigzag" if world == 4 else "ring/contiguous"]
    for n, name in enumerate(names):
        causal, window = [(True, (-1, -1)), (False, (4, 2))][n % 2]
        (q, k, v, dout), ref_out, ref_lse, ref_in, tol = seeded_problem(n, 16 * world, 4, 2,
                                                                   torch.float32, causal, window)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.context_attention(*inputs, causal=causal, window=window,
                                            strategy=name, return_lse=True)
        out.backward(dout)
        assert_matches(f"context_attention {name} W={world}", out.detach(), lse.detach(),
                       [t.grad for t in inputs], ref_out, ref_lse, [r.grad for r in ref_in], tol)
    P.set_machine(None)


@pytest.mark.parametrize("world", [2, 4])
def test_context_attention_every_strategy_matches_reference(world):
    run_ranks(world, _context_cases)


def _disagreeing_grad(rank: int, world: int) -> None:
    P.set_machine(P.PRESETS["cpu-gloo"])
    q = torch.randn(1, 8, 4, 16, requires_grad=rank == 0)
    with pytest.raises(ValueError, match="requires_grad"):
        cpattn.ring_attention(q, q, q, strategy="auto", timeout=30)
    with pytest.raises(ValueError, match="strategy must be 'auto' or one of"):
        cpattn.context_attention(q.detach(), q.detach(), q.detach(), strategy="ring/diagonal")
    P.set_machine(None)


def test_auto_raises_on_every_rank_when_ranks_disagree_on_gradients():
    run_ranks(2, _disagreeing_grad)
