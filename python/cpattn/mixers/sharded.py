"""The piece map and exchange of a cpattn.ContextParallel: the tokens each rank holds under its
settings (sequences sharded by cpattn.positions' layout, the hybrid mesh's, or packed documents
from cpattn.shard_batch: a DocumentPlan or per document), from the functions that shard them."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from cpattn.mixers.exchange import Exchange, group_exchange
from cpattn.mixers.pieces import PieceMap, build_piece_map
from cpattn.parallel import ContextParallel
from cpattn.sharding.packing import Documents
from cpattn.strategies.registry import STRATEGIES

WHAT = "cpattn.mixers"


def check_settings(cp: ContextParallel, what: str = WHAT) -> None:
    """Raises ValueError (the same on every rank: it depends on cp only) for settings under which
    the mixers are not exact: the striped layout (every token its own piece: a summary per
    token) and invariant mode (the fold's order follows W)."""
    if cp.layout == "striped":
        raise ValueError(f"{what}: the striped layout puts consecutive tokens on different ranks, "
                         "so a convolution or recurrent layer would exchange a state per token; "
                         "cpattn refuses it for models with such layers: use layout='zigzag' or "
                         "'contiguous'")
    if cp.invariant:
        raise ValueError(f"{what}: invariant mode (results bitwise independent of the number of "
                         "ranks) does not cover convolution, state-space or linear-attention "
                         "layers: their states are folded at the ranks' boundaries, which move "
                         "with W. Use ContextParallel(invariant=False) for this model")


def _mesh(cp: ContextParallel) -> tuple:
    """(strategy, its shard key, world): what every rank's tokens depend on (hashable)."""
    return (cp.strategy, cp.spec.shard_key(cp), cp.world_size)


def piece_map_of(cp: ContextParallel, local_len: int,
                 documents: Optional[Documents] = None) -> PieceMap:
    """The piece map of cp's ranks holding `local_len` tokens each of rows of local_len * W tokens
    (documents None), or shard_batch's tokens of these packed documents."""
    check_settings(cp)
    # Under torch.compile the piece map is built while dynamo traces, and the graph reads it from
    # _PIECE_MAPS (a global: dynamo can guard on it; an object a constant function returns it
    # cannot).
    return _PIECE_MAPS[_piece_map_key(_mesh(cp), local_len, documents)]


# signature -> piece map, the latest 256 (packed batches vary)
_PIECE_MAPS: dict[bytes, PieceMap] = {}


@torch._dynamo.assume_constant_result
def _piece_map_key(mesh: tuple, local_len: int, documents: Optional[Documents]) -> bytes:
    """The signature of _cached_piece_map's piece map, which is then in _PIECE_MAPS."""
    piece_map = _cached_piece_map(mesh, local_len, documents)
    _PIECE_MAPS.pop(piece_map.signature, None)
    _PIECE_MAPS[piece_map.signature] = piece_map  # (the most recent last)
    while len(_PIECE_MAPS) > 256:
        del _PIECE_MAPS[next(iter(_PIECE_MAPS))]
    return piece_map.signature


@functools.lru_cache(maxsize=64)
def _cached_piece_map(mesh: tuple, local_len: int, documents: Optional[Documents]) -> PieceMap:
    strategy, key, world = mesh
    spec = STRATEGIES[strategy]
    indices = []
    for rank in range(world):
        if documents is not None and documents.plan is not None:
            index, _ = documents.plan_positions(rank)
        elif documents is not None:
            index = spec.rank_document_positions(key, documents, rank)
        else:
            index = spec.rank_positions(key, local_len * world, rank)
        indices.append(index)
    bounds = documents.cu_seqlens if documents is not None else (0, local_len * world)
    return build_piece_map(indices, bounds)


def exchange_of(cp: ContextParallel) -> Exchange:
    """The exchange over cp's ranks, in cp.rank order."""
    return group_exchange(cp.groups)
