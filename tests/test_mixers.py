"""The mixer primitives in one process (W ranks emulated on threads, cpattn.testing.mixers)
against float64 token-by-token recurrences: the local kernels and their summaries, the fold's
associativity, gradcheck of the convolution halo and the state scan, and exactness on the
layouts cpattn shards with: contiguous, zigzag, per-document and document plans, pieces shorter
than the halo and than the scan block, a document over three or more ranks, a rank holding only
document starts. Real gloo ranks: tests/test_mixers_distributed.py."""

from __future__ import annotations

import pytest
import torch

from cpattn.mixers import build_piece_map, causal_conv, compose, state_scan
from cpattn.testing.mixers import emulate

from mixer_reference import (
    KINDS,
    conv_reference,
    problem,
    reference,
    scan_on_rank,
    sharded_problem,
    take,
)

F64 = torch.float64


def _rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=F64) * scale


# --- piece maps ---------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3, 4])
def test_plan_chains(world):
    """Contiguous: one piece per rank, chain in rank order; zigzag: fronts ascending then backs
    descending (the middle rank's two zigzag segments one piece); document plans tile every
    document."""
    total = 8 * world
    piece_map, _, _ = sharded_problem("sequence", world, (total,), "contiguous")
    assert piece_map.chain(0) == tuple((r, 0) for r in range(world))
    assert piece_map.slots == 1 and piece_map.predecessors(0) == ((),)
    piece_map, _, _ = sharded_problem("sequence", world, (total,), "zigzag")
    fronts = [(r, 0) for r in range(world - 1)] + [(world - 1, 0)]
    backs = [(r, 1) for r in reversed(range(world - 1))]
    assert piece_map.chain(0) == tuple(fronts + backs)
    assert len(piece_map.pieces[world - 1]) == 1
    lengths = (3, 40, 1, 2, 17, 5)
    for kind in ("per-document", "plan"):
        piece_map, _, bounds = sharded_problem(kind, world, lengths)
        assert bounds[-1] == sum(lengths)
        for d, n in enumerate(lengths):
            assert sum(piece_map.pieces[r][j].length for r, j in piece_map.chain(d)) == n


def test_plan_refuses_a_bad_tiling():
    with pytest.raises(RuntimeError, match="do not tile"):
        build_piece_map([torch.tensor([0, 1, 2]), torch.tensor([2, 3])], (0, 4))
    with pytest.raises(RuntimeError, match="held up to"):
        build_piece_map([torch.tensor([0, 1]), torch.tensor([-1])], (0, 3))


def test_padding_before_the_first_token_ends_a_piece():
    """A padding slot (-1) followed by global token 0 (a document plan's rank: split documents,
    their padding, then whole ones from the packed sequence's start) starts a new piece."""
    piece_map = build_piece_map([torch.tensor([3, 4, -1, 0, 1, 2])], (0, 3, 5))
    assert [(p.local, p.length, p.doc) for p in piece_map.pieces[0]] == [(0, 2, 1), (3, 3, 0)]


# --- the fold ----------------------------------------------------------------------------------

def test_fold_is_associative(gen):
    """(c + b) + a == c + (b + a) for every kind (the kernels' summaries against the token
    loops: tests/test_mixer_kernels.py)."""
    for kind, m_shape in (("scalar", (2,)), ("diagonal", (2, 3, 4)), ("matrix", (2, 3, 3))):
        parts = [(_rand(gen, *m_shape), _rand(gen, 2, 3, 4)) for _ in range(3)]
        a, b, c = parts
        left = compose(kind, compose(kind, c, b), a)
        right = compose(kind, c, compose(kind, b, a))
        for x, y in zip(left, right):
            torch.testing.assert_close(x, y)


# --- the sharded primitives -----------------------------------------------------------------------

CASES = [  # (sharding, world, document lengths, layout)
    ("sequence", 2, (24,), "contiguous"),
    ("sequence", 3, (30,), "zigzag"),
    ("sequence", 4, (16,), "zigzag"),  # pieces of 2 tokens: shorter than the halo (3)
    ("per-document", 3, (1, 2, 20, 3, 13), "zigzag"),  # padding, 1-token documents
    ("per-document", 4, (9, 30), "contiguous"),
    ("plan", 3, (2, 31, 1, 4, 5, 3, 6), "zigzag"),
    ("plan", 4, (40, 2, 2, 3, 1, 7), "contiguous"),
    ("plan", 2, (1, 2, 1, 3, 1, 1, 2, 40, 1, 1, 2, 5, 1, 3, 1, 1, 30, 2), "zigzag"),  # packed
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-W{c[1]}-{c[3]}")
def test_sharded_conv_and_scans_are_exact(gen, case):
    """Every rank's outputs (conv with a 4-tap kernel: halo 3; the four recurrences with
    scan blocks of 4, so that pieces are longer and shorter than a block) equal the float64
    per-document reference, batch 2 rows sharded alike (packed documents: 1 row)."""
    sharding, world, lengths, layout = case
    piece_map, indices, bounds = sharded_problem(sharding, world, lengths, layout)
    batch = 2 if sharding == "sequence" else 1
    p = problem(gen, batch, bounds[-1])
    x = _rand(gen, batch, bounds[-1], 5)
    weight, bias = _rand(gen, 5, 4), _rand(gen, 5)
    conv_ref = conv_reference(x, weight, bias, bounds)
    refs = {kind: reference(kind, p, bounds) for kind in KINDS}

    def rank_fn(rank, exchange):
        index = indices[rank]
        out = {"conv": causal_conv(take(x, index), weight, bias, piece_map, rank, exchange)}
        for kind in refs:
            out[kind] = scan_on_rank(kind, p, piece_map, index, rank, exchange, block=4)
        return out

    for rank, out in enumerate(emulate(world, rank_fn)):
        index = indices[rank]
        torch.testing.assert_close(out["conv"], take(conv_ref, index), msg=f"conv rank {rank}")
        for kind, ref in refs.items():
            torch.testing.assert_close(out[kind], take(ref, index), atol=1e-9, rtol=1e-9,
                                       msg=lambda m: f"{kind} rank {rank}: {m}")
    # Ablation: each rank on its own tokens only (nothing received) is not the reference.
    alone = emulate(world, lambda r, ex: rank_fn(r, lambda t: torch.zeros_like(ex(t))))
    for name, ref in (("conv", conv_ref), *refs.items()):
        assert any(not torch.allclose(out[name], take(ref, indices[r]), atol=1e-6)
                   for r, out in enumerate(alone)), f"{name}: the test cannot fail"


def test_rank_with_only_document_starts_takes_part(gen):
    """Rank 0 holds only whole documents (every piece starts its document: nothing to receive)
    while the others share a split one: every rank still calls the exchange in the forward and
    the backward (else the others would wait for it), and the results are exact."""
    indices = [torch.tensor([0, 1, 2, 3, 4]), torch.tensor([5, 6, 7, 8]),
               torch.tensor([9, 10, 11, 12])]
    bounds = (0, 2, 5, 13)  # documents [0, 2), [2, 5) on rank 0; [5, 13) over ranks 1 and 2
    piece_map = build_piece_map(indices, bounds)
    assert all(piece_map.starts_document(0)) and piece_map.predecessors(0) == ()
    calls = [0] * 3
    p = problem(gen, 1, 13)
    for t in p.values():
        t.requires_grad_(True)
    x = _rand(gen, 1, 13, 5).requires_grad_(True)
    weight = _rand(gen, 5, 3)

    def rank_fn(rank, exchange):
        def counted(t):
            calls[rank] += 1
            return exchange(t)
        conv = causal_conv(take(x, indices[rank]), weight, None, piece_map, rank, counted)
        return conv, scan_on_rank("matrix", p, piece_map, indices[rank], rank, counted, block=4)

    outs = emulate(3, rank_fn)
    assert calls == [2, 2, 2]  # halo and summaries, on every rank
    loss = sum((c.square().sum() + y.square().sum()) for c, y in outs)
    loss.backward()
    for rank, (conv, y) in enumerate(outs):
        torch.testing.assert_close(conv, take(conv_reference(x, weight, None, bounds),
                                              indices[rank]))
        torch.testing.assert_close(y, take(reference("matrix", p, bounds), indices[rank]))
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    # Entry states are exactly zero at document starts, whatever the others publish; rank 0's
    # whole documents have none.
    linked = [len(piece_map.linked(r)) for r in range(3)]
    assert linked == [0, 1, 1]
    summaries = [(_rand(gen, 1, n, 2, 3, 3), _rand(gen, 1, n, 2, 3, 4)) for n in linked]
    entries = emulate(3, lambda r, ex: state_scan(*summaries[r], piece_map, r, "matrix", ex))
    assert entries[0].shape[1] == 0 and bool((entries[1][:, 0] == 0).all())
    assert not bool((entries[2] == 0).all())


def test_rank_without_tokens(gen):
    """A rank holding no token (a document plan with fewer documents than ranks) takes part in
    the exchanges and gives empty outputs; the others are exact."""
    indices = [torch.tensor([0, 1, 2, 3, 4, 5]), torch.tensor([], dtype=torch.int64),
               torch.tensor([6, 7, 8])]
    bounds = (0, 4, 9)
    piece_map = build_piece_map(indices, bounds)
    p = problem(gen, 1, 9)
    x, weight = _rand(gen, 1, 9, 3), _rand(gen, 3, 3)

    def rank_fn(rank, exchange):
        out = {"conv": causal_conv(take(x, indices[rank]), weight, None, piece_map, rank, exchange)}
        for kind in KINDS:
            out[kind] = scan_on_rank(kind, p, piece_map, indices[rank], rank, exchange, block=4)
        return out

    outs = emulate(3, rank_fn)
    assert all(t.shape[1] == 0 for t in outs[1].values())
    for rank in (0, 2):
        torch.testing.assert_close(outs[rank]["conv"],
                                   take(conv_reference(x, weight, None, bounds), indices[rank]))
        for kind in KINDS:
            torch.testing.assert_close(outs[rank][kind],
                                       take(reference(kind, p, bounds), indices[rank]))


def test_gradcheck_conv_halo_and_state_scan(gen):
    """torch.autograd.gradcheck of the sharded conv (inputs, weight, bias) and of the state scan
    (summaries of every kind) over 3 emulated zigzag ranks with two documents, float64."""
    piece_map, indices, bounds = sharded_problem("per-document", 3, (7, 11), "zigzag")
    x = _rand(gen, 1, bounds[-1], 2).requires_grad_(True)
    weight = _rand(gen, 2, 3).requires_grad_(True)
    bias = _rand(gen, 2).requires_grad_(True)

    def conv(x, weight, bias):
        outs = emulate(3, lambda r, ex: causal_conv(take(x, indices[r]), weight, bias, piece_map, r,
                                                     ex))
        return torch.cat(outs, 1)

    assert torch.autograd.gradcheck(conv, (x, weight, bias), fast_mode=True)
    counts = [len(piece_map.linked(r)) for r in range(3)]
    for kind, m_shape in (("scalar", (2,)), ("diagonal", (2, 2, 3)), ("matrix", (2, 2, 2))):
        ms = [(_rand(gen, 1, n, *m_shape) * 0.5).requires_grad_(True) for n in counts]
        ss = [_rand(gen, 1, n, 2, 2, 3).requires_grad_(True) for n in counts]

        def scan(*tensors):
            outs = emulate(3, lambda r, ex: state_scan(tensors[r], tensors[3 + r], piece_map, r,
                                                        kind, ex))
            return torch.cat([o.flatten() for o in outs])

        assert torch.autograd.gradcheck(scan, (*ms, *ss), fast_mode=True), kind


def test_striped_is_a_piece_per_token():
    """The striped layout makes every token a piece (what the integration refuses)."""
    piece_map, _, _ = sharded_problem("sequence", 2, (16,), "striped")
    assert [len(ps) for ps in piece_map.pieces] == [8, 8]
