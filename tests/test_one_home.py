"""Rules that live once, in C++, reached from Python through ops (issue 48): the per-document
padded sharding (layout.h document_shard), the visible-key count and the max-logits pass's visible
key ranges (mask.h), the op layer's limits;
and the ring's argument checks, run once per call rather than once per sub-problem; packed
documents' lengths and prefixes as two op arguments."""

import random

import pytest
import torch

from cpattn.core.layout import LAYOUTS, document_positions, document_shards
from cpattn.core.options import AttentionOptions
from cpattn.core.validation import MAX_HEAD_DIM, MAX_POSITION
from cpattn.max_logits import key_ranges, seen_pairs
from cpattn.sharding.documents import visible_pairs
from cpattn.testing.emulation import load_ops


def _padded_sharding_formula(lengths, layout: str, world: int) -> list:
    """The formula Python used to repeat: each document rounded up to the granularity (2W for
    zigzag, else W), its start the sum of the padded lengths before it, its shard's start that
    divided by W."""
    g = 2 * world if layout == "zigzag" else world
    rows, begin = [], 0
    for n in lengths:
        padded = -(-n // g) * g
        rows.append((padded, begin, begin // world))
        begin += padded
    return rows


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_document_shards_agree_with_the_formula(layout, world):
    rng = random.Random(world * 10 + LAYOUTS[layout])
    for _ in range(20):
        lengths = [rng.choice([0, 1, rng.randrange(1, 40), rng.randrange(1, 3000)])
                   for _ in range(rng.randrange(0, 9))]
        assert list(document_shards(lengths, LAYOUTS[layout], world)) == \
            _padded_sharding_formula(lengths, layout, world)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_document_positions_cover_each_document_once(layout):
    lengths = torch.tensor([5, 0, 13, 1, 24])
    world = 3
    index = torch.cat([document_positions(lengths, layout, world, r)[0] for r in range(world)])
    assert sorted(index[index >= 0].tolist()) == list(range(int(lengths.sum())))
    padded = sum(p for p, _, _ in document_shards(lengths.tolist(), LAYOUTS[layout], world))
    assert index.numel() == padded


def test_document_shards_refuse_bad_arguments():
    with pytest.raises(RuntimeError, match="document lengths must be >= 0"):
        document_shards([3, -1], LAYOUTS["zigzag"], 2)
    with pytest.raises(RuntimeError, match="layout code"):
        document_shards([3], 7, 2)


def _visible_count_formula(positions, length, causal, window, prefix):
    """The count documents.py used to derive itself: per query, its interval clipped to the
    document, and the prefix keys outside it."""
    i = positions.to(torch.int64)
    left, right = window
    lo = (i - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = torch.full_like(i, length - 1)
    if causal:
        hi = torch.minimum(hi, i)
    if right >= 0:
        hi = torch.minimum(hi, i + right)
    count = (hi - lo + 1).clamp(min=0)
    p = min(prefix, length)
    if p > 0:
        count = count + p - (torch.minimum(hi, torch.full_like(i, p - 1)) - lo + 1).clamp(min=0)
    return count


def test_visible_keys_agree_with_the_formula_and_the_mask():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randrange(1, 60)
        causal = rng.random() < 0.5
        window = tuple(rng.choice([-1, 0, rng.randrange(0, 70)]) for _ in range(2))
        prefix = rng.choice([0, rng.randrange(0, 70)])
        pos = torch.randperm(n)[:rng.randrange(1, n + 1)]
        got = visible_pairs(pos, n, causal, window, prefix)
        assert torch.equal(got, _visible_count_formula(pos, n, causal, window, prefix))
        # and by brute force over the pairs (docs/design.md's rule)
        i, j = pos[:, None], torch.arange(n)[None, :]
        seen = torch.ones(i.shape[0], n, dtype=torch.bool)
        if causal:
            seen &= j <= i
        if window[0] >= 0:
            seen &= j >= i - window[0]
        if window[1] >= 0:
            seen &= j <= i + window[1]
        assert torch.equal(got, (seen | (j < prefix)).sum(1))


def _rule_mask(q_pos, k_pos, causal, window, prefix):
    """docs/design.md's rule, written here on its own (a test oracle shares no code with what it
    checks): causal j <= i, window i - left <= j <= i + right (-1: that side unbounded), keys
    j < prefix seen by every query; padding (position -1) sees and is seen by nothing."""
    i, j = q_pos[:, None], k_pos[None, :]
    seen = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
    if causal:
        seen &= j <= i
    left, right = window
    if left >= 0:
        seen &= j >= i - left
    if right >= 0:
        seen &= j <= i + right
    seen |= j < prefix
    return seen & (i >= 0) & (j >= 0)


def _with_padding(positions, rng):
    """positions with some -1 (padding) slots put in at random places."""
    pos = positions.tolist()
    for _ in range(rng.randrange(0, 4)):
        pos.insert(rng.randrange(0, len(pos) + 1), -1)
    return torch.tensor(pos, dtype=torch.int64)


@pytest.mark.parametrize("prefix", [0, 5])
@pytest.mark.parametrize("window", [(-1, -1), (3, -1), (-1, 2), (0, 0), (4, 1), (0, -1),
                                    (MAX_POSITION, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_visible_key_ranges_agree_with_the_rule(causal, window, prefix):
    # the max-logits pass's mask: the op's ranges expanded on the keys (seen_pairs) are the rule
    rng = random.Random(f"{causal} {window} {prefix}")
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    options = AttentionOptions(softmax_scale=1.0, causal=causal, window=window, prefix_len=prefix)
    for _ in range(20):
        n = rng.randrange(1, 50)
        keys = _with_padding(torch.arange(n), rng)
        queries = _with_padding(torch.randperm(n, generator=g)[:rng.randrange(0, n + 1)], rng)
        ranges = key_ranges(queries, options)
        assert ranges.shape == (queries.numel(), 3) and ranges.dtype == torch.int64
        same_doc = torch.zeros_like
        got = seen_pairs(ranges, same_doc(queries), keys, same_doc(keys))
        assert torch.equal(got, _rule_mask(queries, keys, causal, window, prefix))
        # documents: a key is seen only within its query's document
        q_doc = torch.randint(0, 2, queries.shape, generator=g)
        k_doc = torch.randint(0, 2, keys.shape, generator=g)
        got = seen_pairs(ranges, q_doc, keys, k_doc)
        want = _rule_mask(queries, keys, causal, window, prefix) & (q_doc[:, None] == k_doc)
        assert torch.equal(got, want)


def test_visible_key_ranges_of_padding_see_nothing():
    ranges = torch.ops.cpattn.visible_key_ranges(torch.tensor([-1, 3]), False, -1, -1, 4)
    first, last, prefix_end = ranges[0].tolist()
    assert first > last and prefix_end <= -MAX_POSITION  # no position at all, even -1
    assert ranges[1].tolist() == [-MAX_POSITION, MAX_POSITION, 4]  # unbounded ends


def test_visible_key_ranges_refuse_bad_arguments():
    op = torch.ops.cpattn.visible_key_ranges
    pos = torch.arange(4)
    with pytest.raises(RuntimeError, match="positions must be a 1-D int64 CPU tensor"):
        op(pos[None], True, -1, -1, 0)
    with pytest.raises(RuntimeError, match="positions must be a 1-D int64 CPU tensor"):
        op(pos.float(), True, -1, -1, 0)
    with pytest.raises(RuntimeError, match=r"window sides must be >= -1 \(-1: unbounded\), "
                       r"got \(-2, 0\)"):
        op(pos, True, -2, 0, 0)
    with pytest.raises(RuntimeError, match=r"visible_key_ranges: prefix_len must be >= 0 "
                       r"\(0: none\), got -1"):
        op(pos, True, -1, -1, -1)
    with pytest.raises(RuntimeError, match="positions must be -1 \\(padding\\) or in \\[0, .*"
                       "got -2 at index 1"):
        op(torch.tensor([0, -2]), True, -1, -1, 0)
    with pytest.raises(RuntimeError, match="positions must be -1"):
        op(torch.tensor([MAX_POSITION + 1]), True, -1, -1, 0)


def test_limits_come_from_the_op_layer():
    assert MAX_HEAD_DIM == 256
    assert MAX_POSITION == 2**61 - 1
    q = torch.randn(1, 4, 2, MAX_HEAD_DIM + 1)
    with pytest.raises(RuntimeError, match=f"supported: 1 to {MAX_HEAD_DIM}"):
        torch.ops.cpattn.attention_fwd(q, q, q, softmax_scale=0.1)


def _checks_run() -> int:
    load_ops()
    return torch.ops.cpattn_testing.attention_checks_run()


def test_local_attention_checks_its_arguments():
    q = torch.randn(1, 8, 2, 16)
    before = _checks_run()
    torch.ops.cpattn.attention_fwd(q, q, q, softmax_scale=0.25)
    assert _checks_run() == before + 1


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ring_sub_problems_are_not_checked_again(layout):
    # W = 3 zigzag: every rank runs several kernel calls per step, forward and backward; the
    # ring checked its call once (check_ring_args, check_kernel_args), so the per-call checks of
    # local attention (check_attention_args) never run
    world = 3
    g = torch.Generator().manual_seed(1)
    shards = [[torch.randn(1, 12, 4, 16, generator=g) for _ in range(world)] for _ in range(3)]
    q, k, v = shards
    opts = dict(softmax_scale=0.25, causal=True, window_left=-1, window_right=-1)
    load_ops()
    before = _checks_run()
    outs, lses = torch.ops.cpattn_testing.ring_fwd_emulated(q, k, v, LAYOUTS[layout], **opts)
    dout = [torch.randn_like(o) for o in outs]
    torch.ops.cpattn_testing.ring_bwd_emulated(dout, q, k, v, outs, lses, LAYOUTS[layout], **opts)
    k_all, v_all = torch.stack(k), torch.stack(v)
    for r in range(world):
        out, lse = torch.ops.cpattn.gathered_fwd(q[r], k_all, v_all, r, LAYOUTS[layout], **opts)
        torch.ops.cpattn.gathered_bwd(dout[r], q[r], k_all, v_all, out, lse, r, LAYOUTS[layout],
                                      **opts)
    assert _checks_run() == before
    # and still checked once at the entry: a bad call raises before any kernel
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.cpattn.gathered_fwd(q[0], k_all.bfloat16(), v_all.bfloat16(), 0, LAYOUTS[layout],
                                      **opts)


def test_documents_and_their_prefixes_are_two_op_arguments():
    # the ops take the documents' lengths (doc_lengths) and their prefixes (doc_prefix_lens) as
    # two (D,) arguments: each document attends as a sequence of its own with its prefix
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 12, 2, 16, generator=g) for _ in range(3))
    docs, prefixes = torch.tensor([5, 7]), torch.tensor([2, 0])
    opts = dict(softmax_scale=0.25, causal=True)
    out, lse = torch.ops.cpattn.attention_varlen_fwd(q, k, v, docs, prefixes, **opts)
    for a, b, p in ((0, 5, 2), (5, 12, 0)):
        want, want_lse = torch.ops.cpattn.attention_fwd(q[:, a:b], k[:, a:b], v[:, a:b],
                                                        prefix_len=p, **opts)
        torch.testing.assert_close(out[:, a:b], want)
        torch.testing.assert_close(lse[..., a:b], want_lse)
    with pytest.raises(RuntimeError, match="doc_prefix_lens must be a \\(D,\\) int64 tensor, one "
                       "prefix per document of doc_lengths \\(2\\)"):
        torch.ops.cpattn.attention_varlen_fwd(q, k, v, docs, torch.tensor([1]), **opts)
    with pytest.raises(RuntimeError, match="give prefix_len or a prefix per document, not both"):
        torch.ops.cpattn.attention_varlen_fwd(q, k, v, docs, prefixes, prefix_len=1, **opts)
    with pytest.raises(RuntimeError, match="document prefix lengths must be >= 0"):
        torch.ops.cpattn.attention_varlen_fwd(q, k, v, docs, torch.tensor([-1, 0]), **opts)


def test_invariant_tiles_are_not_checked_again():
    # invariant mode calls a kernel per tile of invariant_tile() keys (forward) and per document
    # (backward); each op checks its call once at its entry (invariant.cpp check_tile_args), so
    # the per-call checks of local attention (check_attention_args) run once per op call: here
    # one forward and one backward, whatever the number of tiles and documents
    import cpattn

    tile = torch.ops.cpattn.invariant_tile()
    g = torch.Generator().manual_seed(4)
    n = 3 * tile + 5  # four tiles of keys
    q, k, v = (torch.randn(1, n, 2, 16, generator=g, requires_grad=True) for _ in range(3))
    load_ops()
    before = _checks_run()
    out = cpattn.attention(q, k, v, causal=True, softmax_scale=0.25, invariant=True)
    assert _checks_run() == before + 1
    out.sum().backward()
    assert _checks_run() == before + 2
    cu_seqlens = torch.tensor([0, tile + 3, 2 * tile, n], dtype=torch.int32)  # three documents
    before = _checks_run()
    out = cpattn.attention_varlen(q[0], k[0], v[0], cu_seqlens, causal=True, softmax_scale=0.25,
                                  invariant=True)
    out.sum().backward()
    assert _checks_run() == before + 2
