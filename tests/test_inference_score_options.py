"""Softcap, ALiBi, prefix-LM and sliding windows (with sinks) in prefill_attention and
decode_attention, on global positions through the sharded cache and the exact merge: a prompt in
two prefill chunks (the second also attends to the cached first), then decode steps of 2 and 1
queries with both merges, each against the float64 reference over the tokens present at that
step, at W = 1..3; prefill chunks of any length."""

import pytest
import torch

import cpattn

from distributed import run_ranks
from reference import reference_attention

# name -> options; prefix_len as a function of the chunk length C (prompt 2C, then 2 + 1 decode)
CASES = {
    "softcap_alibi_sinks_prefix_into_chunk2": lambda c: {
        "softcap": 4.0, "alibi": True, "sinks": True, "prefix_len": c + 3},
    "alibi_prefix_into_decode": lambda c: {"alibi": True, "prefix_len": 2 * c + 2},
    "softcap_only": lambda c: {"softcap": 2.5},
    # the second chunk's and the decode steps' windows reach part way into the cached tokens
    "window_sinks": lambda c: {"window": (c // 2 + 1, -1), "sinks": True},
    "window_softcap_alibi_prefix": lambda c: {
        "window": (3, -1), "softcap": 3.0, "alibi": True, "prefix_len": c - 1},
}


def _steps(rank: int, world: int, name: str, interleave: int) -> None:
    torch.manual_seed(31 + world)
    b, h, hkv, d = 2, 6, 3, 16
    chunk = 2 * world * 2
    total = 2 * chunk + 3
    options = CASES[name](chunk)
    q, k, v = (torch.randn(b, total, heads, d) for heads in (h, hkv, hkv))
    kwargs = {"softcap": options.get("softcap", 0.0), "prefix_len": options.get("prefix_len", 0),
              "window": options.get("window", (-1, -1))}
    if options.get("alibi"):
        kwargs["alibi_slopes"] = torch.rand(h) * 0.4 + 0.05
    if options.get("sinks"):
        kwargs["sinks"] = torch.randn(h) * 2

    def reference(start: int, stop: int):
        """Rows [start, stop) over the keys [0, stop): what is in the cache at that step."""
        return reference_attention(q[:, start:stop], k[:, :stop], v[:, :stop], causal=True,
                                   q_offset=start, **kwargs)

    cache = cpattn.KVCacheShard(b, total, hkv, d, interleave=interleave)
    pos = cpattn.positions(chunk, layout="zigzag")
    for start in (0, chunk):  # two prompt chunks: the second also attends to the cached first
        rows = slice(start, start + chunk)
        out, lse = cpattn.prefill_attention(*(t[:, rows][:, pos] for t in (q, k, v)), cache,
                                            layout="zigzag", return_lse=True, **kwargs)
        r_out, r_lse = reference(start, start + chunk)
        what = f"prefill {name} W={world} I={interleave} start={start}"
        torch.testing.assert_close(out.double(), r_out[:, pos], atol=2e-5, rtol=2e-5,
                                   msg=lambda m: f"out {what}: {m}")
        torch.testing.assert_close(lse.double(), r_lse[:, :, pos], atol=2e-5, rtol=2e-5,
                                   msg=lambda m: f"lse {what}: {m}")
    start = 2 * chunk
    for sq in (2, 1):
        new = slice(start, start + sq)
        cache.append(k[:, new], v[:, new])
        r_out, r_lse = reference(start, start + sq)
        for comm in ("all_gather", "reduce_scatter"):
            out, lse = cpattn.decode_attention(q[:, new], cache, comm=comm, return_lse=True,
                                               **kwargs)
            heads = slice(None) if comm == "all_gather" else slice(rank * h // world,
                                                                   (rank + 1) * h // world)
            what = f"decode {name} W={world} I={interleave} Sq={sq} {comm}"
            torch.testing.assert_close(out.double(), r_out[:, :, heads], atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"out {what}: {m}")
            torch.testing.assert_close(lse.double(), r_lse[:, heads], atol=2e-5, rtol=2e-5,
                                       msg=lambda m: f"lse {what}: {m}")
        start += sq


def _any_length_prefill(rank: int, world: int) -> None:
    """Prefill chunks of any length C = 2W k + r (zigzag and striped, with every option): padding
    rows out 0 and LSE the sink, the cache grows by C and holds exactly the real tokens (the
    decode step after it matches the reference)."""
    torch.manual_seed(77 + world)
    b, h, hkv, d = 1, 4, 2, 16
    for layout, sizes in (("zigzag", (2 * world + 1, 4 * world - 1)), ("striped", (world + 1, 3))):
        total = sum(sizes) + 1
        q, k, v = (torch.randn(b, total, heads, d) for heads in (h, hkv, hkv))
        kwargs = {"softcap": 4.0, "alibi_slopes": torch.rand(h) * 0.4, "sinks": torch.randn(h),
                  "prefix_len": sizes[0] + 1, "window": (sizes[0] - 1, -1)}
        cache = cpattn.KVCacheShard(b, total, hkv, d, interleave=2)
        start = 0
        for c in sizes:
            rows = slice(start, start + c)
            pos = cpattn.positions(c, layout=layout)
            assert torch.equal(cpattn.chunk_positions(cache, c, layout=layout)[0],
                               torch.where(pos >= 0, pos + start, -1))
            out, lse = cpattn.prefill_attention(
                *(cpattn.shard(t[:, rows], layout=layout) for t in (q, k, v)), cache,
                layout=layout, return_lse=True, seqlen=c, **kwargs)
            r_out, r_lse = reference_attention(q[:, rows], k[:, :start + c], v[:, :start + c],
                                               causal=True, q_offset=start, **kwargs)
            real, what = pos >= 0, f"prefill {layout} W={world} C={c} start={start}"
            torch.testing.assert_close(out[:, real].double(), r_out[:, pos[real]], atol=2e-5,
                                       rtol=2e-5, msg=lambda m: f"out {what}: {m}")
            torch.testing.assert_close(lse[:, :, real].double(), r_lse[:, :, pos[real]],
                                       atol=2e-5, rtol=2e-5, msg=lambda m: f"lse {what}: {m}")
            assert torch.equal(out[:, ~real], torch.zeros_like(out[:, ~real])), what
            assert torch.equal(lse[:, :, ~real],
                               kwargs["sinks"][None, :, None].expand_as(lse[:, :, ~real])), what
            start += c
            assert cache.lengths.tolist() == [start]
        cache.append(k[:, start:], v[:, start:])
        out = cpattn.decode_attention(q[:, start:], cache, **kwargs)
        r_out, _ = reference_attention(q[:, start:], k, v, causal=True, **kwargs)
        torch.testing.assert_close(out.double(), r_out, atol=2e-5, rtol=2e-5)
    # a length the shards do not hold, and v with its own head dim, raise on every rank
    one = torch.randn(1, 2, h, d)
    with pytest.raises(ValueError, match=r"prefill_attention: seqlen=100: gives shards of"):
        cpattn.prefill_attention(one, one[:, :, :hkv], one[:, :, :hkv], cache, seqlen=100)
    with pytest.raises(ValueError, match=r"prefill_attention: \(k.shape, v.shape\)"):
        cpattn.prefill_attention(one, one[:, :, :hkv], one[:, :, :hkv, :8], cache)
    # a prefix reaching into a chunk at different positions of the batch's sequences
    pair = cpattn.KVCacheShard(2, 16 * world, hkv, d)
    two = torch.randn(2, 2, h, d)
    cpattn.prefill_attention(two[:1], two[:1, :, :hkv], two[:1, :, :hkv], pair.sequences(0, 1))
    with pytest.raises(ValueError, match=r"prefix_len=5: reaches into this chunk at different"):
        cpattn.prefill_attention(two, two[:, :, :hkv], two[:, :, :hkv], pair, prefix_len=5)
    cpattn.prefill_attention(two, two[:, :, :hkv], two[:, :, :hkv], pair)  # still usable


def _all_cases(rank: int, world: int) -> None:
    for n, name in enumerate(CASES):
        _steps(rank, world, name, interleave=1 + n % 3)
    _any_length_prefill(rank, world)
    # bad options raise on every rank (the same message) and the group stays usable
    cache = cpattn.KVCacheShard(1, 8, 1, 8)
    cache.append(*(torch.randn(1, 2, 1, 8) for _ in range(2)))
    q = torch.randn(1, 1, 2, 8)
    for kwargs, match in [
        ({"softcap": -1.0}, r"decode_attention: softcap=-1.0: must be finite and >= 0"),
        ({"prefix_len": -2}, r"decode_attention: prefix_len=-2: must be >= 0"),
        ({"alibi_slopes": torch.ones(2, requires_grad=True)}, r"alibi_slopes=.*are fixed"),
        ({"alibi_slopes": torch.ones(3)}, r"alibi_slopes"),
        ({"window": (-2, -1)}, r"decode_attention: window\[0\] \(left\)=-2: must be >= -1"),
        ({"window": 3}, r"decode_attention: window=3: must be a pair"),
    ]:
        with pytest.raises((ValueError, RuntimeError), match=match):
            cpattn.decode_attention(q, cache, **kwargs)
    cpattn.decode_attention(q, cache, alibi_slopes=torch.ones(2), prefix_len=1)
    if world > 1:  # ranks that disagree on the window raise on every rank
        with pytest.raises(ValueError, match=r"window_left"):
            cpattn.decode_attention(q, cache, window=(rank, -1))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_prefill_and_decode_options(world: int) -> None:
    run_ranks(world, _all_cases)
