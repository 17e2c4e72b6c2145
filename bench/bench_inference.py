"""Inference with a sharded KV cache on CPU ranks (gloo): decode step latency and bytes sent per
rank per layer vs W and context length, prefill time vs W, KV-cache memory per rank vs W.

    python bench/bench_inference.py [--worlds 1 2 4] [--contexts 4096 16384 65536] [--out FILE]

Each W runs as W spawned processes with one thread each. One attention layer (heads 16, kv heads
4, head_dim 64, fp32, batch 1) is timed; a model runs it once per layer.
- decode: cpattn.decode_attention for one new token (its K/V appended first), both comm
  patterns, and all_gather with validate=False (no metadata check); "local" is the rank's
  partial attention alone (torch.ops.cpattn.cache_attention_fwd), "check" the metadata
  all-gather every call makes so that mismatched ranks raise. Bytes sent per
  rank are counted from the message sizes: all_gather forwards W - 1 messages of
  B x Sq x H x (D + 1) fp32 around the ring, reduce_scatter (an all-to-all by heads) sends
  (W - 1) / W of one; plus the check's (W - 1) x 16 int64.
- prefill: cpattn.prefill_attention of a whole prompt in one chunk and in two chunks (chunked
  prefill: the second chunk also attends to the cached first one).
- memory: the K/V storage a rank allocates (KVCacheShard.nbytes) and its RSS growth.
Times: max over ranks of the per-rank median (decode also shows the min: a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpattn.testing.distributed import run_ranks  # noqa: E402

from bench_attention import Report  # noqa: E402

CHECK_WORDS = 12  # int64 words of the agreement check's fixed-size header (cpattn.core.agreement)


def _rss_mib() -> float:
    """Resident memory now (not the peak: the peak of a long-lived process hides later growth)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _times(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters + 1):  # the first call warms up
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times[1:]


def _median_time(fn, iters: int) -> float:
    return statistics.median(_times(fn, iters))


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import cpattn
    from cpattn.core.agreement import agree

    h, hkv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    ops = torch.ops.cpattn
    res: dict = {"rank": rank, "decode": {}, "prefill": {}}

    # Memory first, in a fresh process: the RSS growth of allocating and filling the cache.
    cap = cfg["memory_capacity"]
    fill = torch.randn(1, 8192, hkv, d)  # made before the first reading: not counted
    rss0 = _rss_mib()
    cache = cpattn.KVCacheShard(1, cap, hkv, d)
    for start in range(0, cap, 8192):
        n = min(8192, cap - start)
        cache.append(fill[:, :n], fill[:, :n])
    res["cache_bytes"] = cache.nbytes
    res["rss_growth_mib"] = _rss_mib() - rss0
    cache = None  # freed before the next one is made

    for ctx in cfg["contexts"]:
        gen = torch.Generator().manual_seed(ctx)  # the same tokens on every rank
        cache = cpattn.KVCacheShard(1, ctx + 4 * cfg["iters"] + 8, hkv, d)
        step = 8192
        for start in range(0, ctx, step):
            n = min(step, ctx - start)
            cache.append(torch.randn(1, n, hkv, d, generator=gen),
                         torch.randn(1, n, hkv, d, generator=gen))
        q = torch.randn(1, 1, h, d, generator=gen)
        kv = torch.randn(1, 1, hkv, d, generator=gen)
        row = {}
        for key, comm, validate in (("all_gather", "all_gather", True),
                                    ("reduce_scatter", "reduce_scatter", True),
                                    ("unchecked", "all_gather", False)):
            def decode_step():
                cache.append(kv, kv)
                cpattn.decode_attention(q, cache, comm=comm, validate=validate)

            row[key] = _times(decode_step, cfg["iters"])
        lens = cache.lengths
        row["local"] = _times(lambda: ops.cache_attention_fwd(
            q, cache.k, cache.v, lens, lens - 1, rank, world, 1, torch.float32,
            softmax_scale=d ** -0.5, causal=True), cfg["iters"])
        group = dist.group.WORLD
        fields = cache.agreement_fields(rank)
        row["check"] = _times(lambda: agree("bench", group, fields, 60), cfg["iters"])
        res["decode"][ctx] = row
        cache = None  # freed before the next one is made

    s = cfg["prompt"]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, s, n, d, generator=gen) for n in (h, hkv, hkv))
    for chunks in (1, 2):
        size = s // chunks
        pos = cpattn.positions(size, layout="zigzag")

        def prefill():
            cache = cpattn.KVCacheShard(1, s, hkv, d)
            for c in range(chunks):
                part = [t[:, c * size:(c + 1) * size][:, pos] for t in (q, k, v)]
                cpattn.prefill_attention(*part, cache, layout="zigzag")
            return cache

        res["prefill"][chunks] = _median_time(prefill, cfg["prefill_iters"])
    return res


def run(world: int, cfg: dict) -> list:
    return run_ranks(world, _worker, cfg, poison=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--prompt", type=int, default=8192, help="prefill prompt length")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20, help="timed decode steps")
    parser.add_argument("--prefill-iters", type=int, default=3)
    parser.add_argument("--memory-capacity", type=int, default=65536,
                        help="tokens per sequence of the cache whose memory is measured")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    args = parser.parse_args()

    cfg = {"contexts": args.contexts, "prompt": args.prompt, "heads": args.heads,
           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "iters": args.iters,
           "prefill_iters": args.prefill_iters, "memory_capacity": args.memory_capacity}
    results = {w: run(w, cfg) for w in args.worlds}

    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    emit = Report("inference benchmark", f"; one layer: heads {h}, kv heads {hkv}, head_dim "
                  f"{d}, fp32, batch 1; W ranks x 1 thread (gloo)")

    msg = 1 * 1 * h * (d + 1) * 4
    emit(f"## Decode step, one layer: ms, median (min) of {args.iters} steps, max over ranks")
    emit("| context | W | local partial | decode all_gather | decode reduce_scatter | "
         "metadata check | all_gather, validate=False | bytes sent per rank: all_gather / "
         "reduce_scatter (+ check) |")
    emit("|---|---|---|---|---|---|---|---|")
    for ctx in args.contexts:
        for w in args.worlds:
            rows = [r["decode"][ctx] for r in results[w]]

            def cell(key: str) -> str:
                med = 1e3 * max(statistics.median(r[key]) for r in rows)
                best = 1e3 * max(min(r[key]) for r in rows)
                return f"{med:.2f} ({best:.2f})"

            check_bytes = (w - 1) * CHECK_WORDS * 8
            emit(f"| {ctx} | {w} | {cell('local')} | {cell('all_gather')} | "
                 f"{cell('reduce_scatter')} | {cell('check')} | {cell('unchecked')} | "
                 f"{(w - 1) * msg} / "
                 f"{(w - 1) * msg // w} (+ {check_bytes}) |")

    emit()
    emit(f"## Prefill of a {args.prompt}-token prompt, one layer, zigzag (s, max over ranks of "
         f"the median of {args.prefill_iters})")
    emit("| W | one chunk | two chunks (chunked prefill) | speed-up vs W=1 (one chunk) |")
    emit("|---|---|---|---|")
    base = max(r["prefill"][1] for r in results[args.worlds[0]])
    for w in args.worlds:
        one = max(r["prefill"][1] for r in results[w])
        two = max(r["prefill"][2] for r in results[w])
        emit(f"| {w} | {one:.3f} | {two:.3f} | {base / one:.2f}x |")

    emit()
    emit(f"## KV-cache memory per rank, capacity {args.memory_capacity} tokens, one layer")
    emit("| W | K/V storage per rank (MiB) | ratio to W=1 | RSS growth per rank, allocating and "
         "filling it (MiB, max over ranks) |")
    emit("|---|---|---|---|")
    first = results[args.worlds[0]][0]["cache_bytes"] * args.worlds[0]
    for w in args.worlds:
        nbytes = max(r["cache_bytes"] for r in results[w])
        rss = max(r["rss_growth_mib"] for r in results[w])
        emit(f"| {w} | {nbytes / 2**20:.2f} | {nbytes / first:.3f} | {rss:.0f} |")

    emit.write(args.out)


if __name__ == "__main__":
    main()
