"""Float64 token-by-token references for the token mixers, and the sharding of test problems
(shared by tests/test_mixers*.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.core.layout import document_positions, shard_positions
from cpattn.mixers import build_piece_map
from cpattn.mixers.mixing import Mixing
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


def kda_loop(q, k, v, g, beta, initial=None):
    """S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T, y_t = S_t^T q_t: g
    (L, H, K) a log decay per key channel (other shapes of delta_rule_loop)."""
    s = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=q.dtype) if initial is None \
        else initial.clone()
    ys = []
    for t in range(q.shape[0]):
        s = g[t].exp()[:, :, None] * s
        kv = torch.einsum("hk,hkv->hv", k[t], s)
        s = s + beta[t][:, None, None] * k[t][:, :, None] * (v[t] - kv)[:, None, :]
        ys.append(torch.einsum("hk,hkv->hv", q[t], s))
    return torch.stack(ys), s


def selective_scan_loop(dt, a, x, b, c, initial=None):
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t b_t^T, y_t = h_t c_t: dt, x (L, D), a (D, K),
    b, c (L, K). Returns y (L, D), h."""
    h = torch.zeros(a.shape, dtype=a.dtype) if initial is None else initial.clone()
    ys = []
    for t in range(dt.shape[0]):
        h = torch.exp(dt[t][:, None] * a) * h + (dt[t] * x[t])[:, None] * b[t][None, :]
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


def problem(gen, batch, total, heads=2, dk=3, dv=4, dtype=torch.float64, decay=1.0):
    """Global inputs (B, T, ...) of the recurrences of scan_on_rank; log decays in
    [-decay, 0]."""
    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    def unit(*shape):
        return torch.rand(*shape, generator=gen, dtype=dtype)

    return dict(
        q=rand(batch, total, heads, dk), k=rand(batch, total, heads, dk) * 0.5,
        v=rand(batch, total, heads, dv),
        a=-unit(batch, total, heads) * decay,  # log decays <= 0
        g=-unit(batch, total, heads, dk) * decay,  # per key channel (Kimi)
        beta=unit(batch, total, heads),
        dt=unit(batch, total, heads * 2) * 0.5 * decay,
        A=-unit(heads * 2, dk) - 0.1,
        x=rand(batch, total, heads * 2), b=rand(batch, total, dk), c=rand(batch, total, dk))


KINDS = ("scalar", "matrix", "kda", "diagonal")


def run_kind(kind: str, mix: Mixing, t: dict) -> torch.Tensor:
    """The recurrence `kind` through Mixing on rank-local inputs t (B, L, ...)."""
    if kind == "scalar":
        return mix.scalar_decay(t["q"], t["k"], t["v"], t["a"])
    if kind == "matrix":
        return mix.delta_rule(t["q"], unit_keys(t["k"]), t["v"], t["a"], t["beta"])
    if kind == "kda":
        return mix.kda(t["q"], unit_keys(t["k"]), t["v"], t["g"], t["beta"])
    return mix.selective_scan(t["dt"], t["A"], t["x"], t["b"], t["c"])


def scan_on_rank(kind, p, piece_map, index, rank, exchange, block, recompute=True):
    """The recurrence `kind` (KINDS) on rank's tokens of the global problem p (index: rank's
    global indices; None: p holds rank's tokens already), through cpattn.mixers.mixing.Mixing
    with scan blocks of `block`. Returns local outputs."""
    local = {name: t if index is None or name == "A" else take(t, index)
             for name, t in p.items()}
    mix = Mixing(piece_map, rank, exchange, p["q"].shape[0], recompute, block)
    return run_kind(kind, mix, local)


def reference_document(kind, t, A=None):
    """The float64 token loop of `kind` on one document's tokens t (L, ...): y."""
    if kind == "scalar":
        return scalar_decay_loop(t["q"], t["k"], t["v"], t["a"])[0]
    if kind == "matrix":
        return delta_rule_loop(t["q"], unit_keys(t["k"]), t["v"], t["a"], t["beta"])[0]
    if kind == "kda":
        return kda_loop(t["q"], unit_keys(t["k"]), t["v"], t["g"], t["beta"])[0]
    return selective_scan_loop(t["dt"], A, t["x"], t["b"], t["c"])[0]


def reference(kind, p, bounds):
    """Every document of every row of p from a zero state: (B, T, ...)."""
    out = []
    for row in range(p["q"].shape[0]):
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            t = {name: v[row, lo:hi] for name, v in p.items() if name != "A"}
            parts.append(reference_document(kind, t, p["A"]))
        out.append(torch.cat(parts))
    return torch.stack(out)
