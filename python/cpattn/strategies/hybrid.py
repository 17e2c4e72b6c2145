"""The hybrid: Ulysses inside a group of U ranks, the ring across R such groups (W = U * R).

The Ulysses all-to-all gives each rank its ring shard for H / U heads; the ring (or ring varlen)
runs across the ring group on those heads; the all-to-all brings the output back. Sharding:
cpattn.hybrid_positions (sequences), ContextParallel.document_positions (packed documents).
"""

from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn.core.layout import granularity, padded_length, round_up
from cpattn.core.options import returned
from cpattn.core.validation import check_timeout, document_lengths, error, group_info
from cpattn.sharding.sequences import hybrid_positions, hybrid_ring_shard, hybrid_shard_positions
from cpattn.strategies.base import Strategy
from cpattn.strategies.ring import context_parallel
from cpattn.strategies.ulysses import across_heads, boundaries, max_logits_field


def _with_heads_maxima(out, lse, maxima: list, ulysses_group):
    """A hybrid call's out (and lse) with, when asked, the max logits of every head: each
    rank's ring gave its own heads' (over the whole sequence), all-gathered over Ulysses."""
    if maxima:
        maxima = [comm.all_gather(maxima[0], dim=0, group=ulysses_group)]
    return returned(out, lse, maxima)


def hybrid_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ulysses_group=None, ring_group=None,
    mesh=None, layout: str = "zigzag", seqlen: Optional[int] = None,
    timeout: Optional[float] = None, return_lse: bool = False, return_max_logits: bool = False,
    **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Ulysses inside `ulysses_group` (size U), ring across `ring_group` (size R), W = U * R.

    Alternatively `mesh`: a 2D DeviceMesh whose dim 0 is the ring and dim 1 is Ulysses.
    Sharding (see cpattn.hybrid_positions / hybrid_shard): the sequence is split over the R ring
    ranks by `layout`; the rank at ring index i and Ulysses index u holds the u-th contiguous
    sub-part of ring shard i. H % U == 0. Either group may have size 1.
    **options: the attention options, as ulysses_attention (per-head ones sliced to the rank's
    heads, then as ring_attention across the ring). v may have its own head dim.
    seqlen: the global sequence length, for any length (default: W times the shard length):
    hybrid_shard pads as hybrid_positions says; padding rows get out 0 and LSE -inf (with
    sinks: the sink); hybrid_unshard(..., seqlen=S) gives S tokens back.
    return_max_logits: as cpattn.ring_attention (last in the returned tuple).
    """
    if mesh is not None:
        ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    if ulysses_group is None or ring_group is None:
        raise ValueError("cpattn.hybrid_attention: give ulysses_group and ring_group, or a 2D mesh")
    what = "cpattn.hybrid_attention"
    timeout = check_timeout(what, timeout, ring_group, ulysses_group)
    r_world, u_world = dist.get_world_size(ring_group), dist.get_world_size(ulysses_group)

    maxima = []  # the ring's max logits of this rank's heads (over the whole sequence)

    def attend(qh, kh, vh, n, mine):  # this rank's ring shard, padded for the ring only
        out, lse, *best = context_parallel(
            "cpattn.ring_attention", qh, kh, vh, ring_group, layout, timeout, "ring", None,
            None, mine, seqlen=n, return_max_logits=return_max_logits)
        maxima.extend(best)
        return out, lse

    _, out, lse = across_heads(
        what, q, k, v, ulysses_group, timeout, attend, return_lse, options, layout=layout,
        seqlen=seqlen, rows=lambda n: hybrid_ring_shard(n, layout, r_world, u_world)[::-1],
        fields_of=max_logits_field(what, return_max_logits))
    return _with_heads_maxima(out, lse, maxima, ulysses_group)


def hybrid_attention_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens, *, ulysses_group,
    ring_group, layout: str = "zigzag", timeout: Optional[float] = None,
    return_lse: bool = False, return_max_logits: bool = False, **options,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Hybrid attention (Ulysses inside, ring across) over packed documents that never attend
    across each other. Sharding (cpattn.ContextParallel.document_positions): every document
    sharded per document over the R ring ranks (cpattn.shard_varlen's layout), each ring shard
    padded at its end to a multiple of U and cut in U contiguous parts. The Ulysses all-to-all
    gives each rank its ring shard for H / U heads, ring_attention_varlen runs across the ring.
    q (T_local, H, D), k / v (T_local, Hkv, D); returns out (T_local, H, Dv) and optionally lse
    (H, T_local); padding: 0 and -inf (with sinks: the sink); **options: the attention options
    but prefix_len; return_max_logits: as ring_attention_varlen (last)."""
    what = "cpattn.hybrid_attention_varlen"
    timeout = check_timeout(what, timeout, ring_group, ulysses_group)
    r_world, u_world = dist.get_world_size(ring_group), dist.get_world_size(ulysses_group)

    def fields_of():
        docs, _, raw = document_lengths(what, cu_seqlens)
        held = rows(None)[0] // u_world
        if q.shape[0] != held:
            raise error(what, "q tokens", q.shape[0], f"must be {held}: this rank's part of the "
                        "documents' sharding (cpattn.ContextParallel.document_positions)")
        return [("documents", docs.numel()), ("document_lengths", raw),
                *max_logits_field(what, return_max_logits)()]

    def rows(_):  # (a head shard's rows, the ring shard's: real) (in check(): agreed)
        cu = boundaries(cu_seqlens)
        ring_shard = sum(padded_length(b - a, layout, r_world) // r_world
                         for a, b in zip(cu[:-1], cu[1:]) if b > a)
        return round_up(ring_shard, u_world), ring_shard

    maxima = []

    def attend(qh, kh, vh, n, mine):  # qh: this rank's ring shard; out, lse (1, ...)
        out, lse, *best = context_parallel(
            "cpattn.ring_attention_varlen", qh[0], kh[0], vh[0], ring_group, layout, timeout,
            "ring", None, cu_seqlens, mine, return_max_logits=return_max_logits)
        maxima.extend(best)
        return out, lse

    _, out, lse = across_heads(what, q[None], k[None], v[None], ulysses_group, timeout, attend,
                               return_lse, options, seqlen=1, layout=layout,
                               fields_of=fields_of, rows=rows, fixed={"prefix_len": 0})
    return _with_heads_maxima(out[0], None if lse is None else lse[0], maxima, ulysses_group)


_SPLIT_GROUPS: dict = {}  # (group name, U) -> (ring group, Ulysses group)


class HybridStrategy(Strategy):
    """The hybrid's entry: two process groups (the ring's and Ulysses'), the sequence sharded
    over the ring by the layout, each ring shard cut in U contiguous parts."""

    def split_group(self, group, candidate) -> tuple:
        """(ring_group, ulysses_group) of this rank: the ranks candidate.ulysses apart in
        `group`, and candidate.ulysses consecutive ones. Made once per (group, U), by the members
        of each new group only."""
        u = candidate.ulysses
        key = (group.group_name, u)
        if key not in _SPLIT_GROUPS:
            ranks = dist.get_process_group_ranks(group)
            i, j = divmod(dist.get_rank(group), u)
            ulysses = dist.new_group(ranks[i * u:(i + 1) * u], use_local_synchronization=True)
            ring = dist.new_group(ranks[j::u], use_local_synchronization=True)
            _SPLIT_GROUPS[key] = (ring, ulysses)
        return _SPLIT_GROUPS[key]

    def groups(self, what: str, group) -> tuple:
        if hasattr(group, "get_group") and getattr(group, "ndim", None) == 2:  # a 2-D mesh
            return None, group.get_group(0), group.get_group(1)
        if isinstance(group, (tuple, list)) and len(group) == 2:
            return None, *group
        raise ValueError(
            f"{what}: strategy {self.name!r} needs group = a 2-D DeviceMesh "
            f"(ring, ulysses) or a pair (ring_group, ulysses_group), got {group!r}"
        )

    def mesh_dims(self, what: str, cp_size: int, sizes: dict) -> tuple[tuple, tuple]:
        u = sizes.get("ulysses_size")
        if isinstance(u, bool) or not isinstance(u, int) or u < 1 or cp_size % u or (
                set(sizes) - {"ulysses_size"}):
            raise ValueError(f"{what}: strategy {self.name!r} needs ulysses_size, a positive int "
                             f"dividing cp_size {cp_size}, got {u!r}")
        return (cp_size // u, u), ("ring", "ulysses")

    def sequence_groups(self, cp) -> tuple:
        return (cp.ulysses_group, cp.ring_group)

    def rank_and_world(self, cp) -> tuple[int, int]:
        _, r_rank, r_world = group_info(cp.ring_group)
        _, u_rank, u_world = group_info(cp.ulysses_group)
        return r_rank * u_world + u_rank, r_world * u_world

    def granularity(self, cp) -> int:
        return (granularity(cp.layout, dist.get_world_size(cp.ring_group))
                * dist.get_world_size(cp.ulysses_group))

    def positions(self, cp, seqlen: int, device) -> torch.Tensor:
        return hybrid_positions(seqlen, ulysses_group=cp.ulysses_group,
                                ring_group=cp.ring_group, layout=cp.layout, device=device)

    def document_positions(self, cp, documents) -> tuple[torch.Tensor, torch.Tensor]:
        return documents.local_positions(
            cp.layout, dist.get_world_size(cp.ring_group), dist.get_rank(cp.ring_group),
            dist.get_world_size(cp.ulysses_group), dist.get_rank(cp.ulysses_group))

    def shard_key(self, cp) -> tuple:
        return (cp.layout, dist.get_world_size(cp.ring_group),
                dist.get_world_size(cp.ulysses_group))

    def rank_positions(self, key: tuple, seqlen: int, rank: int) -> torch.Tensor:
        layout, r_world, u_world = key
        r_rank, u_rank = divmod(rank, u_world)  # (ContextParallel.rank: ring rank * U + u)
        return hybrid_shard_positions(seqlen, layout, r_world, u_world, r_rank, u_rank)

    def rank_document_positions(self, key: tuple, documents, rank: int) -> torch.Tensor:
        layout, r_world, u_world = key
        r_rank, u_rank = divmod(rank, u_world)
        return documents.local_positions(layout, r_world, r_rank, u_world, u_rank)[0]

    def unshard_documents(self, cp, x_local, documents, dim: int, what: str) -> torch.Tensor:
        raise ValueError(f"{what}: packed documents under hybrid: gather "
                         "document_positions' tokens yourself")


def _attend(cp, q, k, v, **call):
    return hybrid_attention(q, k, v, ulysses_group=cp.ulysses_group, ring_group=cp.ring_group,
                            layout=cp.layout, **call)


def _attend_varlen(cp, q, k, v, cu_seqlens, **call):
    return hybrid_attention_varlen(q, k, v, cu_seqlens, ulysses_group=cp.ulysses_group,
                                   ring_group=cp.ring_group, layout=cp.layout, **call)


HYBRID = HybridStrategy("hybrid", _attend, _attend_varlen, splits_heads=True)
