"""Invariant mode against the default, same run: ring_attention(invariant=True) vs the default
ring (and all-gather), forward + backward, causal, zigzag, on W spawned gloo ranks (one thread
each).

    python bench/bench_invariant.py --world W [--local 2048] [--dtype float32] [--heads 4]
                                    [--kv-heads 2] [--head-dim 64] [--iters 3]

Columns: time = max over ranks of the median fwd + bwd (s); ratio = time / the default ring's;
peak = max over ranks of the bytes the call allocates on top of its inputs at once
(cpattn.memory.counting, the ring's cached buffers released first); peak ratio likewise.
The last line: invariant time_ratio T peak_ratio P (against the default ring).

    python bench/bench_invariant.py --world W --decode CONTEXT [--dtype ...] [--heads ...]

--decode: one decode step (cpattn.decode_attention, comm all_gather, one new token, batch 1)
over a KV cache of CONTEXT tokens sharded in blocks of one key tile (interleave 1024), default
mode against invariant=True, same processes: the median step time (max over ranks), the ratio.
"""

import argparse
import gc
import statistics
import time

import torch
import torch.distributed as dist

from cpattn.testing.distributed import run_ranks

METHODS = {  # name -> ring_attention keywords
    "ring (default)": {"strategy": "ring"},
    "allgather (default)": {"strategy": "allgather"},
    "invariant": {"strategy": "ring", "invariant": True},
}


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import cpattn

    torch.manual_seed(rank)
    dtype = getattr(torch, cfg["dtype"])
    n, h, hkv, d = cfg["local"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, dout = (torch.randn(1, n, h, d).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, n, hkv, d).to(dtype) for _ in range(2))
    rows = {}
    for name, kwargs in METHODS.items():
        times, peak = [], 0
        for it in range(cfg["iters"] + 1):  # the first call warms up
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            cpattn.memory.release_buffers()
            gc.collect()
            dist.barrier()
            start = time.perf_counter()
            with cpattn.memory.counting() as counts:
                out = cpattn.ring_attention(qs, ks, vs, causal=True, layout="zigzag", **kwargs)
                out.backward(dout)
            elapsed = time.perf_counter() - start
            dist.barrier()
            if it:
                times.append(elapsed)
                peak = max(peak, counts.peak)
            del qs, ks, vs, out
        rows[name] = (statistics.median(times), peak)
    return rows


def _decode_worker(rank: int, world: int, cfg: dict) -> dict:
    import cpattn

    torch.manual_seed(0)  # the same tokens on every rank
    dtype = getattr(torch, cfg["dtype"])
    n, h, hkv, d = cfg["decode"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    tile = torch.ops.cpattn.invariant_tile()
    cache = cpattn.KVCacheShard(1, n + cfg["iters"] + 1, hkv, d, interleave=tile, dtype=dtype)
    cache.append(*(torch.randn(1, n, hkv, d).to(dtype) for _ in range(2)))
    times = {}
    for invariant in (False, True):
        steps = []
        for it in range(cfg["iters"] + 1):  # the first call warms up
            q = torch.randn(1, 1, h, d).to(dtype)
            dist.barrier()
            start = time.perf_counter()
            cpattn.decode_attention(q, cache, invariant=invariant)
            if it:
                steps.append(time.perf_counter() - start)
        times[invariant] = statistics.median(steps)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--local", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--decode", type=int, default=0, help="context of a decode step")
    args = parser.parse_args()
    cfg = {"local": args.local, "dtype": args.dtype, "heads": args.heads,
           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "iters": args.iters,
           "decode": args.decode}
    if args.decode:
        per_rank = run_ranks(args.world, _decode_worker, cfg, poison=False)
        base, inv = (max(r[mode] for r in per_rank) for mode in (False, True))
        print(f"W={args.world} decode over {args.decode} cached tokens, {args.dtype} heads "
              f"{args.heads}/{args.kv_heads} D={args.head_dim}: default {base * 1e3:.2f} ms, "
              f"invariant {inv * 1e3:.2f} ms, ratio {inv / base:.2f}")
        return
    per_rank = run_ranks(args.world, _worker, cfg, poison=False)
    print(f"W={args.world} S_local={args.local} {args.dtype} heads {args.heads}/{args.kv_heads} "
          f"D={args.head_dim}, causal zigzag, fwd + bwd")
    print(f"{'method':<22}{'time s':>9}{'ratio':>8}{'peak MiB':>10}{'ratio':>8}")
    base_t = max(r["ring (default)"][0] for r in per_rank)
    base_m = max(r["ring (default)"][1] for r in per_rank)
    for name in METHODS:
        t = max(r[name][0] for r in per_rank)
        m = max(r[name][1] for r in per_rank)
        print(f"{name:<22}{t:>9.3f}{t / base_t:>8.2f}{m / 2**20:>10.1f}{m / base_m:>8.2f}")
    t = max(r["invariant"][0] for r in per_rank) / base_t
    m = max(r["invariant"][1] for r in per_rank) / base_m
    print(f"invariant time_ratio {t:.2f} peak_ratio {m:.2f}")


if __name__ == "__main__":
    main()
