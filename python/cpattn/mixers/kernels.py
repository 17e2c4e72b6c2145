"""Local recurrences over flat rows of tokens, by blocks, in the dtype they are given (the
callers pass float32, or float64 in the tests; cpattn.mixers.mixing turns autocast off).

A *row* (N, L, ...) holds documents one after another: a *reset* token starts a document (the
state is zero before it). Rows are cut into blocks of `block` tokens; within a block everything
is one matrix form (the outputs from the block's own tokens, what the block adds to the state,
how its outputs read the state it starts from), and a short loop over the blocks carries the
state. Decays are segment sums inside a block (segsum: the sum of the log decays of the tokens
between two, never a difference of two running sums) and products of block decays across blocks,
so strong decays lose no digits; a reset is a log decay of -inf (exact zeros, no NaN).

The loop over blocks can restart at given blocks (`entries`: the state a block starts from, a
piece's entry state in the state scan) and record the state after given blocks (`ends`), with
the piece's transition M (S_end = M S_start + S): the summaries of the state scan. Pieces that
use them start at a block's first token and end padded by identity tokens (zero inputs, zero
log decay) to a block's end (cpattn.mixers.pieces.FlatRows).

Recurrences (states K-first: S (H, K, V); outputs read the state after the token's own update):
- `scalar_blocks`: S_t = exp(a_t) S_{t-1} + k_t v_t^T (Mamba-2's SSD, lightning attention);
- `delta_blocks`: the gated delta rule S_t = exp(a_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T
  (the WY form: one triangular solve per block);
- `kda_blocks`: Kimi delta attention, the delta rule with a decay per key channel;
- `selective_blocks`: Mamba's h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t, y_t = h_t C_t (a decay
  per channel and state entry: no matrix form; the tokens of a block are a loop run for every
  block at once, so the loops are `block` + L / `block` steps long, not L).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

NEG_INF = float("-inf")


def chunked(x: torch.Tensor, block: int) -> torch.Tensor:
    """(N, L, ...) -> (N, C, block, ...), zero-padded at the end (one block at least)."""
    pad = -x.shape[1] % block if x.shape[1] else block
    if pad:
        x = torch.cat([x, x.new_zeros((x.shape[0], pad, *x.shape[2:]))], 1)
    return x.reshape(x.shape[0], x.shape[1] // block, block, *x.shape[2:])


def segsum(a: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Segment sums of the log decays a along dim (-1 or -2; c entries): (..., c, c) for dim -1,
    (..., c, c, K) for dim -2, entry [i, j] = a_{j+1} + ... + a_i for j <= i, -inf for j > i.
    Each is its own sum (a running sum down the columns of a masked matrix): no digits cancel,
    and -inf in a gives -inf, not NaN."""
    if dim == -2:
        return segsum(a.transpose(-1, -2)).movedim(-3, -1)
    c = a.shape[-1]
    strict = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1)
    rows = a[..., :, None].expand(*a.shape, c).masked_fill(~strict, 0.0)  # [i, j] = a_i, i > j
    return rows.cumsum(-2).masked_fill(strict.transpose(0, 1), NEG_INF)


def with_resets(log_decay: torch.Tensor, resets: Optional[torch.Tensor]) -> torch.Tensor:
    """log_decay (N, L, ...) with -inf at the reset tokens (resets (L,) bool or None)."""
    if resets is None:
        return log_decay
    shape = (1, -1) + (1,) * (log_decay.dim() - 2)
    return log_decay.masked_fill(resets.reshape(shape), NEG_INF)


def _heads(x: torch.Tensor, block: int) -> torch.Tensor:
    """(N, L, H, ...) -> head-major blocks (N, H, C, c, ...), contiguous (one copy, not one per
    matrix product)."""
    return chunked(x, block).movedim(3, 1).contiguous()


class Blocks(NamedTuple):
    """A scan's per-block terms, head-major (N, H, C, c, ...): y_c = intra_c + read_c S_c and
    S_{c+1} = decay_c * S_c + k_end_c^T (u_c - w_c S_c) (w None: no delta, S += k_end^T u)."""

    intra: torch.Tensor  # (N, H, C, c, V)
    read: torch.Tensor  # (N, H, C, c, K)
    decay: torch.Tensor  # (N, H, C, 1 or K): per head or per key channel
    k_end: torch.Tensor  # (N, H, C, c, K): keys decayed to the block's end
    u: torch.Tensor  # (N, H, C, c, V)
    w: Optional[torch.Tensor]  # (N, H, C, c, K)

    @staticmethod
    def cat(parts: list) -> "Blocks":
        """The blocks of consecutive parts of a row, as one."""
        if len(parts) == 1:
            return parts[0]
        return Blocks(*(None if f[0] is None else torch.cat(f, 2) for f in zip(*parts)))

    def steps(self) -> list:
        """Per block, what advance needs (unbind, not an index per block: the backward of one
        select per block would write a whole zero gradient each)."""
        w = self.w.unbind(2) if self.w is not None else [None] * self.u.shape[2]
        return list(zip(self.decay.unbind(2), self.k_end.transpose(-1, -2).unbind(2),
                        self.u.unbind(2), w))

    @staticmethod
    def advance(step: tuple, state: torch.Tensor, inputs: bool = True) -> torch.Tensor:
        """The state after a block (its `step`) from `state` (N, H, K, V) before it;
        inputs=False: the homogeneous part (the transition applied to state)."""
        decay, k_end_t, u, w = step
        out = decay[..., None] * state
        if w is not None:
            delta = -(w @ state)
            out = out + k_end_t @ (delta + u if inputs else delta)
        elif inputs:
            out = out + k_end_t @ u
        return out

    def outputs(self, states: torch.Tensor, length: Optional[int]) -> torch.Tensor:
        """y (N, length, H, V) from the state each block starts from (N, H, C, K, V) (length
        None: every block's tokens)."""
        y = self.intra + self.read @ states
        return y.flatten(2, 3)[:, :, :length].transpose(1, 2)


def scalar_blocks(q, k, v, a, block: int = 64) -> Blocks:
    """S_t = exp(a_t) S_{t-1} + k_t v_t^T, y_t = S_t^T q_t: q, k (N, L, H, K), v (N, L, H, V),
    log decay a (N, L, H) <= 0 (-inf: a reset)."""
    qc, kc, vc = (_heads(t, block) for t in (q, k, v))
    ac = _heads(a, block)  # (N, H, C, c)
    ss = segsum(ac)  # (N, H, C, c, c)
    g = ac.cumsum(-1)  # decay from the block's start (a sum of at most `block` terms)
    intra = ((qc @ kc.transpose(-1, -2)) * ss.exp()) @ vc
    k_end = kc * ss[..., -1, :].exp()[..., None]
    return Blocks(intra, qc * g.exp()[..., None], g[..., -1:].exp(), k_end, vc, None)


def _delta(qc, kc, vc, bc, log_g, dot) -> tuple:
    """The WY form shared by the delta rules: dot(x, y) the decayed products (c, c)."""
    strict = torch.ones(qc.shape[-2], qc.shape[-2], dtype=torch.bool,
                        device=qc.device).tril(-1)
    system = (bc[..., None] * dot(kc, kc)).masked_fill(~strict, 0.0)
    u = torch.linalg.solve_triangular(system, bc[..., None] * vc, upper=False,
                                      unitriangular=True)
    w = torch.linalg.solve_triangular(system, bc[..., None] * kc * log_g.exp(), upper=False,
                                      unitriangular=True)
    attn = dot(qc, kc)
    return attn @ u, qc * log_g.exp() - attn @ w, u, w


def delta_blocks(q, k, v, a, beta, block: int = 64) -> Blocks:
    """The gated delta rule (shapes of scalar_blocks; q, k already normalised and scaled; beta b
    (N, L, H))."""
    qc, kc, vc = (_heads(t, block) for t in (q, k, v))
    ac, bc = _heads(a, block), _heads(beta, block)
    ss = segsum(ac)
    decay_ij = ss.exp()
    g = ac.cumsum(-1)

    def dot(x, y):
        return (x @ y.transpose(-1, -2)) * decay_ij

    intra, read, u, w = _delta(qc, kc, vc, bc, g[..., None], dot)
    k_end = kc * ss[..., -1, :].exp()[..., None]
    return Blocks(intra, read, g[..., -1:].exp(), k_end, u, w)


def kda_blocks(q, k, v, g, beta, block: int = 32, sub: int = 4) -> Blocks:
    """Kimi delta attention: S_t = (I - b_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + b_t k_t v_t^T,
    a log decay per key channel g (N, L, H, K) (other shapes as delta_blocks); sub-blocks of
    gcd(block, sub) tokens (_decayed_dots; the defaults were the fastest of 16 to 64 and 4 to
    16 on this CPU)."""
    sub = math.gcd(block, sub)
    qc, kc, vc = (_heads(t, block) for t in (q, k, v))
    gc, bc = _heads(g, block), _heads(beta, block)  # (N, H, C, c, K), (N, H, C, c)
    cum = gc.cumsum(-2)  # decay from the block's start (a sum of at most `block` terms)

    def dot(x, y):
        return _decayed_dots(x, y, gc, sub)

    intra, read, u, w = _delta(qc, kc, vc, bc, cum, dot)
    k_end = kc * _after(gc).exp()
    return Blocks(intra, read, cum[..., -1, :].exp(), k_end, u, w)


def _after(g: torch.Tensor) -> torch.Tensor:
    """(..., c, K): the sum of g over the tokens after each one, to the end (dim -2)."""
    later = torch.cat([g[..., 1:, :], torch.zeros_like(g[..., :1, :])], -2)
    return later.flip(-2).cumsum(-2).flip(-2)


def _decayed_dots(x: torch.Tensor, y: torch.Tensor, g: torch.Tensor, sub: int) -> torch.Tensor:
    """(..., c, c): [i, j] = sum_k x_i[k] y_j[k] exp(g_{j+1} + ... + g_i)[k] for j <= i, 0 above
    (x, y, g (..., c, K)). The block is cut in sub-blocks of `sub` tokens: within one, the decays
    are (sub, sub, K) segment sums; between two, x decayed from its sub-block's start, y to its
    sub-block's end and the sub-blocks between: three factors <= 1, each a sum of log decays
    (none overflows, none cancels), and the product over k is a matrix product."""
    *lead, c, dk = g.shape
    parts = c // sub
    xs, ys, gs = (t.reshape(*lead, parts, sub, dk) for t in (x, y, g))
    within = torch.einsum("...ak,...bk,...abk->...ab", xs, ys, segsum(gs, dim=-2).exp())
    from_start = gs.cumsum(-2)
    between = segsum(from_start[..., -1, :], dim=-2)  # (..., P, P, K): sub-blocks J+1 .. I
    # [I, J]: the sub-blocks strictly between J and I (-inf for J >= I: no pair)
    middle = torch.cat([torch.full_like(between[..., :1, :, :], NEG_INF), between[..., :-1, :, :]],
                       -3)
    across = torch.einsum("...Iak,...IJk,...Jbk->...IJab", xs * from_start.exp(), middle.exp(),
                          ys * _after(gs).exp())
    eye = torch.eye(parts, dtype=x.dtype, device=x.device)[:, :, None, None]
    out = across + eye * within[..., :, None, :, :]  # (..., P, P, sub, sub)
    return out.transpose(-3, -2).reshape(*lead, c, c)


class Diagonal(NamedTuple):
    """Mamba's per-block terms, (N, C, c, ...): y0 (N, C, c, D) the outputs from a zero state at
    each block's start, own (N, C, D, Ns) the block's state at its end from zero, cum
    (N, C, c, D) the sums of dt from the block's start, alive (C, c) 1 for the tokens that no
    reset separates from their block's start, c_ (N, C, c, Ns), a (D, Ns)."""

    y0: torch.Tensor
    own: torch.Tensor
    cum: torch.Tensor
    alive: torch.Tensor
    c_: torch.Tensor
    a: torch.Tensor

    @staticmethod
    def cat(parts: list) -> "Diagonal":
        """The blocks of consecutive parts of a row, as one."""
        if len(parts) == 1:
            return parts[0]
        y0, own, cum, alive, c_, a = zip(*parts)
        return Diagonal(torch.cat(y0, 1), torch.cat(own, 1), torch.cat(cum, 1),
                        torch.cat(alive, 0), torch.cat(c_, 1), a[0])

    def steps(self) -> list:
        """Per block: its decay (N, D, Ns) and its state from zero (see Blocks.steps)."""
        decay = torch.exp(self.cum[:, :, -1, :, None] * self.a) * self.alive[None, :, -1, None,
                                                                            None]
        return list(zip(decay.unbind(1), self.own.unbind(1)))

    @staticmethod
    def advance(step: tuple, state: torch.Tensor, inputs: bool = True) -> torch.Tensor:
        decay, own = step
        return decay * state + own if inputs else decay * state

    def outputs(self, states: torch.Tensor, length: Optional[int]) -> torch.Tensor:
        """y (N, length, D) from the state each block starts from (N, C, D, Ns) (length None:
        every block's tokens)."""
        decay = torch.exp(self.cum[..., None] * self.a) * self.alive[None, :, :, None, None]
        y = self.y0 + ((decay * states[:, :, None]) * self.c_[:, :, :, None, :]).sum(-1)
        return y.flatten(1, 2)[:, :length]


def selective_blocks(dt, a, x, b, c, resets: Optional[torch.Tensor] = None,
                     block: int = 64) -> Diagonal:
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t (h (D, Ns) per token), y_t = h_t C_t: dt, x
    (N, L, D), a (D, Ns) <= 0, b, c (N, L, Ns); resets (L,) bool or None."""
    n, length = dt.shape[:2]
    dtc, xc, bc, cc = (chunked(t, block) for t in (dt, x, b, c))
    blocks = dtc.shape[1]
    kept = torch.ones(blocks * block, dtype=dt.dtype, device=dt.device)
    if resets is not None:
        kept[:length] = (~resets).to(dt.dtype)
    kept = kept.reshape(blocks, block)  # (C, c): 0 at a reset (the state before it is dropped)
    state = dt.new_zeros((n, blocks, dt.shape[2], a.shape[1]))
    ys = []
    for t in range(block):  # every block at once, from a zero state
        step = torch.exp(dtc[:, :, t, :, None] * a) * kept[None, :, t, None, None]
        state = step * state + (dtc[:, :, t] * xc[:, :, t])[..., None] * bc[:, :, t, None, :]
        ys.append((state * cc[:, :, t, None, :]).sum(-1))
    alive = kept.cummin(-1).values
    return Diagonal(torch.stack(ys, 2), state, dtc.cumsum(2), alive, cc, a)


# --- the loop over blocks --------------------------------------------------------------------

def block_states(blocks, initial: torch.Tensor, entries: Optional[dict] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state each block starts from, stacked at dim 2 for Blocks ((N, H, C, K, V)) or 1 for
    Diagonal ((N, C, D, Ns)), from `initial` (the first block's), restarted at block c from
    entries[c] when given; and the state after the last block."""
    state, states = initial, []
    for c, step in enumerate(blocks.steps()):
        if entries is not None and c in entries:
            state = entries[c]
        states.append(state)
        state = blocks.advance(step, state)
    return torch.stack(states, 2 if isinstance(blocks, Blocks) else 1), state


def summaries(blocks, zero: torch.Tensor, identity: torch.Tensor, starts: tuple,
              ends: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """For each piece (its first block starts[i], its last ends[i]): its transition M (the
    homogeneous advance applied to `identity`, stacked (N, n, ...)) and its state at its end
    from zero (N, n, ...)."""
    if not starts:
        return (identity.new_zeros((identity.shape[0], 0, *identity.shape[1:])),
                zero.new_zeros((zero.shape[0], 0, *zero.shape[1:])))
    ms, ss = [], []
    steps = blocks.steps()
    for first, last in zip(starts, ends):
        m, s = identity, zero
        for step in steps[first:last + 1]:
            m, s = blocks.advance(step, m, inputs=False), blocks.advance(step, s)
        ms.append(m)
        ss.append(s)
    return torch.stack(ms, 1), torch.stack(ss, 1)
