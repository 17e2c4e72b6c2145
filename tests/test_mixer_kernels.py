"""The mixers' recurrences (cpattn.mixers.kernels through cpattn.mixers.mixing.Mixing) against
float64 token-by-token loops, forward and gradients, on fresh random inputs: packed rows of many
documents (lengths 1, shorter than the convolution halo, than a block, a block exactly, several
blocks), one process and emulated ranks; the summaries and the state scan's entry states; fp32
with strong decays (segment sums: the ablation, differences of running sums, is off); fp32
state math under bf16 autocast and with bf16 inputs; recompute in backward (fewer saved bytes,
the same gradients). The sharded layouts: tests/test_mixers.py."""

from __future__ import annotations

import pytest
import torch

from cpattn.mixers import build_piece_map, kernels, stacked
from cpattn.mixers import mixing as M
from cpattn.mixers.mixing import Mixing
from cpattn.testing.mixers import emulate

from mixer_reference import (
    KINDS,
    delta_rule_loop,
    kda_loop,
    problem,
    reference,
    run_kind,
    scalar_decay_loop,
    selective_scan_loop,
    sharded_problem,
    take,
    unit_keys,
)

LENGTHS = (1, 2, 3, 9, 4, 1, 17, 8, 2, 30, 5)  # with block 4 / 8: shorter, equal, several


def _one_process(lengths, batch=1):
    total = sum(lengths)
    bounds = tuple(torch.tensor((0, *lengths)).cumsum(0).tolist())
    return build_piece_map([torch.arange(total)], bounds), bounds


def _grads(p: dict, y: torch.Tensor, dout: torch.Tensor) -> dict:
    names = [n for n, t in p.items() if t.requires_grad]
    grads = torch.autograd.grad((y * dout).sum(), [p[n] for n in names], allow_unused=True)
    return {n: g for n, g in zip(names, grads) if g is not None}


def _leaves(p: dict) -> dict:
    return {n: t.detach().clone().requires_grad_(True) for n, t in p.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block", [4, 8])
def test_packed_row_matches_the_token_loops(gen, kind, block):
    """One process, one row of packed documents (every one whole: one flat row with resets):
    outputs and every input's gradient equal the float64 loops per document."""
    piece_map, bounds = _one_process(LENGTHS)
    p = problem(gen, 1, bounds[-1])
    ref_in, got_in = _leaves(p), _leaves(p)
    ref = reference(kind, ref_in, bounds)
    got = run_kind(kind, Mixing(piece_map, 0, stacked, 1, block=block), got_in)
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    dout = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
    ref_g, got_g = _grads(ref_in, ref, dout), _grads(got_in, got, dout)
    for name in ref_g:
        torch.testing.assert_close(got_g[name], ref_g[name], atol=1e-9, rtol=1e-9,
                                   msg=lambda m: f"{kind} d{name}: {m}")
    # Ablation: the resets are what keeps documents apart.
    joined = reference(kind, ref_in, (0, bounds[-1]))
    assert not torch.allclose(joined, ref, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_linked_pieces_over_emulated_ranks(gen, kind):
    """A document plan over 3 emulated ranks, blocks of 4: whole documents in the flat row,
    linked pieces block-aligned with their entry states from the scan; outputs and gradients
    against the float64 loops."""
    lengths = (2, 31, 1, 4, 5, 3, 6, 13, 1)
    piece_map, indices, bounds = sharded_problem("plan", 3, lengths, "zigzag")
    assert any(piece_map.linked(r) for r in range(3)), "the plan splits no document"
    p = problem(gen, 1, bounds[-1])
    ref_in, got_in = _leaves(p), _leaves(p)
    ref = reference(kind, ref_in, bounds)
    dout = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)

    def rank_fn(rank, exchange):
        local = {n: t if n == "A" else take(t, indices[rank]) for n, t in got_in.items()}
        return run_kind(kind, Mixing(piece_map, rank, exchange, 1, block=4), local)

    outs = emulate(3, rank_fn)
    for rank, out in enumerate(outs):
        torch.testing.assert_close(out, take(ref, indices[rank]), atol=1e-10, rtol=1e-10)
    loss = sum((out * take(dout, indices[r])).sum() for r, out in enumerate(outs))
    got_g = dict(zip(got_in, torch.autograd.grad(loss, list(got_in.values()),
                                                 allow_unused=True)))
    ref_g = _grads(ref_in, ref, dout)
    for name, g in ref_g.items():
        torch.testing.assert_close(got_g[name], g, atol=1e-9, rtol=1e-9,
                                   msg=lambda m: f"{kind} d{name}: {m}")


def test_flat_rows_follow_the_token_count():
    """50 short whole documents and one long split one: the rows hold the rank's tokens plus
    less than a block per linked piece (the old piece rows padded every piece to the longest:
    51 x 1000), each local token exactly once."""
    lengths = (1000,) + (10,) * 50 + (1000,)
    cu = torch.tensor((0, *lengths)).cumsum(0)
    # rank 0: the first 500 tokens of document 0 ... no: the second half of document 0, the 50
    # short ones, the first half of the last; rank 1 the rest
    first = torch.arange(500, int(cu[-2]) + 500)
    rest = torch.cat([torch.arange(0, 500), torch.arange(int(cu[-2]) + 500, int(cu[-1]))])
    piece_map = build_piece_map([first, rest], tuple(cu.tolist()))
    rows = piece_map.flat_rows(0, 64)
    assert len(rows.whole) == 500 and len(rows.resets) == 49
    assert len(piece_map.linked(0)) == 2
    assert len(rows.linked) == 2 * 512 and rows.starts == (0, 8) and rows.ends == (7, 15)
    assert sorted(rows.back) == list(range(len(rows.whole))) + sorted(
        len(rows.whole) + i for i, t in enumerate(rows.linked) if t < len(first))
    assert piece_map.slots == 1  # one summary per rank, whatever the number of documents
    assert piece_map.linked_block(0, 64) == 64  # (pieces of 500: blocks of 64)
    # Documents each split over every rank (per-document sharding): short linked pieces get
    # short blocks, so that padding does not multiply the tokens.
    piece_map, _, _ = sharded_problem("per-document", 2, (12,) * 20, "zigzag")
    assert piece_map.linked_block(0, 64) == 4  # (pieces of 3 tokens)
    assert len(piece_map.flat_rows(0, 4).linked) <= 2 * piece_map.local_len[0]


@pytest.mark.parametrize("kind", KINDS)
def test_summaries_are_the_pieces_transitions(gen, kind):
    """kernels.summaries over a linked row of two pieces (7 tokens in blocks 0-1, padded by an
    identity token, 4 in block 2): for a random entry E, each piece's float64 token loop from E
    ends at M E + S."""
    p = problem(gen, 1, 11)
    index = torch.cat([torch.arange(7), torch.tensor([-1]), torch.arange(7, 11)])
    t = {n: v if n == "A" else take(v, index) for n, v in p.items()}
    family = {"scalar": M.SCALAR, "matrix": M.DELTA, "kda": M.KDA, "diagonal": M.SELECTIVE}[kind]
    if kind == "diagonal":
        inputs, params = (t["dt"], t["x"], t["b"], t["c"]), (p["A"],)
    else:
        keys = t["k"] if kind == "scalar" else unit_keys(t["k"])
        decay = t["g"] if kind == "kda" else t["a"]
        beta = () if kind == "scalar" else (t["beta"],)
        inputs, params = (t["q"], keys, t["v"], decay, *beta), ()
    blocks = family.prepare(*inputs, *params, None, 4)
    state, transition = family.shapes(1, *inputs, *params)
    zero = torch.zeros(state, dtype=torch.float64)
    identity = M._identity(family, transition, torch.float64, "cpu")
    m, s = kernels.summaries(blocks, zero, identity, (0, 2), (1, 2))
    loops = {"scalar": lambda d, e: scalar_decay_loop(d["q"], d["k"], d["v"], d["a"], e),
             "matrix": lambda d, e: delta_rule_loop(d["q"], unit_keys(d["k"]), d["v"], d["a"],
                                                    d["beta"], e),
             "kda": lambda d, e: kda_loop(d["q"], unit_keys(d["k"]), d["v"], d["g"], d["beta"],
                                          e),
             "diagonal": lambda d, e: selective_scan_loop(d["dt"], p["A"], d["x"], d["b"],
                                                          d["c"], e)}
    for piece, (lo, n) in enumerate(((0, 7), (7, 4))):
        entry = torch.randn(state[1:], generator=gen, dtype=torch.float64)
        _, end = loops[kind]({name: v[0, lo:lo + n] for name, v in p.items() if name != "A"},
                             entry)
        mp, sp = m[0, piece], s[0, piece]
        got = (mp @ entry if kind in ("matrix", "kda") else mp * entry) + sp
        torch.testing.assert_close(got, end, atol=1e-10, rtol=1e-10)


def _float32(p: dict) -> dict:
    return {n: t.float() for n, t in p.items()}


@pytest.mark.parametrize("kind", ["scalar", "matrix"])
def test_strong_decays_in_fp32_use_segment_sums(gen, kind, monkeypatch):
    """Log decays of -1 to -3 per token (the running sum over a block of 64 reaches -190), a
    document of 320 tokens: fp32 within 2e-6 of the float64 truth (relative, in norm).
    Ablation: the decays as differences of running sums over the block (exp(g_i - g_j), g
    the running sum) lose digits: off by more than 4x that."""
    piece_map, bounds = _one_process((320,))
    p = problem(gen, 1, bounds[-1])
    p["a"] = -1.0 - 2.0 * torch.rand(p["a"].shape, generator=gen, dtype=torch.float64)
    truth = reference(kind, p, bounds)

    def error():
        y = run_kind(kind, Mixing(piece_map, 0, stacked, 1), _float32(p))
        return float((y.double() - truth).norm() / truth.norm())

    err = error()
    assert err < 2e-6, err

    def differences(a, dim=-1):
        g = a.cumsum(-1)
        diff = g[..., :, None] - g[..., None, :]
        upper = torch.ones(diff.shape[-1], diff.shape[-1], dtype=torch.bool).triu(1)
        return diff.masked_fill(upper, float("-inf"))

    monkeypatch.setattr(kernels, "segsum", differences)
    err_ablation = error()
    assert err_ablation > 4 * err, (err, err_ablation)


def test_kda_strong_decays_per_channel(gen, monkeypatch):
    """Kimi delta attention with per-channel log decays down to -30 per token (sums over a block
    reach -900): fp32 finite and within 2e-6 of the float64 truth (relative, in norm).
    Ablation: the decays between two tokens of a block factored as exp(G_i) exp(-G_j) (G the
    running sum from the block's start) overflow."""
    piece_map, bounds = _one_process((200, 56))
    p = problem(gen, 1, bounds[-1])
    p["g"] = -30.0 * torch.rand(p["g"].shape, generator=gen, dtype=torch.float64) ** 2
    truth = reference("kda", p, bounds)

    def error():
        y = run_kind("kda", Mixing(piece_map, 0, stacked, 1), _float32(p))
        return float((y.double() - truth).norm() / truth.norm())

    err = error()
    assert err < 2e-6, err

    def factored(x, y, g, sub):
        cum = g.cumsum(-2)
        out = (x * cum.exp()) @ (y * (-cum).exp()).transpose(-1, -2)
        return out.tril()

    monkeypatch.setattr(kernels, "_decayed_dots", factored)
    err_ablation = error()
    assert not err_ablation < 1e-3, err_ablation  # (NaN: inf * 0)


@pytest.mark.parametrize("kind", KINDS)
def test_state_math_is_fp32_under_autocast_and_bf16(gen, kind):
    """Under torch.autocast("cpu", bfloat16) the recurrences give exactly their fp32 result
    (autocast is off inside; the summaries and entry states stay fp32 over emulated ranks);
    bf16 inputs give the fp32 result of the same (rounded) inputs, in fp32."""
    lengths = (2, 31, 1, 4, 5, 3, 6, 13, 1)
    piece_map, indices, bounds = sharded_problem("plan", 2, lengths, "zigzag")
    p = problem(gen, 1, bounds[-1])
    p["k"] = unit_keys(p["k"])  # (normalised once, before any rounding)
    p = _float32(p)

    def run(inputs, autocast):
        def rank_fn(rank, exchange):
            t = {n: v if n == "A" else take(v, indices[rank]) for n, v in inputs.items()}
            mix = Mixing(piece_map, rank, exchange, 1, block=8)
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                if kind == "scalar":
                    return mix.scalar_decay(t["q"], t["k"], t["v"], t["a"])
                if kind == "diagonal":
                    return mix.selective_scan(t["dt"], t["A"], t["x"], t["b"], t["c"])
                method = mix.delta_rule if kind == "matrix" else mix.kda
                return method(t["q"], t["k"], t["v"], t["a" if kind == "matrix" else "g"],
                              t["beta"])
        return emulate(2, rank_fn)

    plain, under = run(p, False), run(p, True)
    for a, b in zip(plain, under):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    rounded = {n: t.bfloat16() for n, t in p.items()}
    for a, b in zip(run({n: t.float() for n, t in rounded.items()}, False),
                    run(rounded, False)):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    # Ablation: the same kernels in bf16 are far off the fp32 result.
    with torch.autocast("cpu", torch.bfloat16):
        blocks = kernels.scalar_blocks(*(take(p[n], indices[0]) for n in "qkva"), 8)
    assert blocks.intra.dtype == torch.bfloat16


def test_recompute_saves_less_and_gives_the_same_gradients(gen):
    """Mixing(recompute=True) keeps fewer bytes for backward than without (the blocks'
    intermediates are recomputed) and gives the same gradients."""
    lengths = (40, 3, 90, 7, 60)
    piece_map, indices, bounds = sharded_problem("plan", 2, lengths, "zigzag")
    p = problem(gen, 1, bounds[-1], dtype=torch.float32, heads=4, dk=16, dv=16)

    def run(recompute):
        saved = [0]

        def pack(t):
            saved[0] += t.numel() * t.element_size()
            return t

        leaves = _leaves(p)

        def rank_fn(rank, exchange):
            local = {n: t if n == "A" else take(t, indices[rank]) for n, t in leaves.items()}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return run_kind("matrix", Mixing(piece_map, rank, exchange, 1, recompute,
                                                 block=8), local)

        outs = emulate(2, rank_fn)
        loss = sum(o.square().sum() for o in outs)
        grads = torch.autograd.grad(loss, [leaves[n] for n in "qkv"])
        return saved[0], grads

    kept, grads = run(True)
    kept_all, grads_all = run(False)
    assert kept < 0.7 * kept_all, (kept, kept_all)  # (measured: 0.61)
    for a, b in zip(grads, grads_all):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
