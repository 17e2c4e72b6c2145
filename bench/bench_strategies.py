"""The same attention problem under each context-parallel strategy on CPU ranks (gloo): time of
forward + backward, bytes sent per rank, peak memory per rank.

    python bench/bench_strategies.py [--seqlen 8192] [--world 2 4] [--strategies ...]
                                     [--allgather-chunk 0 1 2] [--out FILE]

Bytes sent per rank come from the cost model (cpattn.plan, `bytes_sent`), whose figures
tests/test_plan_distributed.py checks against the bytes gloo really sends, per forward + backward:
  ring       2 (W-1) K/V shards (once round in forward, again in backward) + W fp32 dK/dV shards
  allgather  2 (W-1) K/V shards + (W-1) fp32 dK/dV, twice over gloo (its reduce-scatter is a
             ring all-reduce)
  ulysses    (W-1)/W of q, K/V (after any GQA replication), out, dout, dq, dK/dV (all-to-alls)
  hybrid     ulysses within U, then ring across R on H/U heads of a U-times longer shard

With --out FILE.md (or --plot FILE.png) it also draws time, bytes and peak memory per rank against
W and against the sequence length (FILE.png next to FILE.md).
"""

import argparse
import os
import resource
import statistics
import time

import torch.distributed as dist

from bench_attention import Report
from bench_ring import rank_inputs, run


def _bytes_sent(strategy: str, cfg: dict, world: int) -> float:
    from cpattn import plan as P

    u = cfg.get("ulysses", world)
    layout = "contiguous" if strategy == "ulysses" else "zigzag"
    cand = P.Candidate(strategy, layout, u, world // u if strategy == "hybrid" else 1,
                       chunk=cfg.get("chunk") or P.allgather_chunk(cfg["kv_heads"], world))
    p = P.Problem(cfg["slocal"] * world, cfg["heads"], cfg["kv_heads"], cfg["head_dim"],
                  batch=cfg["batch"], dtype="float32", causal=True)
    return P.predict(p, P.PRESETS["cpu-gloo"], world, [cand])[0].bytes_sent


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import cpattn

    q, k, v, dout = rank_inputs(rank, cfg)
    strategy = cfg["strategy"]
    if strategy == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        u = cfg["ulysses"]
        mesh = init_device_mesh("cpu", (world // u, u))

        def call(qs, ks, vs):
            return cpattn.hybrid_attention(qs, ks, vs, mesh=mesh, causal=True)
    elif strategy == "ulysses":
        def call(qs, ks, vs):
            return cpattn.ulysses_attention(qs, ks, vs, causal=True)
    else:
        def call(qs, ks, vs):
            return cpattn.ring_attention(qs, ks, vs, causal=True, strategy=strategy,
                                         allgather_chunk=cfg.get("chunk") or None)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for it in range(cfg["iters"] + 1):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        dist.barrier()
        t0 = time.perf_counter()
        call(qs, ks, vs).backward(dout)
        if it > 0:
            times.append(time.perf_counter() - t0)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    return {"rank": rank, "time": statistics.median(times), "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ring", "allgather", "ulysses",
                                                            "hybrid"])
    parser.add_argument("--allgather-chunk", type=int, nargs="+", default=[0],
                        help="KV heads per gather, one row each (0: the library's default)")
    parser.add_argument("--out")
    parser.add_argument("--plot", help="PNG of the table (default: next to --out)")
    args = parser.parse_args()

    emit = Report("strategies benchmark", "; 1 thread per rank")

    emit(f"Causal attention, global seqlen {', '.join(map(str, args.seqlen))}, heads "
         f"{args.heads}, head_dim {args.head_dim}, fp32, forward + backward (median of "
         f"{args.iters} after a warm-up); time = slowest rank; memory = max over ranks of the peak "
         "RSS growth.")
    emit()
    emit("| S | W | kv heads | strategy | time (s) | MiB sent per rank | peak MiB per rank |")
    emit("|---|---|---|---|---|---|---|")
    rows = []
    for seqlen in args.seqlen:
        for world in args.world:
            strategies = [("ring", 0, 0), *(("allgather", 0, c) for c in args.allgather_chunk),
                          ("ulysses", 0, 0), *([("hybrid", 2, 0)] if world == 4 else [])]
            for hkv in args.kv_heads:
                for strategy, u, chunk in strategies:
                    if strategy not in args.strategies:
                        continue
                    cfg = {"batch": 1, "slocal": seqlen // world, "heads": args.heads,
                           "kv_heads": hkv, "head_dim": args.head_dim, "iters": args.iters,
                           "strategy": strategy, "chunk": chunk}
                    if u:
                        cfg["ulysses"] = u
                    name = (f"hybrid U={u} x R={world // u}" if u else
                            f"{strategy} (chunk {chunk})" if chunk else strategy)
                    res = run(world, cfg, _worker)
                    row = {"S": seqlen, "W": world, "kv heads": hkv, "strategy": name,
                           "time (s)": max(r["time"] for r in res),
                           "MiB sent per rank": _bytes_sent(strategy, cfg, world) / 2**20,
                           "peak MiB per rank": max(r["peak_mib"] for r in res)}
                    rows.append(row)
                    emit(f"| {seqlen} | {world} | {hkv} | {name} | {row['time (s)']:.3f} | "
                         f"{row['MiB sent per rank']:.1f} | {row['peak MiB per rank']:.0f} |")
    emit.write(args.out)
    png = args.plot or (os.path.splitext(args.out)[0] + ".png" if args.out else None)
    if png:
        _plot(rows, png)


def _plot(rows: list, png: str) -> None:
    """Against W at the longest S, and against S at the largest W (one line per strategy and
    KV-head count)."""
    from cpattn.plan.plot import plot_rows

    for r in rows:
        r["line"] = f"{r['strategy']}, kv {r['kv heads']}"
    ys = ["time (s)", "MiB sent per rank", "peak MiB per rank"]
    longest, widest = max(r["S"] for r in rows), max(r["W"] for r in rows)
    base = os.path.splitext(png)[0]
    plot_rows([r for r in rows if r["S"] == longest], "W", ys, "line", png,
              f"strategies on CPU gloo ranks, causal, S = {longest}: scaling with W")
    if len({r["S"] for r in rows}) > 1:
        plot_rows([r for r in rows if r["W"] == widest], "S", ys, "line", base + "_seqlen.png",
                  f"strategies on CPU gloo ranks, causal, W = {widest}: scaling with S")


if __name__ == "__main__":
    main()
