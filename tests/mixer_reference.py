"""Float64 token-by-token references for the token mixers, and the sharding of test problems
(shared by tests/test_mixers*.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.core.layout import document_positions, shard_positions
from cpattn.mixers import build_piece_map, state_scan
from cpattn.mixers.kernels import delta_rule_summary, read_entry, scalar_decay, selective_scan
from cpattn.mixers.primitives import from_pieces, piece_mask, to_pieces
from cpattn.sharding.documents import shard_documents


def scalar_decay_loop(q, k, v, a, initial=None):
    """S_t = exp(a_t) S_{t-1} + k_t v_t^T, y_t = S_t^T q_t. q, k (L, H, K), v (L, H, V),
    a (L, H); initial (H, K, V). Returns y (L, H, V), S."""
    s = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=q.dtype) if initial is None \
        else initial.clone()
    ys = []
    for t in range(q.shape[0]):
        s = a[t].exp()[:, None, None] * s + k[t][:, :, None] * v[t][:, None, :]
        ys.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(ys), s


def delta_rule_loop(q, k, v, a, beta, initial=None):
    """S_t = exp(a_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T, y_t = S_t^T q_t (shapes of
    scalar_decay_loop; beta (L, H))."""
    s = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=q.dtype) if initial is None \
        else initial.clone()
    ys = []
    for t in range(q.shape[0]):
        s = a[t].exp()[:, None, None] * s
        kv = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - kv)[:, None, :]
        ys.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(ys), s


def selective_scan_loop(dt, a, bx, c, initial=None):
    """h_t = exp(dt_t A) h_{t-1} + bx_t, y_t = h_t c_t: dt (L, D), a (D, K), bx (L, D, K),
    c (L, K). Returns y (L, D), h."""
    h = torch.zeros(bx.shape[1:], dtype=bx.dtype) if initial is None else initial.clone()
    ys = []
    for t in range(dt.shape[0]):
        h = torch.exp(dt[t][:, None] * a) * h + bx[t]
        ys.append(h @ c[t])
    return torch.stack(ys), h


def conv_reference(x, weight, bias, bounds):
    """The causal depthwise convolution of x (B, T, C) within each document [bounds[d],
    bounds[d+1]) from zero history: (B, T, C)."""
    width = weight.shape[-1] - 1
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        seq = F.pad(x[:, lo:hi].transpose(1, 2), (width, 0))
        out.append(F.conv1d(seq, weight[:, None, :], bias, groups=x.shape[-1]).transpose(1, 2))
    return torch.cat(out, 1)


def sharding(kind: str, world: int, lengths: tuple, layout: str = "zigzag"):
    """Every rank's global indices and the documents' boundaries, for kind "sequence" (one
    document of sum(lengths) tokens, cpattn.positions' layout), "per-document" (each document
    sharded over every rank, cpattn.shard_varlen's) or "plan" (cpattn.shard_documents, split
    "balanced")."""
    total = sum(lengths)
    if kind == "sequence":
        return [shard_positions(total, layout, world, r) for r in range(world)], (0, total)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    if kind == "per-document":
        docs = torch.tensor(lengths)
        return [document_positions(docs, layout, world, r)[0] for r in range(world)], tuple(cu)
    piece_map = shard_documents(torch.tensor(cu), world_size=world, layout=layout, split="balanced")
    return [piece_map.positions(r)[0] for r in range(world)], tuple(cu)


def sharded_problem(kind: str, world: int, lengths: tuple, layout: str = "zigzag"):
    """(piece map, per-rank indices, bounds)."""
    indices, bounds = sharding(kind, world, lengths, layout)
    return build_piece_map(indices, bounds), indices, bounds


def take(x: torch.Tensor, index: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """x's tokens at `index` along dim, zeros where index is -1 (a rank's shard)."""
    zero = x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1:]))
    slots = torch.where(index < 0, x.shape[dim], index)
    return torch.cat([x, zero], dim).index_select(dim, slots)


def unit_keys(k):
    return k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)  # (l2-normalised, as the models)


def problem(gen, batch, total, heads=2, dk=3, dv=4, dtype=torch.float64):
    """Global inputs (B, T, ...) of the three recurrences of scan_on_rank."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return dict(
        q=rand(batch, total, heads, dk), k=rand(batch, total, heads, dk) * 0.5,
        v=rand(batch, total, heads, dv),
        a=-torch.rand(batch, total, heads, generator=gen, dtype=dtype),  # log decays <= 0
        beta=torch.rand(batch, total, heads, generator=gen, dtype=dtype),
        dt=torch.rand(batch, total, heads * 2, generator=gen, dtype=dtype) * 0.5,
        A=-torch.rand(heads * 2, dk, generator=gen, dtype=dtype) - 0.1,
        x=rand(batch, total, heads * 2, dk), c=rand(batch, total, dk))


def scan_on_rank(kind, p, piece_map, index, rank, exchange, block):
    """The recurrence `kind` ("scalar", "matrix", "diagonal") on rank's tokens of the global
    problem p (index: rank's global indices; None: p holds rank's tokens already): local kernel
    per piece, state scan, entry read. Returns local outputs."""
    local = {name: t if index is None or name == "A" else take(t, index)
             for name, t in p.items()}
    rows = {name: to_pieces(t, piece_map, rank).flatten(0, 1) for name, t in local.items()
            if name != "A"}
    batch, n = p["q"].shape[0], len(piece_map.pieces[rank])
    mask = piece_mask(piece_map, rank).repeat(batch, 1)
    if kind == "diagonal":
        bx = rows["x"] * rows["dt"][..., None]
        _, s, m = selective_scan(rows["dt"], p["A"], bx, rows["c"], mask)
        entry = state_scan(m.unflatten(0, (batch, n)), s.unflatten(0, (batch, n)), piece_map, rank,
                           "diagonal", exchange)
        y, _, _ = selective_scan(rows["dt"], p["A"], bx, rows["c"], mask, entry.flatten(0, 1))
    else:
        if kind == "scalar":
            y0, pm, m, s = scalar_decay(rows["q"], rows["k"], rows["v"], rows["a"], mask, block)
        else:
            y0, pm, m, s = delta_rule_summary(rows["q"], unit_keys(rows["k"]), rows["v"],
                                              rows["a"], rows["beta"], mask, block)
        unflat = [t.unflatten(0, (batch, n)) for t in (y0, pm, m, s)]
        entry = state_scan(unflat[2], unflat[3], piece_map, rank, kind, exchange)
        y = (unflat[0] + read_entry(unflat[1], entry)).flatten(0, 1)
    return from_pieces(y.unflatten(0, (batch, n)), piece_map, rank)


def reference(kind, p, bounds):
    out = []
    for row in range(p["q"].shape[0]):
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            t = {name: v[row, lo:hi] for name, v in p.items() if name != "A"}
            if kind == "scalar":
                y, _ = scalar_decay_loop(t["q"], t["k"], t["v"], t["a"])
            elif kind == "matrix":
                y, _ = delta_rule_loop(t["q"], unit_keys(t["k"]), t["v"], t["a"], t["beta"])
            else:
                y, _ = selective_scan_loop(t["dt"], p["A"], t["x"] * t["dt"][..., None], t["c"])
            parts.append(y)
        out.append(torch.cat(parts))
    return torch.stack(out)
