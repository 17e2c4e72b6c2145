"""The tree state scan (cpattn.mixers.tree_scan) in one process, W ranks emulated on threads
(cpattn.testing.mixers.emulate), against a float64 sequential fold of random summaries: every
kind, W = 1..16, the piece maps cpattn shards with (contiguous, zigzag, per-document, document
plans with many documents) and random ones (chains visiting the ranks in any order, a rank
holding several pieces of one chain or none); gradients by gradcheck and against the fold's;
the messages it sends are those the planner's model counts; the method's choice. Real gloo
ranks (W = 2, 4, 8 over gloo, point to point): the same checks on the piece maps of a
cpattn.ContextParallel (zigzag, contiguous, a document plan, per-document, the hybrid mesh) and a
random one, and one training step of a gated delta rule and a Mamba-2 model with the tree scan
forced ($CPATTN_MIXER_SCAN=tree), exact against one process."""

from __future__ import annotations

import pytest
import torch

import cpattn
from cpattn.mixers import build_piece_map, state_scan
from cpattn.mixers import tree_scan as T
from cpattn.mixers.tree_scan import scan_method, scan_traffic, tree_plan, with_scan
from cpattn.plan.mixer_scan import tree_messages, tree_steps
from cpattn.testing.mixers import emulate

from distributed import run_ranks
from mixer_reference import sharded_problem

F64 = torch.float64
KIND_SHAPES = {"scalar": (2,), "diagonal": (2, 3, 4), "matrix": (2, 3, 3)}  # M; states (2, 3, 4)


def scan_rows(piece_map, rank: int) -> tuple:
    """The pieces state_scan's rows stand for: every piece of the rank, or only its linked ones
    where the piece map has them (issue 54 item 1); the tree scan takes both."""
    linked = getattr(piece_map, "linked", None)
    return linked(rank) if linked is not None else tuple(range(len(piece_map.pieces[rank])))


def summaries(gen, piece_map, kind: str, batch: int = 2, rows=scan_rows):
    """Random fp64 summaries (m, s) per rank, transitions scaled to keep folds moderate."""
    out = []
    for r in range(piece_map.world):
        n = len(rows(piece_map, r))
        m = torch.randn(batch, n, *KIND_SHAPES[kind], generator=gen, dtype=F64) * 0.6
        out.append((m, torch.randn(batch, n, 2, 3, 4, generator=gen, dtype=F64)))
    return out


def _apply(kind, m, s):
    if kind == "matrix":
        return m @ s
    return m[..., None, None] * s if kind == "scalar" else m * s


def fold_reference(piece_map, sums, kind, rows=scan_rows):
    """Entry states per rank (B, n, 2, 3, 4): each chain folded piece by piece in global order."""
    out = [torch.zeros_like(s) for _, s in sums]
    for d in range(len(piece_map.bounds) - 1):
        state = None
        for r, j in piece_map.chain(d):
            if j not in rows(piece_map, r):
                continue  # a whole document's piece: not a row (its entry is zero)
            i = rows(piece_map, r).index(j)
            m, s = sums[r][0][:, i], sums[r][1][:, i]
            if state is not None:
                out[r][:, i] = state
            state = s if state is None else _apply(kind, m, state) + s
    return out


def random_sharding(gen, world: int, lengths: tuple):
    """Every rank's global indices for documents of these lengths cut into random runs dealt to
    random ranks, each rank's runs in random order (so chains visit the ranks in any order and a
    rank may hold several pieces of one chain, or none)."""
    total = sum(lengths)
    cuts = sorted(set(torch.randint(1, total, (total // 3,), generator=gen).tolist()))
    runs = [list(range(a, b)) for a, b in zip([0] + cuts, cuts + [total])]
    owner = torch.randint(0, world, (len(runs),), generator=gen).tolist()
    indices = []
    for r in range(world):
        mine = [run for run, o in zip(runs, owner) if o == r]
        order = torch.randperm(len(mine), generator=gen).tolist()
        indices.append(torch.tensor([i for k in order for i in mine[k]], dtype=torch.int64))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    return build_piece_map(indices, tuple(bounds))


def piece_maps(gen, world: int) -> dict:
    """Named piece maps of `world` ranks."""
    maps = {layout: sharded_problem("sequence", world, (4 * world,), layout)[0]
            for layout in ("zigzag", "contiguous")}
    many = tuple(int(n) for n in torch.randint(1, 3 * world, (12,), generator=gen))
    maps["per-document"] = sharded_problem("per-document", world, many[:5], "zigzag")[0]
    maps["plan"] = sharded_problem("plan", world, many, "zigzag")[0]
    maps["random"] = random_sharding(gen, world, many)
    return maps


def run_scan(piece_map, sums, kind, method, exchange_wrap=None):
    def rank_fn(r, ex):
        ex = exchange_wrap(r, ex) if exchange_wrap else ex
        return state_scan(*sums[r], piece_map, r, kind, with_scan(ex, method))
    return emulate(piece_map.world, rank_fn)


@pytest.mark.parametrize("world", list(range(1, 17)))
def test_tree_scan_equals_the_fold(gen, world):
    """Forward, float64: the tree scan's entry states equal the sequential fold (and the
    all-gather's) for every kind on every piece map; pieces that start a document get exactly
    zero."""
    for name, piece_map in piece_maps(gen, world).items():
        for kind in KIND_SHAPES:
            sums = summaries(gen, piece_map, kind)
            ref = fold_reference(piece_map, sums, kind)
            tree = run_scan(piece_map, sums, kind, "tree")
            for r in range(world):
                torch.testing.assert_close(tree[r], ref[r], atol=1e-12, rtol=1e-12,
                                           msg=lambda m: f"{name} {kind} W={world} rank {r}: {m}")
                starts = piece_map.starts_document(r)
                for i, j in enumerate(scan_rows(piece_map, r)):
                    if starts[j]:
                        assert bool((tree[r][:, i] == 0).all()), (name, kind, r, j)
            if world in (4, 9):  # and the all-gather agrees (its own tests: test_mixers.py)
                gathered = run_scan(piece_map, sums, kind, "allgather")
                for r in range(world):
                    torch.testing.assert_close(tree[r], gathered[r], atol=1e-12, rtol=1e-12)


def test_tree_scan_takes_linked_rows_only(gen):
    """Rows of only the linked pieces (documents split over ranks) give those pieces' entries."""
    piece_map = sharded_problem("plan", 4, (2, 31, 1, 4, 5, 3, 6, 9, 1), "zigzag")[0]

    def linked(pm, r):
        return tuple(j for j, p in enumerate(pm.pieces[r]) if len(pm.chain(p.doc)) > 1)

    assert any(len(linked(piece_map, r)) < len(piece_map.pieces[r]) for r in range(4))
    sums = summaries(gen, piece_map, "matrix", rows=linked)
    ref = fold_reference(piece_map, sums, "matrix", rows=linked)
    got = emulate(4, lambda r, ex: T.tree_scan(*sums[r], piece_map, r, "matrix", ex))
    for r in range(4):
        torch.testing.assert_close(got[r], ref[r], atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match=r"tree_scan: summaries for 7 pieces on rank 0"):
        T.tree_scan(torch.zeros(1, 7, 2), torch.zeros(1, 7, 2, 3, 4), piece_map, 0, "scalar",
                    lambda x: x[None])


def test_gradients_equal_the_folds(gen):
    """Backward, float64: d(entries . g) / d(summaries) of the tree scan equals autograd through
    the sequential fold, every kind, zigzag W = 5 and a random sharding W = 6."""
    cases = [sharded_problem("sequence", 5, (20,), "zigzag")[0],
             random_sharding(gen, 6, (7, 19, 3, 11))]
    for piece_map in cases:
        for kind in KIND_SHAPES:
            sums = [tuple(t.requires_grad_(True) for t in pair)
                    for pair in summaries(gen, piece_map, kind)]
            weights = [torch.randn(s.shape, generator=gen, dtype=F64) for _, s in sums]
            ref = fold_reference(piece_map, sums, kind)
            flat = [t for pair in sums for t in pair]
            expected = torch.autograd.grad(sum((e * w).sum() for e, w in zip(ref, weights)), flat,
                                           allow_unused=True)  # (a chain's last piece: unused)
            tree = run_scan(piece_map, sums, kind, "tree")
            got = torch.autograd.grad(sum((e * w).sum() for e, w in zip(tree, weights)), flat,
                                      allow_unused=True)
            for g, e, t in zip(got, expected, flat):
                torch.testing.assert_close(*(x if x is not None else torch.zeros_like(t)
                                             for x in (g, e)), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", list(KIND_SHAPES))
def test_gradcheck_tree_scan(gen, kind):
    """torch.autograd.gradcheck of the tree scan over 4 emulated ranks: two documents, zigzag
    per document (chains through every rank, back and forth)."""
    piece_map = sharded_problem("per-document", 4, (13, 9), "zigzag")[0]
    sums = summaries(gen, piece_map, kind, batch=1)
    tensors = [t.requires_grad_(True) for pair in sums for t in pair]

    def scan(*flat):
        pairs = [(flat[2 * r], flat[2 * r + 1]) for r in range(4)]
        return torch.cat([o.flatten() for o in run_scan(piece_map, pairs, kind, "tree")])

    assert torch.autograd.gradcheck(scan, tensors, fast_mode=True)


def test_messages_are_what_the_model_counts(gen):
    """Each route moves the rows the planner's traffic (scan_traffic) counts, B-only messages
    where the receiver composes nothing later; every rank calls every route (emulate would hang
    otherwise) and the number of routes is the schedule's steps."""
    for piece_map in (sharded_problem("sequence", 7, (28,), "zigzag")[0],
                      random_sharding(gen, 5, (30, 4, 17))):
        world = piece_map.world
        traffic = scan_traffic(piece_map)
        sums = summaries(gen, piece_map, "matrix", batch=3)
        full, state = 3 * (2 * 3 * 3 + 2 * 3 * 4), 3 * 2 * 3 * 4  # numbers per row
        seen = [[] for _ in range(world)]

        def counting(r, ex):
            def exchange(x):
                return ex(x)

            def route(x, edges, rank, tag):
                seen[r].append((tag, sum(n for s, _, n in edges if s == r),
                                sum(n for _, d, n in edges if d == r)))
                return T.route(ex, x, edges, rank, tag)
            exchange.route = route
            return exchange

        run_scan(piece_map, sums, "matrix", "tree", counting)
        steps = len(tree_plan(piece_map, 0).steps)
        assert steps == max(tree_steps(len(piece_map.chain(d)))
                            for d in range(len(piece_map.bounds) - 1))
        for r in range(world):
            assert [t for t, _, _ in seen[r]] == list(range(steps))
            for (_, sent, got), row in zip(seen[r], traffic.tree):
                fs, ss, fr, sr = row[r][:4]
                assert (sent, got) == (fs * full + ss * state, fr * full + sr * state)


def test_schedule_covers_every_predecessor():
    """Under tree_messages, piece c of a chain of L pieces ends with the fold of exactly pieces
    0..c-1 in order, and a B-only message goes to a piece that composes nothing later."""
    for length in range(1, 70):
        cover = {c: [] for c in range(length)}  # what E_c folds, oldest first
        later = {c: [] for c in range(length)}
        for t in range(tree_steps(length)):
            sent = {b: list(cover[a]) if t else [a] for a, b, _ in tree_messages(length, t)}
            for _, b, full in tree_messages(length, t):
                cover[b] = sent[b] + cover[b]
                later[b].append((t, full))
        for c in range(length):
            assert cover[c] == list(range(c)), (length, c)
            for i, (t, full) in enumerate(later[c]):
                assert full == (i + 1 < len(later[c])), (length, c, t)


def test_ablation_one_step_short_fails(gen, monkeypatch):
    """The test can fail: a schedule one step short leaves the longest chains' entries without
    their first pieces."""
    piece_map = sharded_problem("sequence", 6, (24,), "zigzag")[0]
    sums = summaries(gen, piece_map, "matrix")
    ref = fold_reference(piece_map, sums, "matrix")
    monkeypatch.setattr(T, "tree_steps", lambda n: max(0, tree_steps(n) - 1))
    tree_plan.cache_clear()
    try:
        short = run_scan(piece_map, sums, "matrix", "tree")
    finally:
        monkeypatch.undo()
        tree_plan.cache_clear()
    assert any(not torch.allclose(a, b) for a, b in zip(short, ref))


def test_method_choice(monkeypatch):
    """with_scan wins, then $CPATTN_MIXER_SCAN, then auto: one process playing W ranks keeps the
    all-gather. Unknown names raise."""
    piece_map = sharded_problem("sequence", 4, (16,), "zigzag")[0]
    args = (piece_map, "matrix", (2, 3, 3), (2, 3, 4), 1, "cpu")
    monkeypatch.delenv("CPATTN_MIXER_SCAN", raising=False)
    assert scan_method(emulate, *args) == "allgather"
    assert scan_method(with_scan(emulate, "tree"), *args) == "tree"
    monkeypatch.setenv("CPATTN_MIXER_SCAN", "tree")
    assert scan_method(emulate, *args) == "tree"
    assert scan_method(with_scan(emulate, "allgather"), *args) == "allgather"
    monkeypatch.setenv("CPATTN_MIXER_SCAN", "fast")
    with pytest.raises(ValueError, match=r"CPATTN_MIXER_SCAN='fast': must be one of"):
        scan_method(emulate, *args)
    with pytest.raises(ValueError, match=r"with_scan: method='ring': must be one of"):
        with_scan(emulate, "ring")


def test_padding_before_the_first_document_token():
    """A document plan can put padding just before global index 0 on a rank (as
    cpattn.shard_documents does): that token still starts a piece (was: the piece map lost
    document 0, "held up to 0 only")."""
    piece_map = build_piece_map([torch.tensor([5, 6, -1, -1, 0, 1, 2]), torch.tensor([3, 4, 7])],
                                (0, 5, 8))
    assert [(p.start, p.length) for p in piece_map.pieces[0]] == [(5, 2), (0, 3)]
    assert piece_map.chain(0) == ((0, 1), (1, 0))


# --- real gloo ranks --------------------------------------------------------------------------

LENGTHS = (2, 29, 1, 5, 3, 14, 40, 7)  # packed: short and long, one over >= 3 ranks


def _rank_checks(name: str, piece_map, rank: int, exchange) -> None:
    """On this rank: the tree scan of random summaries (the same on every rank: one seed) equals
    the float64 fold, forward and the gradient of its own summaries; its routes sent point to
    point."""
    from cpattn.mixers.exchange import GroupExchange

    assert isinstance(exchange, GroupExchange)
    sent = []

    class Counted:
        def __call__(self, x):
            return exchange(x)

        def route(self, x, edges, r, tag):
            sent.append(sum(n for src, _, n in edges if src == r))
            return exchange.route(x, edges, r, tag)

    gen = torch.Generator().manual_seed(11)
    for kind in KIND_SHAPES:
        sums = [tuple(t.requires_grad_(True) for t in pair)
                for pair in summaries(gen, piece_map, kind)]
        weights = [torch.randn(s.shape, generator=gen, dtype=F64) for _, s in sums]
        ref = fold_reference(piece_map, sums, kind)
        expected = torch.autograd.grad(sum((e * w).sum() for e, w in zip(ref, weights)),
                                       sums[rank], allow_unused=True)
        mine = [t.detach().clone().requires_grad_(True) for t in sums[rank]]
        got = state_scan(*mine, piece_map, rank, kind, with_scan(Counted(), "tree"))
        (got * weights[rank]).sum().backward()
        what = f"{name} {kind} rank {rank} of {piece_map.world}"
        torch.testing.assert_close(got, ref[rank].detach(), atol=1e-12, rtol=1e-12,
                                   msg=lambda m: f"{what}: {m}")
        for g, e, t in zip((mine[0].grad, mine[1].grad), expected, mine):
            torch.testing.assert_close(*(x if x is not None else torch.zeros_like(t)
                                         for x in (g, e)), atol=1e-12, rtol=1e-12,
                                       msg=lambda m: f"{what} grad: {m}")
    assert len(sent) == 3 * len(tree_plan(piece_map, rank).steps), (name, sent)


def _on_ranks(rank: int, world: int) -> None:
    from cpattn.mixers.sharded import exchange_of, piece_map_of
    from cpattn.sharding.packing import Documents

    starts = (0,) * len(LENGTHS)
    cu = torch.tensor((0, *LENGTHS)).cumsum(0)
    plan = cpattn.shard_documents(cu, world_size=world, split="balanced")
    cases = [("zigzag", cpattn.ContextParallel(layout="zigzag"), None),
             ("contiguous", cpattn.ContextParallel(layout="contiguous"), None),
             ("plan", cpattn.ContextParallel(strategy="ring"), Documents(LENGTHS, starts, plan)),
             ("per-document", cpattn.ContextParallel(strategy="ulysses"),
              Documents(LENGTHS, starts))]
    if world >= 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = cpattn.ContextParallel(init_device_mesh("cpu", (2, world // 2)), strategy="hybrid")
        cases += [("hybrid", mesh, None), ("hybrid per-document", mesh, Documents(LENGTHS, starts))]
    for name, cp, docs in cases:
        if docs is None:
            local = cp.positions(8 * world).numel()
        else:
            local = cp.document_positions(docs)[0].numel()
        _rank_checks(name, piece_map_of(cp, local, docs), cp.rank, exchange_of(cp))
    cp = cpattn.ContextParallel()
    gen = torch.Generator().manual_seed(5)  # the same random piece map on every rank
    _rank_checks("random", random_sharding(gen, world, (30, 4, 17, 9)), cp.rank, exchange_of(cp))
    _auto_is_the_planners(cp, piece_map_of(cpattn.ContextParallel(layout="zigzag"), 8))


def _auto_is_the_planners(cp, piece_map) -> None:
    """"auto" over a process group: the model's choice with the group's known machine."""
    from cpattn.mixers.sharded import exchange_of
    from cpattn.plan import set_machine
    from cpattn.plan.mixer_scan import LAYERS, MixerLayer, predict_scan
    from cpattn.plan.model import machine

    exchange = exchange_of(cp)
    for layer in (LAYERS["qwen3.5-27b"], MixerLayer("small", "matrix", 2, 3, 4)):
        h, k, v = layer.heads, layer.key_dim, layer.value_dim
        set_machine(machine("h100-ib"), exchange.group)
        try:
            got = scan_method(with_scan(exchange, "auto"), piece_map, "matrix", (h, k, k),
                              (h, k, v), 1, "cpu")
        finally:
            set_machine(None, exchange.group)
        one = MixerLayer(layer.name, "matrix", h, k, v)  # (the layer count is 1 at run time)
        assert got == predict_scan(one, scan_traffic(piece_map), machine("h100-ib"))[0].method


@pytest.mark.parametrize("world", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
def test_tree_scan_on_gloo_ranks(world):
    run_ranks(world, _on_ranks)


def _hybrid_step(rank: int, world: int) -> None:
    import hybrid_models as H

    from cpattn.mixers import primitives

    calls, real = [], primitives.tree_scan
    primitives.tree_scan = lambda *args: calls.append(1) or real(*args)  # (it runs: counted)
    try:
        _hybrid_cases(H, world)
    finally:
        primitives.tree_scan = real
    assert calls, "the tree scan did not run"


def _hybrid_cases(H, world: int) -> None:
    lengths = [30, 5, 4, 9]
    for kind in ("qwen3_5", "bamba"):  # gated delta rule ("matrix"), Mamba-2 ("scalar")
        cfg = H.config(kind)
        for cp, batch, docs in ((cpattn.ContextParallel(layout="zigzag"), H.sequences(), None),
                                (cpattn.ContextParallel(strategy="ring"), H.packed(lengths),
                                 lengths)):
            what = f"{kind} {cp.layout} W={world} tree scan"
            ref = H.reference(cfg, batch, docs)
            H.assert_step_matches(ref, H.cp_step(cfg, batch, cp), what)
            with H.mixers_alone():
                H.assert_differs(ref, H.cp_step(cfg, batch, cp), what)


def test_hybrid_models_with_the_tree_scan(monkeypatch):
    """One training step of Qwen3.5 (gated delta rule) and Bamba (Mamba-2) at W = 4, sequences
    (zigzag) and packed documents (a plan), with $CPATTN_MIXER_SCAN=tree: loss and every gradient
    as one process's (hybrid_models.assert_step_matches); the mixers alone are not."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPATTN_MIXER_SCAN", "tree")
    run_ranks(4, _hybrid_step)


def _compiled_step(rank: int, world: int) -> None:
    import hybrid_models as H
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    cfg, batch = H.config("qwen3_5"), H.sequences()
    got = H.cp_step(cfg, batch, cpattn.ContextParallel(), compile_backend="aot_eager")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    H.assert_step_matches(H.reference(cfg, batch), got, "compiled qwen3_5, tree scan")


def test_tree_scan_compiles_fullgraph(monkeypatch):
    """torch.compile(fullgraph=True) (aot_eager: what inductor would get) of a Qwen3.5 step with
    the tree scan forced at W = 2: no graph break, exact."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("CPATTN_MIXER_SCAN", "tree")
    run_ranks(2, _compiled_step)
