"""cpattn.mixers.handoff.Handoff (a prefill chunk that starts from a cached state and hands off
its own) in one process, W ranks emulated on threads, against float64 token-by-token references
of the whole sequence (the tokens before the chunk, then the chunk):

- the convolution of the chunk's tokens with the history (the k - 1 conv inputs before it,
  shorter than k - 1 when the sequence started less than k - 1 tokens before), and the tail
  (the last k conv inputs: the history's when the chunk is shorter than k);
- the four recurrences the adapters run (scalar decay, the delta rule, Kimi's per-key decay,
  Mamba's diagonal one) from the initial state: every output and the final state, on every rank
  after the broadcast from the rank that holds the last piece.

Chunks in the zigzag and contiguous layouts at W = 1, 2, 3, pieces of one token (shorter than
the halo and the scan block). Ablation: without the history and the initial state the outputs,
the tail and the final state differ from the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cpattn.core.layout import shard_positions
from cpattn.mixers import build_piece_map
from cpattn.mixers.handoff import Handoff
from cpattn.mixers.kernels import (
    delta_rule_summary,
    kda,
    kda_summary,
    read_entry,
    scalar_decay,
    selective_scan,
)
from cpattn.testing.mixers import emulate

from mixer_reference import (
    delta_rule_loop,
    scalar_decay_loop,
    selective_scan_loop,
    take,
    unit_keys,
)

F64 = torch.float64
B, H, DK, DV, C, K = 2, 2, 3, 4, 5, 4  # rows, heads, key / value dims, conv channels, conv width

# (before: tokens before the chunk, chunk length, world, layout)
CASES = [
    (0, 12, 2, "zigzag"),  # the sequence starts with the chunk: no history, no initial state
    (2, 4, 2, "zigzag"),  # pieces of 1 token; a history shorter than k - 1
    (9, 12, 3, "zigzag"),
    (9, 30, 3, "contiguous"),
    (7, 2, 1, "contiguous"),  # a chunk shorter than the conv width: the tail reaches back
    (5, 6, 2, "contiguous"),
]


def _problem(gen, total: int) -> dict:
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=F64) * scale

    return dict(
        x=rand(B, total, C), weight=rand(C, K), bias=rand(C),
        q=rand(B, total, H, DK), k=unit_keys(rand(B, total, H, DK)), v=rand(B, total, H, DV),
        a=-torch.rand(B, total, H, generator=gen, dtype=F64) * 0.3,
        g=-torch.rand(B, total, H, DK, generator=gen, dtype=F64) * 0.3,
        beta=torch.rand(B, total, H, generator=gen, dtype=F64),
        dt=torch.rand(B, total, H * 2, generator=gen, dtype=F64) * 0.5,
        A=-torch.rand(H * 2, DK, generator=gen, dtype=F64) - 0.1, c=rand(B, total, DK),
        xd=rand(B, total, H * 2, DK))


def _references(p: dict, before: int) -> dict:
    """Float64 token loops over the whole sequence: per recurrence (outputs of the chunk,
    state before the chunk, final state); the conv's outputs of the chunk, its history and
    tail."""
    out = {}
    seq = F.pad(p["x"].transpose(1, 2), (K - 1, 0))
    conv = F.conv1d(seq, p["weight"][:, None, :], p["bias"], groups=C).transpose(1, 2)
    padded = F.pad(p["x"], (0, 0, K, 0))  # (zeros before the start)
    out["conv"] = conv[:, before:]
    out["history"] = padded[:, K + before - (K - 1):K + before] if before else None
    out["tail"] = padded[:, -K:]
    for kind in ("scalar", "matrix", "kda", "diagonal"):
        ys, starts, finals = [], [], []
        for row in range(B):
            t = {n: v[row] for n, v in p.items() if n not in ("weight", "bias", "A")}

            def run(lo, hi, initial):
                s = {n: v[lo:hi] for n, v in t.items()}
                if kind == "scalar":
                    return scalar_decay_loop(s["q"], s["k"], s["v"], s["a"], initial)
                if kind == "matrix":
                    return delta_rule_loop(s["q"], s["k"], s["v"], s["a"], s["beta"], initial)
                if kind == "kda":
                    y, state = kda(s["q"][None], s["k"][None], s["v"][None], s["g"][None],
                                   s["beta"][None], None if initial is None else initial[None])
                    return y[0], state[0]
                return selective_scan_loop(s["dt"], p["A"], s["xd"] * s["dt"][..., None],
                                           s["c"], initial)

            _, start = run(0, before, None) if before else (None, None)
            y, final = run(before, t["q"].shape[0], start)
            ys.append(y)
            starts.append(start)
            finals.append(final)
        out[kind] = (torch.stack(ys), torch.stack(starts) if before else None,
                     torch.stack(finals))
    return out


def _recurrence(kind: str, local: dict, mix: Handoff, p: dict) -> torch.Tensor:
    """An adapter's recurrence on the rank's local tokens: rows, local kernel, entry, output."""
    rows = {n: mix.rows(v) for n, v in local.items()}
    mask = mix.mask(None)
    if kind == "diagonal":
        bx = rows["dt"][..., None] * rows["xd"]
        y0, s, m = selective_scan(rows["dt"], p["A"], bx, rows["c"], mask)
        entry = mix.entry(m, s, "diagonal")
        cum = torch.cumsum(rows["dt"] * mask[..., None], 1)
        y = y0 + ((rows["c"][:, :, None, :] * torch.exp(cum[..., None] * p["A"])) *
                  entry[:, None]).sum(-1)
        return mix.local(y)
    if kind == "scalar":
        y0, pm, m, s = scalar_decay(rows["q"], rows["k"], rows["v"], rows["a"], mask, 4)
        entry = mix.entry(m, s, "scalar")
    elif kind == "matrix":
        y0, pm, m, s = delta_rule_summary(rows["q"], rows["k"], rows["v"], rows["a"],
                                          rows["beta"], mask, 4)
        entry = mix.entry(m, s, "matrix")
    else:
        y0, pm, m, s = kda_summary(rows["q"], rows["k"], rows["v"], rows["g"], rows["beta"], mask)
        entry = mix.entry(m, s, "matrix")
    return mix.local(y0 + read_entry(pm, entry))


def _run(p: dict, before: int, chunk: int, world: int, layout: str, refs: dict, cached: bool):
    """Every rank's (conv out, tail, {kind: (out, final state on every rank)}) of the chunk."""
    indices = [shard_positions(chunk, layout, world, r) for r in range(world)]
    piece_map = build_piece_map(indices, (0, chunk))
    conv1d = torch.nn.Conv1d(C, C, K, groups=C, dtype=F64)
    with torch.no_grad():
        conv1d.weight.copy_(p["weight"][:, None, :])
        conv1d.bias.copy_(p["bias"])
    chunk_p = {n: v[:, before:] for n, v in p.items() if n not in ("weight", "bias", "A")}

    def rank_fn(rank, exchange):
        local = {n: take(v, indices[rank]) for n, v in chunk_p.items()}

        def broadcast(t, src):
            return exchange(t)[src]

        def handoff(kind):
            initial = refs[kind][1] if cached and kind != "conv" else None
            history = refs["history"] if cached and kind == "conv" else None
            return Handoff(piece_map, rank, exchange, B, history, initial)

        mix = handoff("conv")
        conv = mix.conv(local["x"], conv1d)
        out = {"conv": (conv, mix.found["tail"])}
        for kind in ("scalar", "matrix", "kda", "diagonal"):
            mix = handoff(kind)
            y = _recurrence(kind, {n: local[n] for n in local if n != "x"}, mix, p)
            out[kind] = (y, mix.handed_off(broadcast))
        return out

    return indices, emulate(world, rank_fn)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"before{c[0]}-chunk{c[1]}-W{c[2]}-{c[3]}")
def test_handoff_continues_and_hands_off_exactly(gen, case):
    before, chunk, world, layout = case
    p = _problem(gen, before + chunk)
    refs = _references(p, before)
    indices, outs = _run(p, before, chunk, world, layout, refs, cached=True)
    tol = dict(atol=1e-9, rtol=1e-9)
    for rank, out in enumerate(outs):
        conv, tail = out["conv"]
        torch.testing.assert_close(conv, take(refs["conv"], indices[rank]), **tol,
                                   msg=lambda m: f"conv rank {rank}: {m}")
        torch.testing.assert_close(tail, refs["tail"], **tol, msg=f"tail rank {rank}")
        for kind in ("scalar", "matrix", "kda", "diagonal"):
            y, final = out[kind]
            torch.testing.assert_close(y, take(refs[kind][0], indices[rank]), **tol,
                                       msg=lambda m: f"{kind} rank {rank}: {m}")
            torch.testing.assert_close(final, refs[kind][2], **tol,
                                       msg=lambda m: f"{kind} final state rank {rank}: {m}")
    if before:  # Ablation: the chunk from zero state and history is not the sequence's.
        _, alone = _run(p, before, chunk, world, layout, refs, cached=False)
        assert not torch.allclose(alone[0]["conv"][0], take(refs["conv"], indices[0]))
        for kind in ("scalar", "matrix", "kda", "diagonal"):
            assert not torch.allclose(alone[0][kind][1], refs[kind][2]), kind
            assert not torch.allclose(alone[0][kind][0], take(refs[kind][0], indices[0])), kind
