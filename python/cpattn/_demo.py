"""`python -m cpattn demo`: ring attention on W spawned local ranks, checked and timed."""

import argparse
import os
import resource
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpattn.testing.distributed import run_ranks


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _bar(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}   ")
    sys.stdout.flush()
    if done == total:
        sys.stdout.write("\n")


def _inputs(args):
    torch.manual_seed(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seqlen, args.kv_heads, args.head_dim)
    return (torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv),
            torch.randn(shape_q))


def _rank_main(rank: int, world: int, args) -> Optional[dict]:
    """One rank's timed steps; rank 0 returns the timings and the unsharded results."""
    import cpattn

    q, k, v, dout = _inputs(args)
    shards = [cpattn.shard(t, layout=args.layout) for t in (q, k, v, dout)]
    del q, k, v, dout
    rss_before = _max_rss_mib()
    times, stats = [], torch.zeros(4, dtype=torch.float64)
    for it in range(args.iters + 1):  # the first one warms up
        qs, ks, vs = (t.clone().requires_grad_() for t in shards[:3])
        dist.barrier()
        start = time.perf_counter()
        out = cpattn.ring_attention(qs, ks, vs, causal=args.causal, layout=args.layout)
        out.backward(shards[3])
        elapsed = time.perf_counter() - start
        if it > 0:
            times.append(elapsed)
            stats += torch.ops.cpattn.ring_stats()
        if rank == 0:
            _bar(it + 1, args.iters + 1, "warm-up" if it == 0 else f"step {elapsed:.2f} s")
    full = [cpattn.unshard(t.detach(), layout=args.layout) for t in (out, qs.grad, ks.grad,
                                                                      vs.grad)]
    peak = torch.tensor([_max_rss_mib() - rss_before])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank != 0:
        return None
    return {"times": times, "stats": (stats / args.iters).tolist(), "peak_mib": peak.item(),
            "full": [t.numpy() for t in full]}


def _single_device(args):
    """The same problem on one rank (cpattn.attention), for accuracy and the memory baseline."""
    import cpattn

    q, k, v, dout = _inputs(args)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    rss_before = _max_rss_mib()
    start = time.perf_counter()
    out = cpattn.attention(qs, ks, vs, causal=args.causal)
    out.backward(dout)
    elapsed = time.perf_counter() - start
    return (q, k, v), [out.detach(), qs.grad, ks.grad, vs.grad], elapsed, (
        _max_rss_mib() - rss_before)


def ring_demo(args: argparse.Namespace) -> int:
    import cpattn
    from cpattn.testing.reference import reference_rows

    w = args.world
    print(f"cpattn {cpattn.__version__}: ring attention, {w} ranks (gloo on CPU), "
          f"seqlen {args.seqlen} ({args.seqlen // w} per rank), batch {args.batch}, heads "
          f"{args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, {args.layout}, "
          f"causal={args.causal}")
    try:
        res = run_ranks(w, _rank_main, args, threads=max(1, (os.cpu_count() or 1) // w),
                        poison=False)[0]
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"a rank failed: {e}")
        return 1
    res["full"] = [torch.from_numpy(a) for a in res["full"]]

    print("single-device run of the same problem (cpattn.attention, all cores) ...")
    (q, k, v), single, single_time, single_peak = _single_device(args)
    rows = torch.linspace(0, args.seqlen - 1, steps=min(args.seqlen, 64)).long()
    exact = reference_rows(q, k, v, rows, args.causal)
    err_out = (res["full"][0][:, rows].double() - exact).abs().max().item()
    err_single = max((a - b).abs().max().item() for a, b in zip(res["full"], single))

    fwd_c, fwd_w, bwd_c, bwd_w = res["stats"]
    step = sorted(res["times"])[len(res["times"]) // 2]
    print()
    print("| | value |")
    print("|---|---|")
    print(f"| time per forward+backward step, W={w} (median) | {step:.3f} s |")
    print(f"| same on one device (all cores) | {single_time:.3f} s |")
    print(f"| rank 0 forward: compute / waiting on comm | {fwd_c:.3f} s / {fwd_w:.3f} s |")
    print(f"| rank 0 backward: compute / waiting on comm | {bwd_c:.3f} s / {bwd_w:.3f} s |")
    hidden = 1 - (fwd_w + bwd_w) / max(step, 1e-9)
    print(f"| share of the step not spent waiting on comm | {100 * hidden:.1f} % |")
    print(f"| peak memory growth per rank, W={w} | {res['peak_mib']:.0f} MiB |")
    print(f"| peak memory growth, one device | {single_peak:.0f} MiB |")
    print(f"| max error of out vs float64 (64 rows) | {err_out:.2e} |")
    print(f"| max diff vs one device (out, dq, dk, dv) | {err_single:.2e} |")
    ok = err_out < 1e-4 and err_single < 1e-3
    print("OK" if ok else "FAILED: ring result differs from the reference")
    return 0 if ok else 1
