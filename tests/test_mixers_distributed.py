"""The mixer primitives on real gloo ranks (W = 2, 3, 4, one spawn each): the convolution halo and
the three kinds of state scan, forward and backward, on the piece map and exchange of a
cpattn.ContextParallel (contiguous and zigzag sequences, a document plan, per-document packing,
and at W = 4 the 2 x 2 hybrid mesh), against the float64 reference computed by every rank over
the whole sequence: outputs, every local input's gradient and the shared parameters' (summed
over the ranks). The striped layout and invariant mode are refused on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.mixers import causal_conv
from cpattn.mixers.sharded import exchange_of, piece_map_of
from cpattn.sharding.packing import Documents

from distributed import run_ranks
from mixer_reference import KINDS, conv_reference, problem, reference, scan_on_rank, take

# packed documents: shorter than the halo, one over >= 3 ranks; at W = 4 the document plan
# leaves rank 3 only whole documents (nothing to receive, it still joins every collective)
LENGTHS = (2, 29, 1, 5, 3, 14)


def _case(name: str, cp: cpattn.ContextParallel, docs) -> None:
    """Forward and backward of conv + scans on cp's sharding, against the reference."""
    world = cp.world_size
    total = docs.tokens if docs is not None else 12 * world
    if docs is None:
        index = cp.positions(total)
        bounds, batch = (0, total), 2
    else:
        index = cp.document_positions(docs)[0]
        bounds, batch = docs.cu_seqlens, 1
    piece_map = piece_map_of(cp, index.numel(), docs)
    exchange = exchange_of(cp)
    gen = torch.Generator().manual_seed(7)  # the same global problem on every rank
    p = problem(gen, batch, total)
    x = torch.randn(batch, total, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64).requires_grad_(True)
    bias = torch.randn(5, generator=gen, dtype=torch.float64).requires_grad_(True)
    douts = {kind: torch.randn(batch, total, *shape, generator=gen, dtype=torch.float64)
             for kind, shape in (("conv", (5,)), ("scalar", (2, 4)), ("matrix", (2, 4)),
                                 ("kda", (2, 4)), ("diagonal", (4,)))}
    # Reference: the whole sequence, each document from zero, one process.
    ref_in = {n: t.clone().requires_grad_(True) for n, t in p.items()}
    ref_x, ref_w, ref_b = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))
    refs = {"conv": conv_reference(ref_x, ref_w, ref_b, bounds)}
    refs.update({kind: reference(kind, ref_in, bounds) for kind in KINDS})
    sum((refs[k] * douts[k]).sum() for k in refs).backward()
    # This rank's part.
    local = {n: take(t, index).requires_grad_(True) if n != "A" else t.clone().requires_grad_()
             for n, t in p.items()}
    x_local = take(x, index).requires_grad_(True)
    outs = {"conv": causal_conv(x_local, weight, bias, piece_map, cp.rank, exchange)}
    for kind in KINDS:
        outs[kind] = scan_on_rank(kind, {**local}, piece_map, None, cp.rank, exchange, block=4)
    sum((outs[k] * take(douts[k], index)).sum() for k in outs).backward()
    for k in outs:
        torch.testing.assert_close(outs[k], take(refs[k].detach(), index), atol=1e-9,
                                   rtol=1e-9, msg=lambda m: f"{name} {k} rank {cp.rank}: {m}")
    for n, t in local.items():
        grad = t.grad
        expected = ref_in[n].grad
        if n == "A":  # a parameter: every rank's share summed
            dist.all_reduce(grad)
        else:
            expected = take(expected, index)
        torch.testing.assert_close(grad, expected, atol=1e-9, rtol=1e-9,
                                   msg=lambda m: f"{name} d{n} rank {cp.rank}: {m}")
    torch.testing.assert_close(x_local.grad, take(ref_x.grad, index), atol=1e-9, rtol=1e-9)
    for param, ref in ((weight, ref_w), (bias, ref_b)):
        grad = param.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad, ref.grad, atol=1e-9, rtol=1e-9)


def _checks(rank: int, world: int) -> None:
    starts = (0,) * len(LENGTHS)
    cases = [
        ("contiguous", cpattn.ContextParallel(layout="contiguous"), None),
        ("zigzag", cpattn.ContextParallel(layout="zigzag"), None),
        ("document plan", cpattn.ContextParallel(strategy="ring"),
         Documents(LENGTHS, starts, plan=cpattn.shard_documents(
             torch.tensor((0, *LENGTHS)).cumsum(0), world_size=world, split="balanced"))),
        ("per-document", cpattn.ContextParallel(strategy="ulysses"), Documents(LENGTHS, starts)),
    ]
    if world == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2))
        hybrid = cpattn.ContextParallel(mesh, strategy="hybrid")
        cases += [("hybrid", hybrid, None), ("hybrid per-document", hybrid,
                                            Documents(LENGTHS, starts))]
    for name, cp, docs in cases:
        _case(name, cp, docs)
    if world == 4:  # the plan leaves rank 3 only whole documents: it joined every collective
        piece_map = piece_map_of(cases[2][1], cases[2][2].plan.tokens[rank], cases[2][2])
        assert (all(piece_map.starts_document(3)) and not piece_map.published(3)
                and piece_map.slots > 0)
    for settings, match in ((dict(layout="striped"), "striped layout"),
                            (dict(invariant=True), "invariant mode")):
        with pytest.raises(ValueError, match=match):
            piece_map_of(cpattn.ContextParallel(**settings), 8)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_primitives_on_gloo_ranks(world):
    run_ranks(world, _checks)
