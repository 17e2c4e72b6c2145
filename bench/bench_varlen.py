"""Packed documents on CPU ranks: per-document zigzag (ring_attention_varlen over cu_seqlens)
against the document-aware plan (cpattn.shard_documents), forward + backward, causal.

    python bench/bench_varlen.py --world W --mix NAME [--seqlen 32768] [--dtype float32]
                                 [--heads 2] [--kv-heads 1] [--head-dim 64] [--iters 3]

Mixes (a fixed seed, so every run packs the same documents): lognormal (median ~1K tokens,
tail to 16K), short (every document <= 512 tokens), one-long (one 16K document and short ones),
single (one document of the whole batch). (One-long's long document is at most half the batch.)

W spawned gloo ranks, one thread each, run each sharding in turn, then, in the same processes at
the same time (so the ranks share the cores as the sharded runs did), the local varlen
attention of the whole batch (cpattn.attention_varlen): ideal = that time / W.
Columns: time = max over ranks of the median fwd + bwd; efficiency = ideal / time; bytes =
K/V and gradient bytes each rank sends per fwd + bwd, from the cost model (model) and as
counted on the loopback interface while the call ran (/proc/net/dev, all ranks' traffic / W:
gloo's TCP payload plus headers, the agreement check included); balance = max / min attention
work (visible pairs) per rank. The last line, for the plan the planner picks
(shard_documents(split="auto") with this machine's calibration): efficiency E bytes_ratio B
balance M.
"""

import argparse
import math
import statistics
import time

import torch
import torch.distributed as dist

from cpattn.testing.distributed import run_ranks

MIXES = ("lognormal", "short", "one-long", "single")


def document_lengths(mix: str, seqlen: int, seed: int = 0) -> list:
    """Document lengths of a packed batch of exactly `seqlen` tokens."""
    gen = torch.Generator().manual_seed(seed)
    if mix == "single":
        return [seqlen]
    lengths = [min(16384, seqlen // 2)] if mix == "one-long" else []
    while sum(lengths) < seqlen:
        if mix == "lognormal":
            n = math.exp(math.log(1024) + 1.2 * float(torch.randn((), generator=gen)))
            n = int(min(max(n, 16), 16384))
        else:  # short, and one-long's rest
            n = int(torch.randint(16, 513, (), generator=gen))
        lengths.append(min(n, seqlen - sum(lengths)))
    return lengths


def _lo_bytes() -> int:
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmitted bytes
    return 0


def _worker(rank: int, world: int, cfg: dict) -> dict:
    import cpattn

    torch.manual_seed(0)  # the same packed batch on every rank
    dtype = getattr(torch, cfg["dtype"])
    lengths = cfg["lengths"]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    total, h, hkv, d = int(cu[-1]), cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q, dout = (torch.randn(total, h, d).to(dtype) for _ in range(2))
    k, v = (torch.randn(total, hkv, d).to(dtype) for _ in range(2))
    inputs = {}
    for name, docs in cfg["shardings"].items():
        plan = cu if docs is None else docs
        shard = (lambda t: cpattn.shard_varlen(t, cu)) if docs is None else \
            (lambda t, p=plan: p.shard(t, rank))
        inputs[name] = (plan, [shard(t) for t in (q, k, v, dout)])
    times = {name: [] for name in [*inputs, "ideal"]}
    sent = {name: [] for name in inputs}
    for it in range(cfg["iters"] + 1):  # interleaved, so that a drifting machine moves all alike
        for name, (plan, (qs, ks, vs, ds)) in inputs.items():
            args = [t.clone().requires_grad_() for t in (qs, ks, vs)]
            dist.barrier()
            lo0 = _lo_bytes()
            t0 = time.perf_counter()
            cpattn.ring_attention_varlen(*args, plan, causal=True).backward(ds)
            t1 = time.perf_counter()
            dist.barrier()
            if it > 0:
                times[name].append(t1 - t0)
                sent[name].append((_lo_bytes() - lo0) / world)
        if it > 0 and it <= cfg["ideal_iters"]:
            args = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            t0 = time.perf_counter()
            cpattn.attention_varlen(*args, cu, causal=True).backward(dout)
            times["ideal"].append((time.perf_counter() - t0) / world)
            dist.barrier()
    res = {name: {"time": statistics.median(times[name]), "sent": statistics.median(sent[name])}
           for name in inputs}
    res["ideal"] = statistics.median(times["ideal"])
    return res


def model_bytes(plan, cfg: dict, world: int) -> float:
    """K/V and gradient bytes the busiest rank sends per fwd + bwd: for the documents split over
    every rank, the ring's (its shard each of W - 1 steps forward, again backward, and the fp32
    dK/dV accumulators W - 1 hops and home); for those split over a subset, its shard to each
    other member forward and their fp32 dK/dV back."""
    elem = torch.empty((), dtype=getattr(torch, cfg["dtype"])).element_size()
    kv_token = 2 * cfg["kv_heads"] * cfg["head_dim"]
    ring = 0.0
    if world > 1 and plan.split_tokens:
        kv = plan.split_tokens * kv_token
        ring = 2 * (world - 1) * kv * elem + world * kv * 4
    subset = max(sum((len(m) - 1) * n * kv_token * (elem + 4)
                     for _, m, _, _, n in plan.subset_pieces(r)) for r in range(world))
    return ring + subset


def main() -> None:
    import cpattn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--mix", default="lognormal", choices=MIXES)
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    lengths = document_lengths(args.mix, args.seqlen)
    world = args.world
    cu = torch.tensor([0, *lengths]).cumsum(0)
    per_doc = cpattn.shard_documents(cu, world_size=world, split="all")
    plans = {s: cpattn.shard_documents(cu, world_size=world, split=s)
             for s in ("balanced", "none")}
    model = {"heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
             "dtype": args.dtype, "training": True, "machine": cpattn.plan.PRESETS["cpu-gloo"]}
    chosen = cpattn.shard_documents(cu, world_size=world, split="auto", **model)
    shardings = {"per-document zigzag": None, "plan balanced": plans["balanced"]}
    if plans["none"] != plans["balanced"]:  # (equal when nothing needs splitting)
        shardings["plan none"] = plans["none"]
    cfg = {"lengths": lengths, "dtype": args.dtype, "heads": args.heads,
           "kv_heads": args.kv_heads, "head_dim": args.head_dim, "iters": args.iters,
           "ideal_iters": 3, "shardings": shardings}
    res = run_ranks(world, _worker, cfg, threads=1, poison=False)
    ideal = max(r["ideal"] for r in res)
    print(f"# bench_varlen: W = {world}, mix {args.mix} ({len(lengths)} documents, "
          f"{sum(lengths)} tokens, longest {max(lengths)}), {args.dtype}, heads "
          f"{args.heads}/{args.kv_heads}, head_dim {args.head_dim}, causal, fwd + bwd")
    print(f"ideal (local varlen attention of the whole batch / W): {ideal:.3f} s")
    print("| sharding | split docs | time (s) | efficiency | bytes/rank model (MiB) | "
          "bytes/rank counted (MiB) | balance |")
    print("|---|---|---|---|---|---|---|")
    rows = {}
    base_model = model_bytes(per_doc, cfg, world)
    base_counted = None
    for name, docs in shardings.items():
        p = per_doc if docs is None else docs
        t = max(r[name]["time"] for r in res)
        counted = statistics.mean(r[name]["sent"] for r in res)
        if docs is None:
            base_counted = counted
        rows[name] = (p, t, counted)
        print(f"| {name} | {len(p.split)} / {len(lengths)} | {t:.3f} | {ideal / t:.2f} | "
              f"{model_bytes(p, cfg, world) / 2**20:.2f} | {counted / 2**20:.2f} | "
              f"{p.balance:.3f} |")
    pick = "plan balanced" if chosen == plans["balanced"] else (
        "plan none" if chosen == plans["none"] else "per-document zigzag")
    if pick == "plan none" and "plan none" not in shardings:
        pick = "plan balanced"
    fastest = min(rows, key=lambda n: rows[n][1])
    p, t, counted = rows[pick]
    ratio = model_bytes(p, cfg, world) / base_model if base_model else 0.0
    counted_ratio = counted / base_counted if base_counted else 0.0
    print(f"planner picks: {pick} ({p.describe()}); fastest measured: {fastest}; counted bytes "
          f"ratio {counted_ratio:.3f}")
    print(f"efficiency {ideal / t:.2f} bytes_ratio {ratio:.3f} balance {p.balance:.3f}")


if __name__ == "__main__":
    main()
