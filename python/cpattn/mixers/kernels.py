"""Local recurrences over piece rows, pure torch, in float32 (or float64 for the tests).

Every function runs N independent rows (pieces) of L tokens from a zero state and returns what the
state scan and the output need: the outputs from a zero state, the *entry map* P (how the
outputs read a piece's entry state: y += P . S_entry), and the piece's summary (M, S) with
S_out = M S_in + S. Tokens past a row's end are given by `mask` (N, L) (False: not a token) and
act as identity transitions (no decay, no input), so the summary is the one at the row's end.

States are K-first: S (H, K, V), and every output reads the state after the token's own update
(y_t = S_t^T q_t), as Mamba-2, the delta rules and lightning attention do.
"""

from __future__ import annotations

import torch


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(N, L, ...) -> (N, L / block, block, ...), zero-padded at the end (to one block at least:
    a rank without tokens still runs the same steps)."""
    pad = -x.shape[1] % block if x.shape[1] else block
    if pad:
        x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], 1)
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def _tril(block: int, device, diagonal: int = 0) -> torch.Tensor:
    return torch.ones(block, block, dtype=torch.bool, device=device).tril(diagonal)


def scalar_decay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                 mask: torch.Tensor, block: int = 64):
    """S_t = exp(a_t) S_{t-1} + k_t v_t^T, y_t = S_t^T q_t, per head (Mamba-2's SSD, lightning).

    q, k (N, L, H, K), v (N, L, H, V), log_decay a (N, L, H) <= 0, mask (N, L).
    Returns y (N, L, H, V), P (N, L, H, K) = q_t exp(a_1 + ... + a_t), M (N, H) = exp(sum a),
    S (N, H, K, V)."""
    keep = mask[..., None].to(q.dtype)
    a = log_decay * keep
    k = k * keep[..., None]
    total = torch.cumsum(a, 1)  # (N, L, H)
    p = q * total.exp()[..., None]
    qc, kc, vc, ac = (_blocks(t, block) for t in (q, k, v, a))
    g = torch.cumsum(ac, 2)  # (N, C, c, H): decay from the block's start
    diff = g[:, :, :, None, :] - g[:, :, None, :, :]  # (N, C, i, j, H)
    lower = _tril(block, q.device)[None, None, :, :, None]
    weights = diff.masked_fill(~lower, float("-inf")).exp()
    scores = torch.einsum("ncihk,ncjhk->ncijh", qc, kc) * weights
    y = torch.einsum("ncijh,ncjhv->ncihv", scores, vc)
    # Each block's own contribution to the state at its end, and its decay.
    to_end = (g[:, :, -1:, :] - g).exp()
    own = torch.einsum("ncjhk,ncjhv->nchkv", kc * to_end[..., None], vc)
    decay = g[:, :, -1].exp()  # (N, C, H)
    # (unbind, not [:, c]: the backward of one select per block writes a whole zero gradient)
    starts, state = [], q.new_zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
    for d, o in zip(decay.unbind(1), own.unbind(1)):
        starts.append(state)
        state = d[:, :, None, None] * state + o
    start = torch.stack(starts, 1)  # (N, C, H, K, V)
    y = y + torch.einsum("ncihk,nchkv->ncihv", qc * g.exp()[..., None], start)
    y = y.flatten(1, 2)[:, :q.shape[1]]
    return y, p, total[:, -1].exp() if q.shape[1] else q.new_ones(q.shape[0], q.shape[2]), state


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
               beta: torch.Tensor, initial: torch.Tensor | None = None, block: int = 64):
    """The gated delta rule: S_t = exp(a_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T,
    y_t = S_t^T q_t, block by block (the WY / UT form).

    q, k (N, L, H, K) (already normalised and scaled), v (N, L, H, V), log_decay a (N, L, H),
    beta b (N, L, H); initial (N, H, K, V) or None (zero). Returns y (N, L, H, V), S_L."""
    n, length, heads, dk = k.shape
    qc, kc, vc, ac, bc = (_blocks(t, block) for t in (q, k, v, log_decay, beta))
    g = torch.cumsum(ac, 2)  # (N, C, c, H)
    # to head-major (N, H, C, c, ...)
    qc, kc, vc = (t.permute(0, 3, 1, 2, 4) for t in (qc, kc, vc))
    g, bc = g.permute(0, 3, 1, 2), bc.permute(0, 3, 1, 2)
    diff = g[..., :, None] - g[..., None, :]  # (N, H, C, i, j)
    lower = _tril(block, q.device)
    decay_ij = diff.masked_fill(~lower, float("-inf")).exp()
    kk = kc @ kc.transpose(-1, -2)
    system = (bc[..., None] * kk * decay_ij).masked_fill(~_tril(block, q.device, -1), 0.0)
    eye = torch.eye(block, dtype=q.dtype, device=q.device)
    system = system + eye
    u = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, (bc * g.exp())[..., None] * kc, upper=False,
                                      unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * decay_ij
    q_start = qc * g.exp()[..., None]
    k_end = kc * (g[..., -1:] - g).exp()[..., None]
    decay = g[..., -1].exp()  # (N, H, C)
    state = initial if initial is not None else q.new_zeros((n, heads, dk, v.shape[-1]))
    outs = []
    for u_c, w_c, q_c, a_c, d_c, k_c in zip(*(t.unbind(2) for t in (u, w, q_start, attn, decay,
                                                                    k_end))):
        new = u_c - w_c @ state
        outs.append(q_c @ state + a_c @ new)
        state = d_c[:, :, None, None] * state + k_c.transpose(-1, -2) @ new
    y = torch.stack(outs, 2).flatten(2, 3)[:, :, :length].transpose(1, 2)
    return y, state


def delta_rule_summary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       log_decay: torch.Tensor, beta: torch.Tensor, mask: torch.Tensor,
                       block: int = 64):
    """delta_rule from a zero state with its entry map and summary, in one pass: the state is
    widened by K columns that start as the identity and receive no values, so they carry the
    transition M (K x K) and their outputs are the entry map. Returns y (N, L, H, V),
    P (N, L, H, K), M (N, H, K, K), S (N, H, K, V)."""
    keep = mask[..., None].to(q.dtype)
    return _widened(lambda *a: delta_rule(*a, block), q, k, v, log_decay * keep, beta * keep)


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
        beta: torch.Tensor, initial: torch.Tensor | None = None):
    """Kimi delta attention, token by token: S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1}
    + b_t k_t v_t^T, y_t = S_t^T q_t, with a decay per key channel: log_decay g (N, L, H, K);
    other shapes as delta_rule. Returns y (N, L, H, V), S_L."""
    state = initial if initial is not None else \
        q.new_zeros((q.shape[0], q.shape[2], q.shape[3], v.shape[3]))
    ys = []
    for q_t, k_t, v_t, g_t, b_t in zip(*(t.unbind(1) for t in (q, k, v, log_decay, beta))):
        state = state * g_t[..., None].exp()
        seen = torch.einsum("nhk,nhkv->nhv", k_t, state)
        state = state + k_t[..., None] * (b_t[..., None] * (v_t - seen))[:, :, None]
        ys.append(torch.einsum("nhk,nhkv->nhv", q_t, state))
    y = torch.stack(ys, 1) if ys else v.new_zeros(v.shape)
    return y, state


def _widened(fn, q, k, v, *args):
    """fn from a zero state with its entry map and summary: the state widened by K identity
    columns that receive no values (see delta_rule_summary)."""
    dk = k.shape[-1]
    wide = torch.cat([v.new_zeros((*v.shape[:3], dk)), v], -1)
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    initial = torch.cat([eye.expand(q.shape[0], q.shape[2], dk, dk),
                         q.new_zeros((q.shape[0], q.shape[2], dk, v.shape[-1]))], -1)
    y, final = fn(q, k, wide, *args, initial)
    return y[..., dk:], y[..., :dk], final[..., :dk], final[..., dk:]


def kda_summary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                beta: torch.Tensor, mask: torch.Tensor):
    """kda from a zero state with its entry map and summary (as delta_rule_summary): y, P, M, S."""
    keep = mask[..., None].to(q.dtype)
    return _widened(kda, q, k, v, log_decay * keep[..., None], beta * keep)


def selective_scan(dt: torch.Tensor, a: torch.Tensor, bx: torch.Tensor, c: torch.Tensor,
                   mask: torch.Tensor, initial: torch.Tensor | None = None):
    """Mamba's diagonal recurrence, token by token: h_t = exp(dt_t A) * h_{t-1} + bx_t,
    y_t = h_t c_t (per channel d: h (D, K) with K the state size).

    dt (N, L, D), a (D, K), bx (N, L, D, K) (dt_t x_t B_t), c (N, L, K), mask (N, L);
    initial (N, D, K) or None. Returns y (N, L, D), h_L, and M = exp(A sum dt) (N, D, K)."""
    dt = dt * mask[..., None].to(dt.dtype)
    bx = bx * mask[..., None, None].to(bx.dtype)
    h = initial if initial is not None else bx.new_zeros((bx.shape[0], *bx.shape[2:]))
    ys = []
    for dt_t, bx_t, c_t in zip(dt.unbind(1), bx.unbind(1), c.unbind(1)):
        h = torch.exp(dt_t[:, :, None] * a) * h + bx_t
        ys.append(h @ c_t[:, :, None])
    y = torch.cat(ys, -1).transpose(1, 2) if ys else dt.new_zeros(dt.shape)
    return y, h, torch.exp(dt.sum(1)[..., None] * a)


def read_entry(p: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    """The outputs' part that reads the entry state: p (..., L, H, K) . entry (..., H, K, V)
    -> (..., L, H, V)."""
    return torch.einsum("...lhk,...hkv->...lhv", p, entry)
