"""The same attention problem under each context-parallel strategy on CPU ranks (gloo): time of
forward + backward, bytes sent per rank, peak memory per rank.

    python bench/bench_strategies.py [--seqlen 8192] [--out FILE]

Bytes sent per rank are counted by construction from the messages each strategy sends (gloo has
no per-process byte counter), per forward + backward:
  ring       (W-1) K/V shards + W fp32 dK/dV shards (W-1 hops behind K/V, one final hop)
  allgather  2 (W-1) K/V shards (gather in forward and again in backward) + (W-1) fp32 dK/dV
  ulysses    (W-1)/W of q, K/V (after any GQA replication), out, dout, dq, dK/dV (all-to-alls)
  hybrid     ulysses within U, then ring across R on H/U heads of a U-times longer shard
"""

import argparse
import datetime
import os
import resource
import statistics
import time

import torch
import torch.distributed as dist
from bench_attention import cpu_model
from bench_ring import run


def _bytes_sent(strategy: str, cfg: dict, world: int) -> float:
    b, sl, h, hkv, d = cfg["batch"], cfg["slocal"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    e = 4  # fp32 inputs
    q = b * sl * h * d * e
    kv = 2 * b * sl * hkv * d * e
    kv32 = 2 * b * sl * hkv * d * 4
    if world == 1:
        return 0.0
    if strategy == "ring":
        return (world - 1) * kv + world * kv32
    if strategy == "allgather":
        return 2 * (world - 1) * kv + (world - 1) * kv32
    u = cfg.get("ulysses", world)
    kv_u = kv if hkv % u == 0 else (kv * u // hkv if (h // hkv) % (h // u) == 0 else kv * h // hkv)
    ulysses = (u - 1) / u * (3 * q + 2 * kv_u)
    if strategy == "ulysses":
        return ulysses
    r = world // u  # hybrid: ring over R ranks with H/U heads and a U-times longer shard
    return ulysses + (r - 1) * kv_u + (r if r > 1 else 0) * kv_u * 4 / e


def _worker(rank, world, init_file, cfg, queue):
    import cpattn

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.manual_seed(rank)
    b, sl, h, hkv, d = cfg["batch"], cfg["slocal"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = torch.randn(b, sl, h, d)
    k, v = torch.randn(b, sl, hkv, d), torch.randn(b, sl, hkv, d)
    dout = torch.randn(b, sl, h, d)
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
            return cpattn.ring_attention(qs, ks, vs, causal=True, strategy=strategy)
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
    queue.put({"rank": rank, "time": statistics.median(times), "peak_mib": peak})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--out")
    args = parser.parse_args()
    import cpattn

    lines = [f"# strategies benchmark, {datetime.date.today()}",
             f"CPU: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; "
             f"cpattn ISA {cpattn.build_info()['cpu_isa']}; 1 thread per rank", ""]

    def emit(line=""):
        print(line, flush=True)
        lines.append(line)

    emit(f"Causal attention, global seqlen {args.seqlen}, heads {args.heads}, head_dim "
         f"{args.head_dim}, fp32, forward + backward (median of {args.iters} after a warm-up); "
         "time = slowest rank; memory = max over ranks of the peak RSS growth.")
    emit()
    emit("| W | kv heads | strategy | time (s) | MiB sent per rank | peak MiB per rank |")
    emit("|---|---|---|---|---|---|")
    for world, strategies in ((2, [("ring", 0), ("allgather", 0), ("ulysses", 0)]),
                              (4, [("ring", 0), ("allgather", 0), ("ulysses", 0),
                                   ("hybrid", 2)])):
        for hkv in args.kv_heads:
            for strategy, u in strategies:
                cfg = {"batch": 1, "slocal": args.seqlen // world, "heads": args.heads,
                       "kv_heads": hkv, "head_dim": args.head_dim, "iters": args.iters,
                       "strategy": strategy}
                if u:
                    cfg["ulysses"] = u
                name = f"hybrid U={u} x R={world // u}" if u else strategy
                res = run(world, cfg, _worker)
                emit(f"| {world} | {hkv} | {name} | {max(r['time'] for r in res):.3f} | "
                     f"{_bytes_sent(strategy, cfg, world) / 2**20:.1f} | "
                     f"{max(r['peak_mib'] for r in res):.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
