"""invariant=True: out, lse and every gradient (the sinks' summed over the ranks) are bitwise equal
(torch.equal, not a tolerance) to cpattn.attention(invariant=True) on the whole sequence, for
W = 1-4, the contiguous and zigzag layouts, the ring / all-gather / auto strategies, every score
option, GQA, fp32 and bf16, any length; the same results are checked against the float64
reference; a negative control shows the default mode differs with W (so the test can fail);
what invariant=True does not cover raises on every rank."""

import functools

import pytest
import torch
import torch.distributed as dist

import cpattn

from distributed import run_ranks
from reference import compare_sharded

# name -> (causal, window, options); sinks / alibi_slopes: True = per-head values drawn below.
CASES = {
    "causal": (True, (-1, -1), {}),
    "full": (False, (-1, -1), {}),
    "window": (True, (40, 0), {}),
    "sinks_window_both": (False, (30, 20), {"sinks": True}),
    "softcap": (True, (-1, -1), {"softcap": 4.0}),
    "alibi": (False, (-1, -1), {"alibi_slopes": True}),
    "prefix": (True, (-1, -1), {"prefix_len": 70}),
    "all": (True, (90, -1), {"sinks": True, "softcap": 3.0, "alibi_slopes": True,
                             "prefix_len": 11}),
}


def _draw(options: dict, heads: int) -> dict:
    kwargs = dict(options)
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(heads) * 2
    if options.get("alibi_slopes"):
        kwargs["alibi_slopes"] = torch.rand(heads) * 0.2 + 0.01
    return kwargs


def _inputs(seed: int, seqlen: int, dtype, heads=(4, 2), dim=32, batch=2):
    """The full (q, k, v, dout), the same on every rank: fresh random values, never zeros."""
    torch.manual_seed(seed)
    h, hkv = heads
    return tuple(torch.randn(batch, seqlen, n, dim).to(dtype) for n in (h, hkv, hkv, h))


def _one_process(full, causal, window, kwargs):
    """cpattn.attention(invariant=True) on the whole sequence: out, lse, dq, dk, dv, dsinks."""
    q, k, v = (t.clone().requires_grad_() for t in full[:3])
    dout = full[3]
    kw = dict(kwargs)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    out, lse = cpattn.attention(q, k, v, causal=causal, window=window, return_lse=True,
                                invariant=True, **kw)
    (out * dout).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad, \
        kw["sinks"].grad if "sinks" in kw else None


def _sharded(full, causal, window, kwargs, layout, strategy, seqlen=None, **extra):
    """ring_attention(invariant=True) on this rank's shards; the results unsharded (the sinks'
    gradient summed over the ranks, as a trainer's gradient all-reduce does)."""
    shard = functools.partial(cpattn.shard, layout=layout)
    unshard = functools.partial(cpattn.unshard, layout=layout, seqlen=seqlen)
    q, k, v = (shard(t).requires_grad_() for t in full[:3])
    kw = dict(kwargs)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    out, lse = cpattn.ring_attention(q, k, v, layout=layout, strategy=strategy, causal=causal,
                                     window=window, return_lse=True, seqlen=seqlen, **kw, **extra)
    (out * shard(full[3])).sum().backward()
    dsinks = None
    if "sinks" in kw:
        dsinks = kw["sinks"].grad.clone()
        dist.all_reduce(dsinks)
    return (unshard(out.detach()), unshard(lse.detach(), dim=2), unshard(q.grad),
            unshard(k.grad), unshard(v.grad), dsinks)


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def _assert_bitwise(what, got, want):
    for name, g, w in zip(NAMES, got, want):
        if w is None:
            assert g is None, f"{name} {what}"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, f"{name} {what}"
        if not torch.equal(g, w):
            diff = (g.double() - w.double()).abs().nan_to_num(posinf=1e30).max().item()
            raise AssertionError(f"{name} {what}: not bitwise equal to one process "
                                 f"(largest difference {diff:.3g})")


def _check(rank: int, world: int, layouts, strategies, names, dtypes, seqlen=600,
           extra=None) -> None:
    for n, name in enumerate(names):
        causal, window, options = CASES[name]
        for dtype in dtypes:
            full = _inputs(n, seqlen, dtype)
            kwargs = _draw(options, full[0].shape[2])
            want = _one_process(full, causal, window, kwargs)
            for layout in layouts:
                for strategy in strategies:
                    got = _sharded(full, causal, window, kwargs, layout, strategy,
                                   seqlen=seqlen, invariant=True, **(extra or {}))
                    _assert_bitwise(f"W={world} {layout} {strategy} {name} {dtype}", got, want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_bitwise_equal_to_one_process(world: int) -> None:
    """Every option case, both layouts, the ring and all-gather strategies, fp32; S = 600 spans
    several key blocks (sequences of several backward chunks: test_bitwise_several_key_tiles,
    test_bitwise_blocks_computed_once); B = 2, GQA 4 / 2."""
    run_ranks(world, _check, ("contiguous", "zigzag"), ("ring", "allgather"), tuple(CASES),
              (torch.float32,))


@pytest.mark.parametrize("world", [2, 4])
def test_bitwise_bf16_auto_and_head_groups(world: int) -> None:
    """bf16; strategy auto; head groups of one KV head (allgather_chunk=1)."""
    run_ranks(world, _check, ("zigzag",), ("auto",), ("causal", "all"), (torch.bfloat16,))
    run_ranks(world, _check, ("contiguous",), ("allgather",), ("all",), (torch.float32,), 600,
              {"allgather_chunk": 1})


@pytest.mark.parametrize("world", [3, 4])
def test_bitwise_any_length(world: int) -> None:
    """A length no layout granularity divides: the shards are padded, the results are not."""
    run_ranks(world, _check, ("contiguous", "zigzag"), ("ring",), ("causal", "sinks_window_both"),
              (torch.float32,), 301)


def test_bitwise_several_key_tiles() -> None:
    """A sequence of several key tiles (the forward's tile tree; a window skips some), W = 3."""
    n = 2 * torch.ops.cpattn.invariant_tile() + 300
    run_ranks(3, _check, ("zigzag", "contiguous"), ("ring",), ("window", "all"), (torch.float32,),
              n)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_bitwise_striped(world: int) -> None:
    """The striped layout (moved to the contiguous one and back: an exact permutation), also
    at a length no granularity divides, and with packed documents."""
    run_ranks(world, _check, ("striped",), ("ring", "allgather"), ("causal", "all"),
              (torch.float32,))
    run_ranks(world, _check, ("striped",), ("ring",), ("sinks_window_both",), (torch.bfloat16,),
              301)
    if world == 3:
        run_ranks(world, _check_varlen, ("striped",), ("causal", "prefix"), torch.float32)


@pytest.mark.slow  # a sweep: W = 8 oversubscribes the 2 cores of CI (W = 2-4 run in the main step)
def test_bitwise_eight_ranks() -> None:
    """W = 8 (real gloo ranks on a small sequence): every layout, a length 16 does not divide,
    packed documents, bf16."""
    run_ranks(8, _check, ("contiguous", "zigzag", "striped"), ("ring",), ("causal", "all"),
              (torch.float32,), 200)
    run_ranks(8, _check, ("zigzag",), ("allgather",), ("sinks_window_both",), (torch.bfloat16,),
              200)
    run_ranks(8, _check_varlen, ("zigzag",), ("all",), torch.float32)


def _check_ulysses(rank: int, world: int, names, dtype, seqlen) -> None:
    """ulysses_attention(invariant=True): every rank computes its heads over the whole sequence;
    KV heads 2 W / 2, so that every rank holds whole GQA groups."""
    for n, name in enumerate(names):
        causal, window, options = CASES[name]
        full = _inputs(20 + n, seqlen, dtype, heads=(4 * max(world, 1), 2 * max(world, 1)))
        kwargs = _draw(options, full[0].shape[2])
        want = _one_process(full, causal, window, kwargs)
        shard = functools.partial(cpattn.shard, layout="contiguous")
        q, k, v = (shard(t).requires_grad_() for t in full[:3])
        kw = dict(kwargs)
        if "sinks" in kw:
            kw["sinks"] = kw["sinks"].clone().requires_grad_()
        out, lse = cpattn.ulysses_attention(q, k, v, causal=causal, window=window,
                                            return_lse=True, seqlen=seqlen, invariant=True, **kw)
        (out * shard(full[3])).sum().backward()
        dsinks = None
        if "sinks" in kw:
            dsinks = kw["sinks"].grad.clone()
            dist.all_reduce(dsinks)
        unshard = functools.partial(cpattn.unshard, layout="contiguous", seqlen=seqlen)
        got = (unshard(out.detach()), unshard(lse.detach(), dim=2), unshard(q.grad),
               unshard(k.grad), unshard(v.grad), dsinks)
        _assert_bitwise(f"ulysses W={world} {name} {dtype}", got, want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ulysses_bitwise_equal_to_one_process(world: int) -> None:
    run_ranks(world, _check_ulysses, ("causal", "sinks_window_both", "all"), torch.float32, 600)


def test_ulysses_bitwise_bf16_any_length() -> None:
    run_ranks(3, _check_ulysses, ("causal", "all"), torch.bfloat16, 301)


def _check_hybrid(rank: int, world: int, u: int, layout: str, seqlen: int) -> None:
    """hybrid_attention(invariant=True): Ulysses over U ranks, the invariant ring across R."""
    r = world // u
    ulysses = [dist.new_group(list(range(i * u, (i + 1) * u))) for i in range(r)]
    rings = [dist.new_group(list(range(j, world, u))) for j in range(u)]
    groups = {"ulysses_group": ulysses[rank // u], "ring_group": rings[rank % u],
              "layout": layout}
    for n, name in enumerate(("causal", "all")):
        causal, window, options = CASES[name]
        full = _inputs(40 + n, seqlen, torch.float32, heads=(8, 4))
        kwargs = _draw(options, full[0].shape[2])
        want = _one_process(full, causal, window, kwargs)
        q, k, v = (cpattn.hybrid_shard(t, **groups).requires_grad_() for t in full[:3])
        kw = dict(kwargs)
        if "sinks" in kw:
            kw["sinks"] = kw["sinks"].clone().requires_grad_()
        out, lse = cpattn.hybrid_attention(q, k, v, causal=causal, window=window,
                                           return_lse=True, seqlen=seqlen, invariant=True,
                                           **groups, **kw)
        (out * cpattn.hybrid_shard(full[3], **groups)).sum().backward()
        dsinks = None
        if "sinks" in kw:
            dsinks = kw["sinks"].grad.clone()
            dist.all_reduce(dsinks)
        unshard = functools.partial(cpattn.hybrid_unshard, seqlen=seqlen, **groups)
        got = (unshard(out.detach()), unshard(lse.detach(), dim=2), unshard(q.grad),
               unshard(k.grad), unshard(v.grad), dsinks)
        _assert_bitwise(f"hybrid W={world} U={u} {layout} {name}", got, want)


@pytest.mark.parametrize("world,u", [(2, 2), (2, 1), (4, 2)])
def test_hybrid_bitwise_equal_to_one_process(world: int, u: int) -> None:
    run_ranks(world, _check_hybrid, u, "zigzag", 600)
    if world == 4:
        run_ranks(world, _check_hybrid, u, "contiguous", 301)
        run_ranks(world, _check_hybrid, u, "striped", 600)


# Packed documents of 137, 3, 260, 1 and 199 tokens (and their prefixes, for the per-document
# prefix case): lengths no granularity divides, a document shorter than a zigzag chunk.
DOCS = (0, 137, 140, 400, 401, 600)
DOC_PREFIXES = (5, 0, 100, 1, 199)


def _varlen_run(full, cu, kwargs, group, layout, strategy="ring"):
    """ring_attention_varlen(invariant=True) on this rank's tokens; the results unsharded (the
    sinks' gradient summed over the group)."""
    shard = functools.partial(cpattn.shard_varlen, cu_seqlens=cu, group=group, layout=layout)
    unshard = functools.partial(cpattn.unshard_varlen, cu_seqlens=cu, group=group, layout=layout)
    q, k, v = (shard(t).requires_grad_() for t in full[:3])
    kw = dict(kwargs)
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].clone().requires_grad_()
    out, lse = cpattn.ring_attention_varlen(q, k, v, cu, group=group, layout=layout,
                                            strategy=strategy, return_lse=True, invariant=True,
                                            **kw)
    (out * shard(full[3])).sum().backward()
    dsinks = None
    if "sinks" in kw:
        dsinks = kw["sinks"].grad.clone()
        dist.all_reduce(dsinks, group=group)
    return (unshard(out.detach()), unshard(lse.detach(), dim=1), unshard(q.grad),
            unshard(k.grad), unshard(v.grad), dsinks)


def _check_varlen(rank: int, world: int, layouts, names, dtype) -> None:
    """Packed documents: ring_attention_varlen(invariant=True) over W ranks equals it over one
    rank (a group of one: the one-process computation), bitwise; and each document's rows
    equal cpattn.attention(invariant=True) on that document alone."""
    singles = [dist.new_group([r]) for r in range(world)]
    for n, name in enumerate(names):
        causal, window, options = CASES[name]
        torch.manual_seed(70 + n)
        full = tuple(torch.randn(DOCS[-1], h, 32).to(dtype) for h in (4, 2, 2, 4))
        kwargs = {**_draw(options, 4), "causal": causal, "window": window}
        if name == "prefix":  # a prefix per document
            kwargs["prefix_len"] = torch.tensor(DOC_PREFIXES)
        want = _varlen_run(full, DOCS, kwargs, singles[rank], "contiguous")
        for d, (a, b) in enumerate(zip(DOCS[:-1], DOCS[1:])):
            kw = dict(kwargs)
            if name == "prefix":
                kw["prefix_len"] = DOC_PREFIXES[d]
            q, k, v = (t[None, a:b].clone().requires_grad_() for t in full[:3])
            out, lse = cpattn.attention(q, k, v, return_lse=True, invariant=True, **kw)
            (out * full[3][None, a:b]).sum().backward()
            alone = (out[0], lse[0], q.grad[0], k.grad[0], v.grad[0])
            for what, g, w in zip(NAMES, [t[:, a:b] if t.dim() == 2 and t.shape[0] == 4
                                          else t[a:b] for t in want[:5]], alone):
                assert torch.equal(g, w), f"{what} of document {d} {name}: packed != alone"
        for layout in layouts:
            for strategy in ("ring", "allgather"):
                got = _varlen_run(full, DOCS, kwargs, dist.group.WORLD, layout, strategy)
                _assert_bitwise(f"varlen W={world} {layout} {strategy} {name} {dtype}", got,
                                want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_varlen_bitwise_equal_to_one_process(world: int) -> None:
    """Packed documents (cu_seqlens), per-document sharding: every option case (prefix: one per
    document), contiguous and zigzag, ring and all-gather, fp32."""
    run_ranks(world, _check_varlen, ("contiguous", "zigzag"), tuple(CASES), torch.float32)


def test_varlen_bitwise_bf16() -> None:
    run_ranks(3, _check_varlen, ("zigzag",), ("causal", "all"), torch.bfloat16)


def _check_prefix_per_sequence(rank: int, world: int) -> None:
    """ring_attention with a prefix per sequence of the batch (prefix_len a tensor): the batch
    runs as packed documents; each sequence's rows equal cpattn.attention(invariant=True) on
    that sequence with its prefix, bitwise, for any W (and any length)."""
    full = _inputs(80, 301, torch.float32)
    prefixes = torch.tensor([40, 301])
    for layout in ("contiguous", "zigzag"):
        got = _sharded(full, True, (20, -1), {"prefix_len": prefixes}, layout, "ring",
                       seqlen=301, invariant=True)
        for b, p in enumerate(prefixes.tolist()):
            want = _one_process(tuple(t[b:b + 1] for t in full), True, (20, -1),
                                {"prefix_len": p})
            for name, g, w in zip(NAMES[:5], got, want):
                assert torch.equal(g[b:b + 1], w), f"{name} of sequence {b} W={world} {layout}"


@pytest.mark.parametrize("world", [2, 3])
def test_prefix_per_sequence_bitwise(world: int) -> None:
    run_ranks(world, _check_prefix_per_sequence)


def _check_reference(rank: int, world: int) -> None:
    """The invariant results are also exact: against float64 (forward, LSE, every gradient)."""
    for n, name in enumerate(("all", "sinks_window_both")):
        causal, window, options = CASES[name]
        for dtype in (torch.float32, torch.bfloat16):
            full = _inputs(50 + n, 96, dtype)
            kwargs = _draw(options, full[0].shape[2])
            layout = "zigzag"
            run = functools.partial(cpattn.ring_attention, layout=layout, invariant=True)
            compare_sharded(f"W={world} {name} {dtype}", run,
                            functools.partial(cpattn.shard, layout=layout),
                            lambda t, dim=1: cpattn.unshard(t, layout=layout, dim=dim),
                            cpattn.positions(96, layout=layout), full, causal, window, kwargs,
                            grad_factor=1.0)


def test_matches_float64_reference() -> None:
    run_ranks(3, _check_reference)


def _default_mode_differs(rank: int, world: int) -> None:
    """Negative control: the same comparison without invariant=True finds a difference."""
    full = _inputs(7, 600, torch.float32)
    want = _one_process(full, True, (-1, -1), {})
    got = _sharded(full, True, (-1, -1), {}, "zigzag", "ring")
    assert any(not torch.equal(g, w) for g, w in zip(got[:5], want[:5])), \
        "the default mode gave W-invariant bits: this test's comparison could not fail"
    try:
        _assert_bitwise("default mode", got, want)
    except AssertionError:
        return
    raise AssertionError("_assert_bitwise passed on different results")


def test_negative_control_default_mode_differs() -> None:
    run_ranks(2, _default_mode_differs)


def _environment(rank: int, world: int) -> None:
    """$CPATTN_INVARIANT=1 is invariant=True; functions without the mode raise, on every rank."""
    import os

    full = _inputs(3, 64, torch.float32)
    want = _sharded(full, True, (-1, -1), {}, "zigzag", "ring", invariant=True)
    os.environ["CPATTN_INVARIANT"] = "1"
    try:
        got = _sharded(full, True, (-1, -1), {}, "zigzag", "ring")
        _assert_bitwise("$CPATTN_INVARIANT=1", got, want)
        q = cpattn.shard(full[0], layout="zigzag")
        with pytest.raises(ValueError, match=r"ulysses_attention_varlen: \$CPATTN_INVARIANT=True: "
                                             r"is not supported here yet"):
            cpattn.ulysses_attention_varlen(q[0], q[0], q[0], [0, 64])
        os.environ["CPATTN_INVARIANT"] = "yes"
        with pytest.raises(ValueError, match=r"\$CPATTN_INVARIANT='yes': must be \"1\""):
            cpattn.ring_attention(q, q, q)
    finally:
        del os.environ["CPATTN_INVARIANT"]


def test_environment_variable() -> None:
    run_ranks(2, _environment)


def _context_parallel(rank: int, world: int) -> None:
    """ContextParallel(invariant=True): every call of its attention is; options an integration
    builds (AttentionOptions.as_keywords) never turn $CPATTN_INVARIANT off."""
    import os

    from cpattn.core.options import AttentionOptions

    full = _inputs(4, 64, torch.float32)
    want = _sharded(full, True, (-1, -1), {}, "zigzag", "ring", invariant=True)[0]
    cp = cpattn.ContextParallel(strategy="allgather", layout="zigzag", invariant=True)
    q, k, v = (cpattn.shard(t, layout="zigzag") for t in full[:3])
    assert torch.equal(cpattn.unshard(cp.attention(q, k, v, causal=True), layout="zigzag"), want)
    keywords = AttentionOptions.checked("cpattn.attention", 32, causal=True).as_keywords()
    os.environ["CPATTN_INVARIANT"] = "1"
    try:
        out = cpattn.ContextParallel(strategy="ring").attention(q, k, v, **keywords)
    finally:
        del os.environ["CPATTN_INVARIANT"]
    assert torch.equal(cpattn.unshard(out, layout="zigzag"), want)


def test_context_parallel_and_integrations() -> None:
    run_ranks(2, _context_parallel)


def _refusals(rank: int, world: int) -> None:
    q = torch.randn(1, 8, 2, 16)
    singles = [dist.new_group([r]) for r in range(world)]  # hybrid: Ulysses over all, no ring
    for call, match in [
        (lambda: cpattn.ulysses_attention(q[:, :, :1], q[:, :, :1], q[:, :, :1], invariant=True),
         "heads=1: must be divisible"),
        (lambda: cpattn.ulysses_attention(q, q[:, :, :1], q[:, :, :1], invariant=True),
         r"kv_heads=1: must be divisible by the Ulysses group size \(2\) with invariant=True"),
        (lambda: cpattn.hybrid_attention(q, q[:, :, :1], q[:, :, :1],
                                         ulysses_group=dist.group.WORLD,
                                         ring_group=singles[rank], invariant=True),
         "kv_heads=1: must be divisible"),
        (lambda: cpattn.ulysses_attention_varlen(q[0], q[0], q[0], [0, 16], invariant=True),
         "not supported here yet"),
        (lambda: cpattn.ring_attention_varlen(
            q[0], q[0], q[0], cpattn.shard_documents([0, 16], world_size=world), invariant=True),
         "invariant=True: is not supported over a DocumentPlan"),
        (lambda: cpattn.ring_attention(q, q, q, invariant="yes"), "must be True or False"),
        # ranks that disagree: the agreement check names the field, on every rank
        (lambda: cpattn.ring_attention(q, q, q, invariant=rank == 0), "invariant"),
    ]:
        with pytest.raises((ValueError, RuntimeError, TypeError), match=match):
            call()
    # the group is still usable
    out = cpattn.ring_attention(q, q, q, invariant=True)
    assert out.shape == q.shape


def test_refusals_on_every_rank() -> None:
    run_ranks(2, _refusals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["causal", "window", "all"])
def test_one_process_prefill_and_decode_equal_the_training_rows(dtype, name) -> None:
    """The rollout side of a trainer / rollout pair: a prompt prefilled in 1, 2 or 3 chunks, then
    5 decode steps, each by cpattn.attention(invariant=True) over the keys so far (bottom-right
    aligned), give every token's row of the training forward over the whole sequence, bitwise."""
    causal, window, options = CASES[name]
    full = _inputs(60, 333, dtype)
    kwargs = _draw(options, full[0].shape[2])
    q, k, v, _ = full
    want, want_lse = cpattn.attention(q, k, v, causal=causal, window=window, return_lse=True,
                                      invariant=True, **kwargs)
    prompt = 328
    # (a prefill holds the whole prefix of prefix-LM: its tokens see each other)
    for cuts in ([prompt], [200, prompt], [20, 129, prompt]):
        start = 0
        for end in [*cuts, *range(prompt + 1, 334)]:  # prefill chunks, then one token at a time
            out, lse = cpattn.attention(q[:, start:end], k[:, :end], v[:, :end], causal=causal,
                                        window=window, return_lse=True, invariant=True, **kwargs)
            assert torch.equal(out, want[:, start:end]), (cuts, start, end)
            assert torch.equal(lse, want_lse[:, :, start:end]), (cuts, start, end)
            start = end


def _check_inference(rank: int, world: int, layout: str, dtype, names) -> None:
    """prefill_attention + decode_attention(invariant=True) over a KV cache sharded in blocks of
    whole tiles: a prompt prefilled in 1, 2 or 3 chunks (lengths no layout granularity
    divides), then 5 decode steps (comm all_gather; the last reduce_scatter) give each token's
    row and LSE of the training forward over the whole sequence in one process, bitwise."""
    tile = torch.ops.cpattn.invariant_tile()
    prompt, total = 4 * tile + 201, 4 * tile + 206  # several tiles and cache blocks
    for n, name in enumerate(names):
        causal, window, options = CASES[name]
        full = _inputs(90 + n, total, dtype, dim=16)
        kwargs = _draw(options, full[0].shape[2])
        q, k, v, _ = full
        want, want_lse = cpattn.attention(q, k, v, causal=True, window=window, return_lse=True,
                                          invariant=True, **kwargs)
        for cuts in ([prompt], [700, prompt], [101, 1299, prompt]):
            cache = cpattn.KVCacheShard(2, total, 2, 16, interleave=2 * tile, dtype=dtype)
            start = 0
            for end in cuts:
                shard = functools.partial(cpattn.shard, layout=layout)
                out, lse = cpattn.prefill_attention(
                    shard(q[:, start:end]), shard(k[:, start:end]), shard(v[:, start:end]),
                    cache, layout=layout, seqlen=end - start, return_lse=True, window=window,
                    invariant=True, **kwargs)
                unshard = functools.partial(cpattn.unshard, layout=layout, seqlen=end - start)
                where = f"W={world} {layout} {name} {dtype} prefill {cuts} [{start}, {end})"
                assert torch.equal(unshard(out), want[:, start:end]), where
                assert torch.equal(unshard(lse, dim=2), want_lse[:, :, start:end]), where
                start = end
            for t in range(prompt, total):
                cache.append(k[:, t:t + 1], v[:, t:t + 1])
                last = t == total - 1 and q.shape[2] % world == 0
                comm = "reduce_scatter" if last else "all_gather"
                out, lse = cpattn.decode_attention(q[:, t:t + 1], cache, comm=comm, window=window,
                                                   return_lse=True, invariant=True, **kwargs)
                heads = slice(None)
                if comm == "reduce_scatter":
                    per = q.shape[2] // world
                    heads = slice(rank * per, (rank + 1) * per)
                where = f"W={world} {layout} {name} {dtype} decode {cuts} token {t} {comm}"
                assert torch.equal(out, want[:, t:t + 1, heads]), where
                assert torch.equal(lse, want_lse[:, heads, t:t + 1]), where


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_prefill_and_decode_equal_the_training_rows(world: int) -> None:
    run_ranks(world, _check_inference, "zigzag", torch.float32, ("causal", "window", "all"))
    if world == 3:
        run_ranks(world, _check_inference, "contiguous", torch.bfloat16, ("all",))


def test_tile_tree_blocks_merge_like_tiles() -> None:
    """The tile tree (csrc/include/cpattn/invariant.h): the partials of single tiles, of aligned
    blocks of 2 and 4 tiles (as a cache's owners merge them) and of all keys at once merge to the
    same bits, equal to cpattn.attention(invariant=True); merged one after the other in key
    order instead (another order), they differ: the order is what the test pins."""
    tile = torch.ops.cpattn.invariant_tile()
    torch.manual_seed(11)
    n = 7 * tile + 5
    q, k, v = (torch.randn(1, m, h, 16) for m, h in ((40, 2), (n, 1), (n, 1)))
    ops = torch.ops.cpattn
    scale = {"softmax_scale": 0.25}

    def blocks(size):  # the partials of aligned blocks of `size` tiles, merged by the tree
        parts = [ops.invariant_partial(q, k[:, b:b + size * tile], v[:, b:b + size * tile],
                                       n - 40, b, **scale) for b in range(0, n, size * tile)]
        return ops.invariant_merge(torch.stack([o for o, _ in parts]),
                                   torch.stack([lse for _, lse in parts]),
                                   [b // tile for b in range(0, n, size * tile)])

    want = cpattn.attention(q, k, v, return_lse=True, invariant=True)
    whole = ops.invariant_partial(q, k, v, n - 40, 0, **scale)
    for got in (blocks(1), blocks(2), blocks(4), whole):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    out, lse = ops.invariant_partial(q, k[:, :tile], v[:, :tile], n - 40, 0, **scale)
    for b in range(tile, n, tile):  # the sequential order
        o, s = ops.invariant_partial(q, k[:, b:b + tile], v[:, b:b + tile], n - 40, b, **scale)
        cpattn.merge_state_(out, lse, o, s)
    assert not torch.equal(out, want[0])


def _streamed_parts(rank: int, world: int) -> None:
    """The backward's streamed parts: in global order they are gather_global's tokens, and each
    starts a document or a multiple of invariant_row_band() into it (where the kernels' sums can
    continue), with runs that do and do not end at such a multiple, broadcast whole or in pieces
    of one chunk; and with such pieces the results stay bitwise those of one process."""
    from cpattn.core.layout import LAYOUTS
    from cpattn.invariant import global_order as invariant
    from cpattn.invariant.global_order import doc_shards, gather_global, stream_global

    chunk = torch.ops.cpattn.invariant_row_band()
    group = dist.group.WORLD
    cases = [(layout, docs, piece_bytes) for piece_bytes in (invariant._STREAM_BYTES, 1)
             for layout, docs in (("zigzag", None), ("contiguous", None),
                                  ("zigzag", (700, 5, 901)))]
    for layout, docs, piece_bytes in cases:
        invariant._STREAM_BYTES = piece_bytes
        code = LAYOUTS[layout]
        local = 2 * 3 * 100 if docs is None else sum(
            n for n, _, _ in doc_shards(code, world, 0, docs)) // world
        t = torch.randn(2, local, 3, 4) + rank
        whole, = gather_global([t], 1, group, rank, world, code, docs)
        starts = [begin for _, begin, _ in doc_shards(code, world, local, docs)]
        end = 0
        for begin, (part,) in stream_global([t], 1, group, rank, world, code, docs):
            assert begin == end and torch.equal(part, whole.narrow(1, begin, part.shape[1]))
            assert (begin - max(s for s in starts if s <= begin)) % chunk == 0
            end = begin + part.shape[1]
        assert end == whole.shape[1]
    invariant._STREAM_BYTES = 1  # runs of 1100 tokens broadcast in pieces of 1024 and 76
    _check(rank, world, ("zigzag",), ("ring",), ("all",), (torch.float32,), 6600)


def test_streamed_parts_cover_the_sequence_in_order() -> None:
    run_ranks(3, _streamed_parts)


def _head_dim_padded(rank: int, world: int) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        full = _inputs(3, 600, dtype, dim=40)
        causal, window, options = CASES["all"]
        kwargs = _draw(options, full[0].shape[2])
        want = _one_process(full, causal, window, kwargs)
        got = _sharded(full, causal, window, kwargs, "zigzag", "ring", seqlen=600,
                       invariant=True)
        _assert_bitwise(f"W={world} head_dim 40 {dtype}", got, want)


def test_bitwise_head_dim_not_a_multiple_of_16() -> None:
    """head_dim 40: the kernels keep the streamed dK / dV sums in a padded buffer of their own,
    started from the running sums and copied back."""
    run_ranks(2, _head_dim_padded)


def test_streamed_part_not_on_a_chunk_boundary_raises() -> None:
    """A part that starts inside a document off a multiple of invariant_row_band() would continue
    the kernels' sums out of order: refused."""
    from cpattn.core.layout import LAYOUTS

    q, k, v = (torch.randn(1, 512, 2, 16) for _ in range(3))
    sums = [torch.zeros_like(t) for t in (q, k, v)]
    lse = torch.zeros(1, 2, 512)
    parts = [t[:, :100] for t in (q, q, k, v)] + [lse[..., :100]] * 2
    with pytest.raises(RuntimeError, match="multiple of"):
        torch.ops.cpattn.invariant_bwd_part(*sums, q, q, k, v, lse, lse, *parts, 100, 0, 2,
                                            LAYOUTS["contiguous"], 1024, softmax_scale=0.25)


def _compiled(rank: int, world: int) -> None:
    """torch.compile(fullgraph=True) of an invariant ring call: forward and gradients bitwise
    equal to eager (the gathers' runs are constants while tracing)."""
    full = _inputs(8, 64, torch.float32)
    results = []
    for compiled in (False, True):
        q, k, v = (cpattn.shard(t, layout="zigzag").requires_grad_() for t in full[:3])

        def fn(a, b, c):
            return cpattn.ring_attention(a, b, c, causal=True, invariant=True)

        run = torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn
        out = run(q, k, v)
        (out * cpattn.shard(full[3], layout="zigzag")).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


def test_compile_fullgraph() -> None:
    run_ranks(2, _compiled)


@pytest.mark.parametrize("world,layout,seqlen,dtype,names", [
    (2, "zigzag", 4096, torch.float32, tuple(CASES)),
    (3, "contiguous", 3072, torch.float32, ("causal", "sinks_window_both", "all")),
    (4, "zigzag", 8192, torch.bfloat16, ("causal", "all")),
    (2, "striped", 4096, torch.float32, ("all",))])
def test_bitwise_blocks_computed_once(world, layout, seqlen, dtype, names) -> None:
    """Shards whose runs start and end at multiples of invariant_row_band(): the backward computes
    each block once, on its rows' rank, and the keys' owner adds the dK / dV planes of the
    chunks in global order (_backward_once); bitwise."""
    from cpattn.core.layout import LAYOUTS
    from cpattn.invariant.autograd import computed_once

    code = LAYOUTS["contiguous" if layout == "striped" else layout]
    assert computed_once(code, world, seqlen // world, None)
    run_ranks(world, _check, (layout,), ("ring",), names, (dtype,), seqlen)
