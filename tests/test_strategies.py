"""Ulysses, hybrid (Ulysses x ring) and the autograd collectives of cpattn.comm on real gloo
ranks, against the float64 reference on the full sequence (forward, LSE and gradients)."""

import itertools

import pytest
import torch
import torch.distributed as dist

import cpattn

from conftest import assert_matches, seeded_problem
from distributed import run_ranks

MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (9, 0)), (False, (5, 7))]


def _ulysses_cases(rank: int, world: int) -> None:
    seqlen = 6 * world
    cases = itertools.product(MASKS, [12, 4, 2, 1], [torch.float32, torch.bfloat16])
    for n, ((causal, window), kv_heads, dtype) in enumerate(cases):
        (q, k, v, dout), ref_out, ref_lse, ref_in, tol = seeded_problem(
            n, seqlen, 12, kv_heads, dtype, causal, window)
        shards = [cpattn.shard(t, layout="contiguous").requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.ulysses_attention(*shards, causal=causal, window=window,
                                            return_lse=True)
        out.backward(cpattn.shard(dout, layout="contiguous"))
        un = lambda t, d=1: cpattn.unshard(t, layout="contiguous", dim=d)  # noqa: E731
        assert_matches(f"ulysses W={world} kv={kv_heads} causal={causal} window={window} {dtype}",
                       un(out.detach()), un(lse.detach(), 2), [un(s.grad) for s in shards],
                       ref_out, ref_lse, [r.grad for r in ref_in], tol)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ulysses_matches_reference(world):
    run_ranks(world, _ulysses_cases)


def _ulysses_errors(rank: int, world: int) -> None:
    q = torch.randn(1, 4, 3, 16)  # 3 heads over 2 ranks
    with pytest.raises(ValueError, match="divisible by the Ulysses group size"):
        cpattn.ulysses_attention(q, q, q, timeout=20)
    q = torch.randn(1, 4, 4, 16 if rank == 0 else 8)
    with pytest.raises(ValueError, match="ranks disagree on q.head_dim"):
        cpattn.ulysses_attention(q, q, q, timeout=20)
    dist.barrier()


def test_ulysses_bad_input_raises_on_every_rank():
    run_ranks(2, _ulysses_errors)


def _hybrid_groups(world: int, u: int):
    """(ulysses_group, ring_group) of this rank for rank = ring_index * u + ulysses_index."""
    r = world // u
    mine_u = mine_r = None
    for i in range(r):  # every rank creates every group, in the same order
        g = dist.new_group([i * u + j for j in range(u)])
        if dist.get_rank() // u == i:
            mine_u = g
    for j in range(u):
        g = dist.new_group([i * u + j for i in range(r)])
        if dist.get_rank() % u == j:
            mine_r = g
    return mine_u, mine_r


def _hybrid_cases(rank: int, world: int, u: int) -> None:
    ug, rg = _hybrid_groups(world, u)
    seqlen = 8 * world
    for n, ((causal, window), layout, kv_heads) in enumerate(
        itertools.product(MASKS, ["zigzag", "contiguous", "striped"], [4, 1])
    ):
        (q, k, v, dout), ref_out, ref_lse, ref_in, tol = seeded_problem(
            n, seqlen, 4, kv_heads, torch.float32, causal, window)
        kw = dict(ulysses_group=ug, ring_group=rg, layout=layout)
        shards = [cpattn.hybrid_shard(t, **kw).requires_grad_() for t in (q, k, v)]
        out, lse = cpattn.hybrid_attention(*shards, causal=causal, window=window,
                                           return_lse=True, **kw)
        out.backward(cpattn.hybrid_shard(dout, **kw))
        un = lambda t, d=1: cpattn.hybrid_unshard(t, dim=d, **kw)  # noqa: E731
        assert_matches(f"hybrid W={world} U={u} {layout} kv={kv_heads} causal={causal} {window}",
                       un(out.detach()), un(lse.detach(), 2), [un(s.grad) for s in shards],
                       ref_out, ref_lse, [r.grad for r in ref_in], tol)


@pytest.mark.parametrize("u", [1, 2, 4])
def test_hybrid_factorisations_match_reference(u):
    run_ranks(4, _hybrid_cases, u)


def _hybrid_mesh(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    ug, rg = mesh.get_group(1), mesh.get_group(0)
    (q, k, v, _), ref_out, _, _, _ = seeded_problem(0, 32, 4, 2, torch.float32, True, (-1, -1))
    kw = dict(ulysses_group=ug, ring_group=rg)
    out = cpattn.hybrid_attention(*(cpattn.hybrid_shard(t, **kw) for t in (q, k, v)),
                                  mesh=mesh, causal=True)
    torch.testing.assert_close(cpattn.hybrid_unshard(out, **kw).double(), ref_out.detach(),
                               atol=2e-5, rtol=2e-5)


def test_hybrid_accepts_a_device_mesh():
    run_ranks(4, _hybrid_mesh)


def _comm_cases(rank: int, world: int) -> None:
    torch.manual_seed(5)
    full = torch.randn(2, 4 * world, 6 * world, 3, dtype=torch.float64)
    mine = full.chunk(world, dim=1)[rank].clone().requires_grad_()
    gathered = cpattn.comm.all_gather(mine, dim=1)
    assert torch.equal(gathered, full)
    weight = torch.arange(gathered.numel(), dtype=torch.float64).reshape(gathered.shape)
    (gathered * weight).sum().backward()
    # every rank's loss uses the gathered tensor: the shard's gradient is the sum over ranks
    assert torch.allclose(mine.grad, world * weight.chunk(world, dim=1)[rank])

    x = (full * (rank + 1)).requires_grad_()
    part = cpattn.comm.reduce_scatter(x, dim=2)
    expected = full.chunk(world, dim=2)[rank] * sum(range(1, world + 1))
    assert torch.allclose(part, expected)
    part.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))

    y = mine.detach().requires_grad_()  # (2, 4, 6W, 3): scatter heads-like dim 2, gather dim 1
    z = cpattn.comm.all_to_all(y, scatter_dim=2, gather_dim=1)
    assert torch.equal(z, full.chunk(world, dim=2)[rank])
    back = cpattn.comm.all_to_all(z, scatter_dim=1, gather_dim=2)
    assert torch.equal(back, y)
    (z * z).sum().backward()
    assert torch.allclose(y.grad, 2 * y)


@pytest.mark.parametrize("world", [1, 3])
def test_comm_collectives_and_their_gradients(world):
    run_ranks(world, _comm_cases)
