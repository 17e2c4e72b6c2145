#!/usr/bin/env python3
"""Times cpattn.ulysses_attention, forward + backward, on W gloo ranks x 1 thread (causal, batch
1): the median of `--iters` calls after a warm-up, max over ranks. To compare two builds, run it
once per build with that build first on the path and alternate the runs:

    PYTHONPATH=/tmp/before python bench/bench_ulysses.py     # a build installed with --target
    python bench/bench_ulysses.py                            # the venv's build
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from cpattn.testing.distributed import run_ranks


def _time(rank: int, world: int, dtype: str, seqlen: int, heads: int, dim: int,
          iters: int) -> float:
    import cpattn

    torch.set_num_threads(1)
    torch.manual_seed(rank)
    shape = (1, seqlen // world, heads, dim)
    q, k, v = (torch.randn(shape, dtype=getattr(torch, dtype), requires_grad=True)
               for _ in range(3))
    dout = torch.randn(shape, dtype=getattr(torch, dtype))
    times = []
    for _ in range(iters + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        cpattn.ulysses_attention(q, k, v, causal=True).backward(dout)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    import cpattn

    print(f"cpattn from {cpattn.__file__}")
    print("| W | S | heads | head_dim | dtype | fwd + bwd (s) |")
    print("|--:|--:|--:|--:|---|--:|")
    for dtype in args.dtype:
        t = run_ranks(args.world, _time, dtype, args.seqlen, args.heads, args.head_dim,
                      args.iters)
        print(f"| {args.world} | {args.seqlen} | {args.heads} | {args.head_dim} | {dtype} | "
              f"{max(t):.3f} |", flush=True)


if __name__ == "__main__":
    main()
