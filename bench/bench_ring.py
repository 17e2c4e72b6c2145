"""Ring attention on CPU ranks: efficiency against the same per-rank work without communication,
layout balance for causal masks, and per-rank peak memory against W.

    python bench/bench_ring.py [--slocal 2048 4096] [--iters 7] [--ring-chunk C] [--dtype bfloat16]
                               [--memory-seqlen 16384] [--out FILE]

Ring efficiency: W = 2 spawned ranks (gloo), one thread each, run cpattn.ring_attention forward
and backward; in the same processes, at the same time, each rank then runs exactly its share of
the ring's work with every shift replaced by a local copy
(torch.ops.cpattn_testing.ring_loopback_timing).
The ratio ring / local is the cost of communication that compute did not hide: of the medians
over iterations (max over ranks), and paired, the median over iterations of each iteration's
ratio (the ring call and the local work right after it), which a machine whose speed drifts from
one second to the next moves alike (the efficiency is 1 / the paired ratio). With
--ring-chunk C the ring runs in passes of C KV heads (ring_chunk) against the same local work:
the ratio then includes the cost of the passes (more, smaller messages and kernel calls).
"""

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

from cpattn.core.layout import LAYOUTS
from cpattn.testing.distributed import run_ranks

from bench_attention import Report


def rank_inputs(rank: int, cfg: dict) -> tuple[torch.Tensor, ...]:
    """This rank's random q, dout (batch, slocal, heads, head_dim) and k, v (kv_heads)."""
    torch.manual_seed(rank)
    b, h, hkv, d, sl = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["slocal"]
    dtype = getattr(torch, cfg.get("dtype", "float32"))
    q = torch.randn(b, sl, h, d).to(dtype)
    k, v = torch.randn(b, sl, hkv, d).to(dtype), torch.randn(b, sl, hkv, d).to(dtype)
    return q, k, v, torch.randn(b, sl, h, d).to(dtype)


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import cpattn
    from cpattn.testing.emulation import load_ops

    load_ops()  # torch.ops.cpattn_testing.ring_loopback_timing
    q, k, v, dout = rank_inputs(rank, cfg)
    d = cfg["head_dim"]
    layout, causal = cfg["layout"], cfg["causal"]
    scale = d ** -0.5
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ring_f, ring_b, loop_f, loop_b = [], [], [], []
    for it in range(cfg["iters"] + 1):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        dist.barrier()
        t0 = time.perf_counter()
        out = cpattn.ring_attention(qs, ks, vs, causal=causal, layout=layout,
                                    ring_chunk=cfg.get("ring_chunk"))
        t1 = time.perf_counter()
        out.backward(dout)
        t2 = time.perf_counter()
        dist.barrier()
        fwd_s, bwd_s = torch.ops.cpattn_testing.ring_loopback_timing(
            q, k, v, dout, rank, world, LAYOUTS[layout], softmax_scale=scale,
            causal=causal).tolist()
        if it > 0:
            ring_f.append(t1 - t0)
            ring_b.append(t2 - t1)
            loop_f.append(fwd_s)
            loop_b.append(bwd_s)
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return {"rank": rank, "ring_fwd": statistics.median(ring_f),
            "ring_bwd": statistics.median(ring_b), "local_fwd": statistics.median(loop_f),
            "local_bwd": statistics.median(loop_b), "peak_mib": peak_mib,
            "ring_iters": [f + b for f, b in zip(ring_f, ring_b)],
            "local_iters": [f + b for f, b in zip(loop_f, loop_b)]}


def paired_ratio(res: list) -> float:
    """Median over iterations of (the slowest rank's ring fwd + bwd) / (the slowest rank's local
    fwd + bwd) of the same iteration, which ran right after it: a machine whose speed drifts
    between iterations moves both alike."""
    iters = len(res[0]["ring_iters"])
    return statistics.median(max(r["ring_iters"][i] for r in res) /
                             max(r["local_iters"][i] for r in res) for i in range(iters))


def run(world: int, cfg: dict, worker=_worker) -> list:
    """worker(rank, world, cfg) on `world` spawned gloo ranks (cfg["threads"] torch threads each,
    default 1, no output poisoning); what each returned, by rank."""
    return run_ranks(world, worker, cfg, threads=cfg.get("threads", 1), poison=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slocal", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--memory-seqlen", type=int, default=16384)
    parser.add_argument("--ring-chunk", type=int, help="KV heads per pass of the ring "
                        "(ring_chunk; default all, one pass)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    args = parser.parse_args()

    emit = Report("ring benchmark")

    base = {"batch": 1, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "iters": args.iters, "threads": 1,
            "ring_chunk": args.ring_chunk, "dtype": args.dtype}
    passes = "" if args.ring_chunk is None else f", ring_chunk {args.ring_chunk}"
    emit("## Ring efficiency: W = 2 ranks x 1 thread, causal, zigzag "
         f"(heads {args.heads}, head_dim {args.head_dim}, {args.dtype}{passes}); time = max over "
         "ranks of the median")
    emit("| S_local | ring fwd (s) | local fwd (s) | fwd ratio | ring bwd (s) | local bwd (s) "
         "| bwd ratio | fwd+bwd ratio | paired fwd+bwd ratio | efficiency (1 / paired) |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for sl in args.slocal:
        res = run(2, {**base, "slocal": sl, "layout": "zigzag", "causal": True})
        rf, lf = max(r["ring_fwd"] for r in res), max(r["local_fwd"] for r in res)
        rb, lb = max(r["ring_bwd"] for r in res), max(r["local_bwd"] for r in res)
        paired = paired_ratio(res)
        emit(f"| {sl} | {rf:.3f} | {lf:.3f} | {rf / lf:.3f} | {rb:.3f} | {lb:.3f} | "
             f"{rb / lb:.3f} | {(rf + rb) / (lf + lb):.3f} | {paired:.3f} | {1 / paired:.2f} |")

    emit()
    sl = args.slocal[0]
    emit(f"## Layout balance, causal, W = 2 and 4, S_local = {sl}: per-rank visible pairs "
         "(work) and per-rank local compute time, max / min over ranks")
    emit("| W | layout | work max/min | fwd+bwd time max/min | slowest rank fwd+bwd (s) |")
    emit("|---|---|---|---|---|")
    for world in (2, 4):
        seqlen = sl * world
        for layout in ("contiguous", "zigzag", "striped"):
            # visible (query, key) pairs per rank, from the ring's own schedule
            work = torch.ops.cpattn.schedule_work(seqlen, world, LAYOUTS[layout], True, -1, -1,
                                                  64, 64)[:, :, 0].sum(1).tolist()
            res = run(world, {**base, "slocal": sl, "layout": layout, "causal": True,
                              "iters": 1})
            times = [r["local_fwd"] + r["local_bwd"] for r in res]
            emit(f"| {world} | {layout} | {max(work) / min(work):.3f} | "
                 f"{max(times) / min(times):.3f} | {max(times):.3f} |")

    emit()
    s = args.memory_seqlen
    emit(f"## Peak memory growth per rank (max RSS), global seqlen {s}, causal zigzag, fwd+bwd")
    emit("| W | S_local | peak growth per rank (MiB, max over ranks) |")
    emit("|---|---|---|")
    for world in (1, 2, 4):
        res = run(world, {**base, "slocal": s // world, "layout": "zigzag", "causal": True,
                          "iters": 1})
        emit(f"| {world} | {s // world} | {max(r['peak_mib'] for r in res):.0f} |")

    emit.write(args.out)


if __name__ == "__main__":
    main()
