"""cpattn.mixers.handoff.Handoff (a prefill chunk that starts from a cached state and hands off
its own) in one process, W ranks emulated on threads, against float64 token-by-token references
of the whole sequence (the tokens before the chunk, then the chunk):

- the convolution of the chunk's tokens with the history (the k - 1 conv inputs before it,
  shorter than k - 1 when the sequence started less than k - 1 tokens before), and the tail
  (the last k conv inputs: the history's when the chunk is shorter than k);
- the four recurrences the adapters run through Mixing (scalar decay, the delta rule, Kimi's
  per-key decay, Mamba's diagonal one) from the initial state: every output and the final
  state, on every rank after the broadcast from the rank that holds the last piece.

Chunks in the zigzag and contiguous layouts at W = 1, 2, 3: pieces of one token (shorter than
the halo and the scan block), pieces over several scan blocks, a whole row over two
checkpointed segments (W = 1, blocks of 4); both state scans (the all-gather's fold, the
tree). Ablation: without the history and the initial state
the outputs, the tail and the final state differ from the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpattn.core.layout import shard_positions
from cpattn.mixers import build_piece_map
from cpattn.mixers.handoff import Handoff
from cpattn.mixers.tree_scan import with_scan
from cpattn.testing.mixers import emulate

from mixer_reference import (
    KINDS,
    delta_rule_loop,
    kda_loop,
    problem,
    run_kind,
    scalar_decay_loop,
    selective_scan_loop,
    take,
    unit_keys,
)

F64 = torch.float64
B, C, K = 2, 5, 4  # rows, conv channels, conv width (the recurrences: mixer_reference.problem's)

# (before: tokens before the chunk, chunk length, world, layout, scan block (None: Mixing's))
CASES = [
    (0, 12, 2, "zigzag", None),  # the sequence starts with the chunk: no history, no state
    (2, 4, 2, "zigzag", None),  # pieces of 1 token; a history shorter than k - 1
    (9, 12, 3, "zigzag", None),
    (9, 30, 3, "contiguous", None),
    (7, 2, 1, "contiguous", None),  # a chunk shorter than the conv width: the tail reaches back
    (5, 6, 2, "contiguous", None),
    (6, 40, 2, "zigzag", 4),  # pieces of 10 tokens over 3 blocks each
    (3, 70, 1, "contiguous", 4),  # one whole row: 18 blocks, two checkpointed segments
]


def _problem(gen, total: int) -> dict:
    p = problem(gen, B, total, decay=0.1)  # (slow enough that the initial state shows at the end)
    p.update(x_conv=torch.randn(B, total, C, generator=gen, dtype=F64),
             weight=torch.randn(C, K, generator=gen, dtype=F64),
             bias=torch.randn(C, generator=gen, dtype=F64))
    return p


def _loop(kind: str, t: dict, A: torch.Tensor, initial):
    """The float64 token loop of `kind` on one row's tokens t (L, ...) from `initial`:
    (y, final state)."""
    if kind == "scalar":
        return scalar_decay_loop(t["q"], t["k"], t["v"], t["a"], initial)
    if kind == "matrix":
        return delta_rule_loop(t["q"], unit_keys(t["k"]), t["v"], t["a"], t["beta"], initial)
    if kind == "kda":
        return kda_loop(t["q"], unit_keys(t["k"]), t["v"], t["g"], t["beta"], initial)
    return selective_scan_loop(t["dt"], A, t["x"], t["b"], t["c"], initial)


def _references(p: dict, before: int) -> dict:
    """Float64 references over the whole sequence: per recurrence (outputs of the chunk, state
    before the chunk (None: no tokens before), final state); the conv's outputs of the chunk,
    its history (None) and tail."""
    out = {}
    x = p["x_conv"]
    seq = F.pad(x.transpose(1, 2), (K - 1, 0))
    conv = F.conv1d(seq, p["weight"][:, None, :], p["bias"], groups=C).transpose(1, 2)
    padded = F.pad(x, (0, 0, K, 0))  # (zeros before the start)
    out["conv"] = conv[:, before:]
    out["history"] = padded[:, K + before - (K - 1):K + before] if before else None
    out["tail"] = padded[:, -K:]
    for kind in KINDS:
        ys, starts, finals = [], [], []
        for row in range(B):
            t = {n: v[row] for n, v in p.items() if n not in ("weight", "bias", "A", "x_conv")}
            start = None
            if before:
                _, start = _loop(kind, {n: v[:before] for n, v in t.items()}, p["A"], None)
            y, final = _loop(kind, {n: v[before:] for n, v in t.items()}, p["A"], start)
            ys.append(y)
            starts.append(start)
            finals.append(final)
        out[kind] = (torch.stack(ys), torch.stack(starts) if before else None,
                     torch.stack(finals))
    return out


def _run(p: dict, case: tuple, refs: dict, cached: bool, scan: str):
    """Every rank's {"conv": (out, tail), kind: (out, final state on every rank)} of the
    chunk."""
    before, chunk, world, layout, block = case
    indices = [shard_positions(chunk, layout, world, r) for r in range(world)]
    piece_map = build_piece_map(indices, (0, chunk))
    conv1d = torch.nn.Conv1d(C, C, K, groups=C, dtype=F64)
    with torch.no_grad():
        conv1d.weight.copy_(p["weight"][:, None, :])
        conv1d.bias.copy_(p["bias"])
    chunk_p = {n: v[:, before:] for n, v in p.items() if n not in ("weight", "bias", "A")}

    def rank_fn(rank, exchange):
        exchange = with_scan(exchange, scan)
        local = {n: take(v, indices[rank]) for n, v in chunk_p.items()}
        local["A"] = p["A"]

        def broadcast(t, src):
            return exchange(t)[src]

        def handoff(history=None, initial=None):
            return Handoff(piece_map, rank, exchange, B, block=block,
                           history=history if cached else None,
                           initial=initial if cached else None)

        mix = handoff(history=refs["history"])
        with torch.no_grad():
            conv = mix.conv(local["x_conv"], conv1d)
        out = {"conv": (conv, mix.found["tail"])}
        for kind in KINDS:
            mix = handoff(initial=refs[kind][1])
            y = run_kind(kind, mix, local)
            out[kind] = (y, mix.handed_off(broadcast))
        return out

    return indices, emulate(world, rank_fn)


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"before{c[0]}-chunk{c[1]}-W{c[2]}-{c[3]}"
                         + (f"-block{c[4]}" if c[4] else ""))
@pytest.mark.parametrize("scan", ["allgather", "tree"])
def test_handoff_continues_and_hands_off_exactly(gen, case, scan):
    before = case[0]
    p = _problem(gen, before + case[1])
    refs = _references(p, before)
    indices, outs = _run(p, case, refs, cached=True, scan=scan)
    tol = dict(atol=1e-9, rtol=1e-9)
    for rank, out in enumerate(outs):
        conv, tail = out["conv"]
        torch.testing.assert_close(conv, take(refs["conv"], indices[rank]), **tol,
                                   msg=lambda m: f"conv rank {rank}: {m}")
        torch.testing.assert_close(tail, refs["tail"], **tol, msg=f"tail rank {rank}")
        for kind in KINDS:
            y, final = out[kind]
            torch.testing.assert_close(y, take(refs[kind][0], indices[rank]), **tol,
                                       msg=lambda m: f"{kind} rank {rank}: {m}")
            torch.testing.assert_close(final, refs[kind][2], **tol,
                                       msg=lambda m: f"{kind} final state rank {rank}: {m}")
    if before:  # Ablation: the chunk from zero state and history fails the same checks.
        _, alone = _run(p, case, refs, cached=False, scan=scan)
        assert not torch.allclose(alone[0]["conv"][0], take(refs["conv"], indices[0]), **tol)
        if case[1] < K:  # (the tail reaches back into the history)
            assert not torch.allclose(alone[0]["conv"][1], refs["tail"], **tol)
        for kind in KINDS:
            assert not torch.allclose(alone[0][kind][1], refs[kind][2], **tol), kind
            assert not torch.allclose(alone[0][kind][0], take(refs[kind][0], indices[0]),
                                      **tol), kind


def test_handoff_refuses_packed_documents():
    piece_map = build_piece_map([torch.arange(6)], (0, 2, 6))
    with pytest.raises(ValueError, match="Handoff: piece_map holds 2 documents"):
        Handoff(piece_map, 0, lambda t: t[None], 1)
