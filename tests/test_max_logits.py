"""return_max_logits=True: each head's largest logit softmax_scale * q_i . k_j over the visible
pairs of the whole sequence, the same on every rank, for ring (every layout) and all-gather,
Ulysses, packed documents (ring and Ulysses) and any length, against the float64 value from the
full tensors; hybrid (2 x 2) too; the outputs are unchanged by the option; ranks that disagree
on it raise on every rank."""

import pytest
import torch
import torch.distributed as dist

import cpattn
import cpattn.sharding.packing
from cpattn.core.layout import LAYOUTS
from cpattn.testing.reference import visible_mask

from distributed import run_ranks

MASKS = [(True, (-1, -1), 0), (True, (5, 0), 0), (False, (3, 2), 0), (True, (-1, -1), 7)]


def _reference(q, k, causal, window, prefix, scale, lengths=None) -> torch.Tensor:
    """(H,) float64: the max over the visible pairs (per document with `lengths`)."""
    q, k = q.double(), k.double()
    group = q.shape[-2] // k.shape[-2]
    k = k.repeat_interleave(group, dim=-2)
    spans = [(0, q.shape[1])] if lengths is None else []
    start = 0
    for n in lengths or []:
        spans.append((start, start + n))
        start += n
    best = torch.full((q.shape[-2],), float("-inf"), dtype=torch.float64)
    for a, b in spans:
        if b == a:
            continue
        s = torch.einsum("bihd,bjhd->bhij", q[:, a:b], k[:, a:b]) * scale
        seen = visible_mask(b - a, b - a, causal, window, 0, 0, prefix)
        s = s.masked_fill(~seen, float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


def _same_everywhere(t: torch.Tensor) -> None:
    others = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(others, t)
    assert all(torch.equal(o, t) for o in others), "max logits differ between ranks"


def _check(what, got, ref):
    assert got.dtype == torch.float32 and got.shape == ref.shape, what
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5), f"{what}: {got} vs {ref}"
    _same_everywhere(got)


def _cases(rank, world):
    g = torch.Generator().manual_seed(7)
    seqlen = 8 * world
    q = torch.randn(2, seqlen, 2 * world, 16, generator=g) * 2
    k = torch.randn(2, seqlen, world, 16, generator=g) * 2
    v = torch.randn(2, seqlen, world, 16, generator=g)
    scale = 0.3
    for n, (causal, window, prefix) in enumerate(MASKS):
        ref = _reference(q, k, causal, window, prefix, scale)
        opts = dict(causal=causal, window=window, softmax_scale=scale, prefix_len=prefix)
        for layout in LAYOUTS:
            for strategy in ("ring", "allgather"):
                shards = [cpattn.shard(t, layout=layout) for t in (q, k, v)]
                out, lse, best = cpattn.ring_attention(*shards, layout=layout, strategy=strategy,
                                                       return_lse=True, return_max_logits=True,
                                                       **opts)
                plain, plain_lse = cpattn.ring_attention(*shards, layout=layout,
                                                         strategy=strategy, return_lse=True,
                                                         **opts)
                assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
                _check(f"{strategy} {layout} case {n}", best, ref)
        shards = [cpattn.shard(t, layout="contiguous") for t in (q, k, v)]
        out, best = cpattn.ulysses_attention(*shards, return_max_logits=True, **opts)
        _check(f"ulysses case {n}", best, ref)
    # Any length: padding keys and rows take no part.
    short = seqlen - 1
    ref = _reference(q[:, :short], k[:, :short], True, (-1, -1), 0, scale)
    shards = [cpattn.shard(t[:, :short], layout="zigzag") for t in (q, k, v)]
    _, best = cpattn.ring_attention(*shards, causal=True, softmax_scale=scale, seqlen=short,
                                    return_max_logits=True)
    _check("ring any length", best, ref)
    # Packed documents: no pair across documents counts.
    lengths = [3, 0, 4 * world + 1, world]
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    qp, kp, vp = (t[0, :cu[-1]] for t in (q, k, v))
    for causal, window, _ in MASKS[:3]:
        ref = _reference(qp[None], kp[None], causal, window, 0, scale, lengths)
        shards = [cpattn.shard_varlen(t, cu) for t in (qp, kp, vp)]
        _, best = cpattn.ring_attention_varlen(*shards, cu, causal=causal, window=window,
                                               softmax_scale=scale, return_max_logits=True)
        _check(f"ring varlen {causal} {window}", best, ref)
        shards = [cpattn.shard_varlen(t, cu, layout="contiguous") for t in (qp, kp, vp)]
        _, best = cpattn.ulysses_attention_varlen(*shards, cu, causal=causal, window=window,
                                                  softmax_scale=scale, return_max_logits=True)
        _check(f"ulysses varlen {causal} {window}", best, ref)
        # Through ContextParallel (its packed path keeps the batch dim of one row).
        cp = cpattn.ContextParallel()
        docs = cpattn.sharding.packing.Documents(tuple(lengths), (0,) * len(lengths))
        shards = [cpattn.shard_varlen(t, cu)[None] for t in (qp, kp, vp)]
        out, lse, best = cp.attention(*shards, causal=causal, window=window, softmax_scale=scale,
                                      return_lse=True, return_max_logits=True, documents=docs)
        assert out.shape[0] == 1 and lse.shape[0] == 1
        _check(f"ContextParallel varlen {causal} {window}", best, ref)
    # The packed documents' max differs from the whole sequence's: the test can fail.
    assert not torch.allclose(_reference(qp[None], kp[None], False, (-1, -1), 0, scale),
                              _reference(qp[None], kp[None], False, (-1, -1), 0, scale, lengths))
    # Ranks that disagree on the option raise on every rank (before any message).
    shards = [cpattn.shard(t) for t in (q, k, v)]
    with pytest.raises(ValueError, match="return_max_logits"):
        cpattn.ring_attention(*shards, causal=True, return_max_logits=rank == 0)


@pytest.mark.parametrize("world", [2, 3])
def test_max_logits_match_reference(world):
    run_ranks(world, _cases)


def _hybrid_cases(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    cp = cpattn.ContextParallel(init_device_mesh("cpu", (2, 2)), strategy="hybrid")
    groups = dict(ulysses_group=cp.ulysses_group, ring_group=cp.ring_group)
    g = torch.Generator().manual_seed(9)
    seqlen, scale = 26, 0.3  # not a multiple of 2R U = 8: padding on both levels
    q = torch.randn(1, seqlen, 4, 16, generator=g) * 2
    k = torch.randn(1, seqlen, 2, 16, generator=g) * 2
    for causal, window, prefix in MASKS:
        ref = _reference(q, k, causal, window, prefix, scale)
        shards = [cpattn.hybrid_shard(t, **groups) for t in (q, k, k)]
        out, best = cpattn.hybrid_attention(*shards, **groups, causal=causal, window=window,
                                            softmax_scale=scale, prefix_len=prefix,
                                            seqlen=seqlen, return_max_logits=True)
        plain = cpattn.hybrid_attention(*shards, **groups, causal=causal, window=window,
                                        softmax_scale=scale, prefix_len=prefix, seqlen=seqlen)
        assert torch.equal(out, plain)
        _check(f"hybrid {causal} {window} {prefix}", best, ref)
    lengths = [3, 0, 9, 5]
    cu = torch.tensor([0, *lengths]).cumsum(0).tolist()
    qp, kp = q[0, :cu[-1]], k[0, :cu[-1]]
    docs = cpattn.sharding.packing.Documents(tuple(lengths), (0,) * len(lengths))
    index, _ = cp.document_positions(docs)
    local = lambda t: torch.cat([t, t.new_zeros((1, *t.shape[1:]))])[  # noqa: E731
        torch.where(index < 0, t.shape[0], index)]
    for causal, window, _ in MASKS[:3]:
        ref = _reference(qp[None], kp[None], causal, window, 0, scale, lengths)
        _, best = cpattn.hybrid_attention_varlen(local(qp), local(kp), local(kp), cu, **groups,
                                                 causal=causal, window=window,
                                                 softmax_scale=scale, return_max_logits=True)
        _check(f"hybrid varlen {causal} {window}", best, ref)


def test_max_logits_hybrid():
    run_ranks(4, _hybrid_cases)
