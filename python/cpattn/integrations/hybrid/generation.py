"""A parallelized mixer's call under ContextParallelCache (generation).

Every rank runs `generate` on the same full prompt, so a mixer layer gets the whole chunk of
every row, replicated (as attention does):

- **prefill** (a prompt chunk): the leading multiple of the layout granularity of each row's
  tokens runs context-parallel: each rank its layout shard through the module's adapter (the
  halo and the state scan between the ranks), starting from the row's cached state
  (`cpattn.mixers.handoff.Handoff`); the outputs are all-gathered back to sequence order, the
  row's final recurrent state is broadcast from the rank that holds its last piece, and its
  last k conv inputs are gathered. The rest (fewer tokens than the granularity) runs on every
  rank alike, from the state just handed off. Both end in the cache's layer, in the layout of
  transformers' own cache (what the module's own decode reads);
- **decode** (one token per row, a cached state): the module's own forward with the cache,
  replicated on every rank: no communication.

A left-padded batch (generate's way to batch prompts of different lengths) runs each row's real
tokens alone (its padding is no part of its sequence: transformers' padded generate gives the
same tokens as each prompt alone).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from cpattn.core.signature import digest_ints
from cpattn.integrations._generation import ContextParallelCache, MixerLayer, left_padded
from cpattn.mixers.exchange import stacked
from cpattn.mixers.handoff import Handoff
from cpattn.mixers.pieces import build_piece_map
from cpattn.mixers.sharded import exchange_of, piece_map_of
from cpattn.mixers.tree_scan import scan_setting

WHAT = "cpattn.integrations.transformers"


class Layout(NamedTuple):
    """How an adapter's recurrent state (the kernels' layout) sits in transformers' cache:
    to_cache / from_cache map one to the other; model_dtype: stored in the model's dtype (else
    float32)."""

    to_cache: Callable[[torch.Tensor], torch.Tensor]
    from_cache: Callable[[torch.Tensor], torch.Tensor]
    model_dtype: bool = False


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _swap(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


# adapter name -> its state's layout: Mamba-2's cache is (B, H, head_dim, state) where the
# kernel's is (B, H, state, head_dim); MiniMax keeps its state in the model's dtype.
LAYOUTS = {"mamba2": Layout(_swap, _swap), "lightning": Layout(_same, _same, True)}
DEFAULT = Layout(_same, _same)


def is_generating(cache: Any) -> bool:
    return isinstance(cache, ContextParallelCache)


def generation_forward(role, module: torch.nn.Module, hidden: torch.Tensor, call: dict,
                       cache: ContextParallelCache, args: tuple, kwargs: dict):
    """The mixer's call with ContextParallelCache (see the module docstring)."""
    name = type(module).__name__
    index = getattr(module, "layer_idx", None)
    layer = cache.layers[index] if isinstance(index, int) and index < len(cache.layers) else None
    if not isinstance(layer, MixerLayer):
        raise ValueError(f"{WHAT}: {name} (layer {index}) has no mixer layer in the "
                         "ContextParallelCache: build the cache from this model's config "
                         "(ContextParallelCache(cp, model.config, capacity))")
    n = hidden.shape[1]
    if n == 1 and layer.has_previous_state[0]:  # decode: the module's own step, replicated
        layer.tokens += 1
        return type(module).forward(module, *args, **kwargs)
    out = _prefill(role, module, hidden, call.get("attention_mask"), layer)
    layer.tokens += n
    return out


def _real_tokens(mask, batch: int, n: int) -> list[int]:
    """Each row's tokens that are not left padding among the chunk's n (mask: None or the 2-D
    0/1 mask transformers hands a mixer); raises ValueError for other padding."""
    if mask is None:
        return [n] * batch
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != batch or \
            mask.shape[1] < n:
        raise ValueError(f"{WHAT}: ContextParallelCache: a mixer got an attention mask of shape "
                         f"{tuple(getattr(mask, 'shape', ()))}, not the 2-D padding mask "
                         f"(batch {batch}, {n} tokens) transformers hands mixers")
    m = mask[:, -n:]
    if not left_padded(m):
        raise ValueError(f"{WHAT}: ContextParallelCache generates padded batches with left "
                         "padding only (tokenizer padding_side='left', as generate expects)")
    return [int(c) for c in m.to(torch.int64).sum(1).tolist()]


def _prefill(role, module: torch.nn.Module, hidden: torch.Tensor, mask, layer: MixerLayer):
    cp = role.state.cp
    batch, n = hidden.shape[:2]
    name = type(module).__name__

    def check():
        scan = scan_setting(exchange_of(cp))  # (a bad $CPATTN_MIXER_SCAN raises on every rank)
        real = _real_tokens(mask, batch, n)
        for r in sorted(set(real)):
            lead = r - r % cp.granularity
            if lead:
                piece_map_of(cp, lead // cp.world_size)  # (refuses striped, invariant)
        return real, [("mixer", name), ("layer", module.layer_idx),
                      ("hidden_states.shape", digest_ints(hidden.shape)),
                      ("hidden_states.dtype", hidden.dtype), ("real tokens", digest_ints(real)),
                      ("cached", int(layer.has_previous_state[0])), ("state scan", scan)]

    real = cp.agree(WHAT, check)
    if real == [n] * batch:
        groups = [(slice(None), n)]
    else:  # rows of different lengths: each row's real tokens alone
        groups = [(slice(b, b + 1), r) for b, r in enumerate(real) if r]
    out, second = None, None
    for rows, r in groups:
        y = _prefill_rows(role, module, hidden[rows, n - r:], layer, rows, batch)
        if isinstance(y, tuple):  # (MiniMax's lightning: (out, None))
            y, second = y[0], y[1:]
        if out is None:
            out = y.new_zeros((batch, n, *y.shape[2:]))
        out[rows, n - r:] = y
    if out is None:  # (every row padding)
        out = hidden.new_zeros(hidden.shape)
    return out if second is None else (out, *second)


def _prefill_rows(role, module: torch.nn.Module, x: torch.Tensor, layer: MixerLayer, rows,
                  batch: int):
    """x (b, r, hidden): the rows' real tokens of the chunk, every rank alike (rows: which of
    the batch's `batch`). Returns the adapter's output over them (b, r, hidden), every rank
    alike; the rows' states in `layer`."""
    cp, adapter = role.state.cp, role.adapter
    layout = LAYOUTS.get(adapter.name, DEFAULT)
    r = x.shape[1]
    lead = r - r % cp.granularity
    parts = []
    if lead:  # context-parallel over the ranks
        index = cp.positions(lead, device=x.device)
        mix = _handoff(piece_map_of(cp, lead // cp.world_size), cp.rank, exchange_of(cp),
                       x.shape[0], layer, rows, layout)
        y = adapter.fn(module, x[:, :lead].index_select(1, index), mix)
        parts.append(_map_first(y, cp.unshard))
        _commit(layer, rows, mix, layout, _broadcaster(cp), x.dtype, batch)
    if r > lead:  # the rest: every rank alike
        rest = r - lead
        mix = _handoff(build_piece_map([torch.arange(rest)], (0, rest)), 0, stacked,
                       x.shape[0], layer, rows, layout)
        parts.append(adapter.fn(module, x[:, lead:], mix))
        _commit(layer, rows, mix, layout, lambda t, src: t, x.dtype, batch)
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], tuple):
        return (torch.cat([p[0] for p in parts], 1), *parts[0][1:])
    return torch.cat(parts, 1)


def _map_first(y, fn):
    return (fn(y[0]), *y[1:]) if isinstance(y, tuple) else fn(y)


def _broadcaster(cp):
    def broadcast(t: torch.Tensor, src: int) -> torch.Tensor:
        t = t.contiguous()
        dist.broadcast(t, group=cp.group, group_src=src)
        return t
    return broadcast


def _handoff(piece_map, rank: int, exchange, batch: int, layer: MixerLayer, rows,
             layout: Layout) -> Handoff:
    """The Handoff of the rows, from the layer's cached history (b, k - 1, C) and state (b, ...
    in the kernel's layout), none where the layer holds nothing yet."""
    history = initial = None
    if layer.has_previous_state[0]:
        conv, state = layer.conv_states[0], layer.recurrent_states[0]
        history = conv[rows, :, 1:].transpose(1, 2) if conv is not None else None
        initial = layout.from_cache(state[rows]).float() if state is not None else None
    return Handoff(piece_map, rank, exchange, batch, history=history, initial=initial)


def _commit(layer: MixerLayer, rows, mix: Handoff, layout: Layout, broadcast,
            dtype: torch.dtype, batch: int) -> None:
    """Stores what the rows end with (the conv tail, the broadcast final state) in the layer, in
    transformers' layout: conv_states (B, C, k), recurrent_states as the module keeps them."""
    tail = mix.found.get("tail")
    state = mix.handed_off(broadcast) if "final" in mix.found else None
    store(layer, rows, tail.transpose(1, 2) if tail is not None else None,
          layout.to_cache(state) if state is not None else None,
          dtype if layout.model_dtype else torch.float32, batch)


def store(layer: MixerLayer, rows, conv: Optional[torch.Tensor], state: Optional[torch.Tensor],
          state_dtype: torch.dtype, batch: int) -> None:
    """Writes the rows' conv state (b, C, k) and recurrent state (b, ...) into the layer
    (allocated for the whole batch of `batch` rows at its first write)."""
    full = batch
    if conv is not None:
        if not layer.is_conv_states_initialized[0]:
            MixerLayer.lazy_initialization(layer, conv_states=conv.new_zeros((full,
                                                                            *conv.shape[1:])))
        layer.conv_states[0][rows] = conv.to(layer.conv_states[0].dtype)
    if state is not None:
        if not layer.is_recurrent_states_initialized[0]:
            MixerLayer.lazy_initialization(layer, recurrent_states=state.new_zeros(
                (full, *state.shape[1:]), dtype=state_dtype))
        layer.recurrent_states[0][rows] = state.to(layer.recurrent_states[0].dtype)
    layer.has_previous_state[0] = True
