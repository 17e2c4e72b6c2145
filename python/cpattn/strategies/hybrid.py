"""The hybrid: Ulysses inside a group of U ranks, the ring across R such groups (W = U * R).

The Ulysses all-to-all gives each rank its ring shard for H / U heads; the ring (or ring varlen)
runs across the ring group on those heads; the all-to-all brings the output back. Sharding:
cpattn.hybrid_positions (sequences), ContextParallel.document_positions (packed documents).
"""

import functools
from typing import Optional, Union

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn._layout import padded_length, round_up
from cpattn._validation import check_timeout, document_lengths, error
from cpattn.max_logits import returned
from cpattn.sharding import hybrid_ring_shard
from cpattn.strategies.ring import ring_attention, ring_attention_varlen
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
    sub-chunk of ring shard i. H % U == 0. Either group may have size 1.
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
    ring = functools.partial(ring_attention, group=ring_group, layout=layout, timeout=timeout)
    r_world, u_world = dist.get_world_size(ring_group), dist.get_world_size(ulysses_group)

    maxima = []  # the ring's max logits of this rank's heads (over the whole sequence)

    def attend(qh, kh, vh, n, mine):  # this rank's ring shard, padded for the ring only
        out, lse, *best = ring(qh, kh, vh, seqlen=n, return_lse=True,
                               return_max_logits=return_max_logits, **mine.as_keywords())
        maxima.extend(best)
        return out, lse

    result = across_heads(what, q, k, v, ulysses_group, timeout, attend, return_lse, options,
                          layout=layout, seqlen=seqlen,
                          rows=lambda n: hybrid_ring_shard(n, layout, r_world, u_world)[::-1],
                          fields_of=max_logits_field(what, return_max_logits))
    out, lse = result if return_lse else (result, None)
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

    def attend(qh, kh, vh, n, mine):  # qh: this rank's ring shard
        keywords = mine.as_keywords()
        del keywords["prefix_len"]  # (0: fixed above)
        out, lse, *best = ring_attention_varlen(
            qh[0], kh[0], vh[0], cu_seqlens, group=ring_group, layout=layout, timeout=timeout,
            return_lse=True, return_max_logits=return_max_logits, **keywords)
        maxima.extend(best)
        return out[None], lse[None]

    result = across_heads(what, q[None], k[None], v[None], ulysses_group, timeout, attend,
                          return_lse, options, seqlen=1, layout=layout, fields_of=fields_of,
                          rows=rows, fixed={"prefix_len": 0})
    out, lse = result if return_lse else (result, None)
    return _with_heads_maxima(out[0], None if lse is None else lse[0], maxima, ulysses_group)
