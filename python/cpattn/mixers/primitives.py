"""The two primitives that make a token mixer exact on sharded tokens.

- `conv_halo` / `causal_conv`: a causal depthwise convolution over each piece, with the `width`
  conv inputs before the piece in its document (zeros before the document's start) fetched from
  the ranks that hold them. Differentiable: the halo's gradient goes back to its owner.
- `state_scan`: for a recurrence affine in its state (S_out = M S_in + S over a piece), the entry
  state of every linked piece (a whole document has none): the fold, in global order, of the
  summaries (M, S) of the pieces before it in its document (zero for a document's first piece).
  One exchange of the summaries; the backward is autograd's (the adjoint fold, a reduce-scatter
  of the summaries' gradients).

Both run in two phases around one exchange (`..._publish`, then `..._take` on the gathered
tensor), so one process can play W ranks (cpattn.mixers.exchange). Every rank calls the exchange
whenever any rank needs it (the piece map is the same everywhere), and keeps the gathered tensor
in its autograd graph even when none of its pieces reads it, so every rank also takes part in the
backward's reduce-scatter.

Shapes: local tensors are (B, L, ...) for this rank's L tokens (B rows sharded alike, or one row
of packed documents); states and summaries (B, n, ...) for its n linked pieces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cpattn.mixers.algebra import apply_transition, compose  # noqa: F401 (re-exported)
from cpattn.mixers.exchange import Exchange
from cpattn.mixers.pieces import PieceMap
from cpattn.mixers.tree_scan import scan_method, tree_scan
from cpattn.plan.mixer_scan import KINDS


def _index(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _pick(x: torch.Tensor, rows, dim: int) -> torch.Tensor:
    """x's entries `rows` along dim, index len(x) along dim giving a zero entry."""
    zero = x.new_zeros((*x.shape[:dim], 1, *x.shape[dim + 1:]))
    return torch.cat([x, zero], dim).index_select(dim, _index(rows, x.device))


# --- the convolution halo --------------------------------------------------------------------

def halo_publish(x: torch.Tensor, piece_map: PieceMap, rank: int, width: int) -> torch.Tensor:
    """(rows, B, ...): the local tokens of x (B, L, ...) that some piece reads as its halo."""
    mine, _ = piece_map.halo(rank, width)
    rows = tuple(piece_map.local_len[rank] if i < 0 else i for i in mine)
    return _pick(x, rows, 1).transpose(0, 1)


def halo_take(gathered: torch.Tensor, piece_map: PieceMap, rank: int, width: int) -> torch.Tensor:
    """(B, n, width, ...): each piece's halo (oldest first) from every rank's published rows
    gathered (W, rows, B, ...)."""
    _, sources = piece_map.halo(rank, width)
    flat = gathered.flatten(0, 1)
    n = len(sources)
    picked = _pick(flat, tuple(s for src in sources for s in src), 0)
    halo = picked.reshape(n, width, *flat.shape[1:]).movedim(2, 0)
    return halo + 0 * gathered.sum()  # (in every rank's graph: every rank joins the backward)


def conv_halo(x: torch.Tensor, piece_map: PieceMap, rank: int, width: int,
              exchange: Exchange) -> torch.Tensor:
    """(B, n, width, ...): the `width` inputs before each of rank's pieces in its document (zero
    before the document's start) of the sharded x (B, L, ...). Differentiable."""
    _, sources = piece_map.halo(rank, width)
    if width == 0 or not any(len(piece_map.halo(r, width)[0]) for r in range(piece_map.world)):
        return x.new_zeros((x.shape[0], len(sources), width, *x.shape[2:]))
    return halo_take(exchange(halo_publish(x, piece_map, rank, width)), piece_map, rank, width)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias, piece_map: PieceMap, rank: int,
                exchange: Exchange) -> torch.Tensor:
    """The causal depthwise convolution of the sharded x (B, L, C) with weight (C, k) and bias
    (C,) or None, each document from zero history: (B, L, C), zero at padding tokens, in x's
    dtype (computed in the weight's, as nn.Conv1d). One convolution over the rank's pieces each
    after its halo (piece_map.conv_rows): work proportional to the tokens."""
    width = weight.shape[-1] - 1
    halo = conv_halo(x, piece_map, rank, width, exchange)  # (B, n, k-1, C)
    if not piece_map.pieces[rank]:  # a rank without tokens (a document plan): nothing to do
        return x.new_zeros(x.shape) + 0 * halo.sum()
    seq_index, out_index = piece_map.conv_rows(rank, width)
    table = torch.cat([x, halo.flatten(1, 2)], 1)
    seq = table.index_select(1, _index(seq_index, x.device)).transpose(1, 2).to(weight.dtype)
    out = F.conv1d(seq, weight[:, None, :], bias, groups=x.shape[-1]).transpose(1, 2)
    return _pick(out, out_index, 1).to(x.dtype)


# --- the state scan --------------------------------------------------------------------------



def summary_publish(m: torch.Tensor, s: torch.Tensor, piece_map: PieceMap,
                    rank: int) -> torch.Tensor:
    """(slots, B, |M| + |S|): the flattened summaries (M, S) of rank's linked pieces whose
    documents continue elsewhere (m (B, n, ...), s (B, n, ...)), zero in unused slots."""
    batch = s.shape[0]
    flat = torch.cat([m.flatten(2), s.flatten(2)], 2)  # (B, n, |M| + |S|)
    mine = piece_map.published(rank)
    rows = mine + (len(piece_map.linked(rank)),) * (piece_map.slots - len(mine))
    return _pick(flat, rows, 1).transpose(0, 1).reshape(piece_map.slots, batch, -1)


def fold_take(gathered: torch.Tensor, piece_map: PieceMap, rank: int, kind: str,
              m_shape: tuple, s_shape: tuple) -> torch.Tensor:
    """(B, n, *s_shape): each of rank's linked pieces' entry state, the fold in global order of the
    gathered summaries (W, slots, B, |M| + |S|) of the pieces before it (M of shape m_shape,
    B of shape s_shape, per row)."""
    steps = piece_map.fold_steps(rank)  # the identity first (0 stays 0), then the chain in order
    flat = gathered.flatten(0, 1)  # (W slots, B, |M| + |S|)
    batch, m_size = flat.shape[1], 1
    for d in m_shape:
        m_size *= d
    n = len(piece_map.linked(rank))
    state = flat.new_zeros((batch, n, *s_shape))
    if steps:
        identity = _identity(kind, m_shape, flat)  # (|M|,)
        table = torch.cat([flat, torch.cat([identity, flat.new_zeros(flat.shape[2] - m_size)])
                           .expand(1, batch, -1)])
        for ids in steps:
            entry = table.index_select(0, _index(ids, flat.device))
            entry = entry.transpose(0, 1)  # (B, n, |M| + |S|)
            m = entry[..., :m_size].reshape(batch, n, *m_shape)
            b = entry[..., m_size:].reshape(batch, n, *s_shape)
            state = apply_transition(kind, m, state) + b
    return state + 0 * gathered.sum()  # (in every rank's graph: every rank joins the backward)


def _identity(kind: str, m_shape: tuple, like: torch.Tensor) -> torch.Tensor:
    if kind == "matrix":
        k = m_shape[-1]
        return torch.eye(k, dtype=like.dtype, device=like.device).expand(*m_shape).flatten()
    return like.new_ones(m_shape).flatten()


def state_scan(m: torch.Tensor, s: torch.Tensor, piece_map: PieceMap, rank: int, kind: str,
               exchange: Exchange) -> torch.Tensor:
    """Entry states (B, n, ...) of rank's n linked pieces (piece_map.linked(rank)) given their
    summaries: m (B, n, ...) the transition of each piece (`kind`: "scalar" (B, n, H),
    "diagonal" like s, "matrix" (B, n, H, K, K)), s (B, n, ...) its state at its end when
    started from zero. fp32 in, fp32 out; differentiable; a document's first piece gets
    zeros."""
    if kind not in KINDS:
        raise ValueError(f"cpattn.mixers.state_scan: kind={kind!r}: must be one of {KINDS}")
    m_shape, s_shape = tuple(m.shape[2:]), tuple(s.shape[2:])
    if piece_map.slots == 0:  # no document continues on another piece anywhere: nothing to exchange
        return s.new_zeros(s.shape)
    method = scan_method(exchange, piece_map, kind, m_shape, s_shape, s.shape[0], s.device.type)
    if method == "tree":  # the log-depth scan (mixers/tree_scan.py), else the all-gather's fold
        return tree_scan(m, s, piece_map, rank, kind, exchange)
    gathered = exchange(summary_publish(m, s, piece_map, rank))
    return fold_take(gathered, piece_map, rank, kind, m_shape, s_shape)
