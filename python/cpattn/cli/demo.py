"""`python -m cpattn demo`: ring attention on W spawned local ranks for each W in --world (default
1, 2, 4), timed, its memory per rank counted, and checked against one device.

Memory per rank is the peak of the bytes the forward + backward step allocates
(cpattn.memory.counting, the measurement of tests/test_memory.py), counted the same way for every
W, W = 1 included, around the timed step only: the inputs exist before it, and the unsharded
copies for the check are made after it. The check compares each W's unsharded out and gradients
with cpattn.attention on the whole sequence (one device) and out with float64 on 64 rows.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpattn.testing.distributed import run_ranks

MIB = 1 << 20
TOLERANCE = {"float64 rows": 1e-4, "one device": 1e-3}  # float32 inputs


def _bar(done: int, total: int, label: str) -> None:
    width = 30
    filled = width * done // total
    sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<24}")
    if done == total:
        sys.stdout.write("\n")
    sys.stdout.flush()


def _inputs(args):
    torch.manual_seed(0)
    shape_q = (args.batch, args.seqlen, args.heads, args.head_dim)
    shape_kv = (args.batch, args.seqlen, args.kv_heads, args.head_dim)
    return (torch.randn(shape_q), torch.randn(shape_kv), torch.randn(shape_kv),
            torch.randn(shape_q))


def _steps(rank: int, world: int, group, args, bar_start: int, bar_total: int) -> dict:
    """The steps at one W on the ranks of `group`; the peak is the most of any of its ranks."""
    import cpattn

    q, k, v, dout = _inputs(args)
    shards = [cpattn.shard(t, layout=args.layout, group=group) for t in (q, k, v, dout)]
    del q, k, v, dout
    times, peaks, stats = [], [], torch.zeros(4, dtype=torch.float64)
    for it in range(args.iters + 1):  # the first one warms up (lazy initialisation)
        qs, ks, vs = (t.clone().requires_grad_() for t in shards[:3])
        cpattn.release_buffers()  # the ring's cached buffers count as the step's memory
        dist.barrier(group=group)
        with cpattn.memory.counting() as counts:
            start = time.perf_counter()
            out = cpattn.ring_attention(qs, ks, vs, group=group, causal=args.causal,
                                        layout=args.layout)
            out.backward(shards[3])
            elapsed = time.perf_counter() - start
        if it > 0:
            times.append(elapsed)
            peaks.append(counts.peak)
            stats += torch.ops.cpattn.ring_stats()
        if rank == 0:
            label = "warm-up" if it == 0 else f"step {elapsed:.2f} s"
            _bar(bar_start + it + 1, bar_total, f"W={world} {label}")
    # The least of the steps: gloo frees its copies on its own thread, which only adds to a peak.
    peak = torch.tensor([min(peaks)], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    full = [cpattn.unshard(t.detach(), layout=args.layout, group=group)
            for t in (out, qs.grad, ks.grad, vs.grad)]
    return {"times": times, "stats": (stats / args.iters).tolist(), "peak": peak.item(),
            "full": [t.numpy() for t in full]}


def _rank_main(rank: int, world: int, args) -> Optional[dict]:
    """Every W of args.world in turn on ranks 0..W-1 of one spawn (one start-up instead of one
    per W; the other ranks wait, idle); rank 0 returns each W's results."""
    cores = os.cpu_count() or 1
    total = len(args.world) * (args.iters + 1)
    results = {}
    for i, w in enumerate(args.world):
        group = dist.new_group(list(range(w)))  # collective: every rank creates every group
        if rank < w:
            torch.set_num_threads(max(1, cores // w))  # the W ranks share the cores
            results[w] = _steps(rank, w, group, args, i * (args.iters + 1), total)
        dist.barrier()
    return results if rank == 0 else None


@dataclass
class Row:
    world: int
    step: float  # median seconds per forward + backward step
    peak: float  # bytes, the rank that allocates most
    comm_wait: float  # rank 0's seconds waiting on comm per step
    err_exact: float  # out vs float64, 64 rows
    err_single: float  # out, dq, dk, dv vs one device

    @property
    def ok(self) -> bool:
        return (self.err_exact < TOLERANCE["float64 rows"]
                and self.err_single < TOLERANCE["one device"])


def _single_device(args):
    """The whole sequence in this process (cpattn.attention, all cores): the reference results,
    and its time and peak counted as the ranks count theirs."""
    import cpattn

    q, k, v, dout = _inputs(args)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    with cpattn.memory.counting() as counts:
        start = time.perf_counter()
        out = cpattn.attention(qs, ks, vs, causal=args.causal)
        out.backward(dout)
        elapsed = time.perf_counter() - start
    return (q, k, v), [out.detach(), qs.grad, ks.grad, vs.grad], elapsed, counts.peak


def _table(rows: list[Row], single_time: float, single_peak: float, seqlen: int) -> list[str]:
    lines = ["| W | tokens per rank | time per step (s) | peak memory per rank (MiB) "
             "| waiting on comm (s) | max error vs float64 | max diff vs one device | check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.world} | {seqlen // r.world} | {r.step:.3f} | {r.peak / MIB:.1f} "
                     f"| {r.comm_wait:.3f} | {r.err_exact:.2e} | {r.err_single:.2e} "
                     f"| {'ok' if r.ok else 'FAILED'} |")
    lines.append(f"\none device, cpattn.attention on the whole sequence (no ring, all cores): "
                 f"{single_time:.3f} s, peak {single_peak / MIB:.1f} MiB")
    return lines


def _verdict(rows: list[Row]) -> str:
    if not all(r.ok for r in rows):
        bad = ", ".join(str(r.world) for r in rows if not r.ok)
        return (f"FAILED: W={bad} differs from the reference (tolerance "
                f"{TOLERANCE['float64 rows']:.0e} vs float64, {TOLERANCE['one device']:.0e} vs "
                f"one device)")
    ordered = sorted(rows, key=lambda r: r.world)
    mib = " > ".join(f"{r.peak / MIB:.1f}" for r in ordered)
    falls = all(a.peak > b.peak for a, b in zip(ordered, ordered[1:]))
    worlds = ", ".join(str(r.world) for r in ordered)
    if len(ordered) < 2:
        return f"OK: W={worlds} matches the reference"
    if falls:
        return (f"OK: every W matches the reference; memory per rank falls with W "
                f"(W={worlds}: {mib} MiB)")
    return (f"OK: every W matches the reference, but memory per rank does not fall with W at "
            f"this size (W={worlds}: {mib.replace(' > ', ', ')} MiB)")


def ring_demo(args: argparse.Namespace) -> int:
    import cpattn
    from cpattn.testing.reference import reference_rows

    worlds = list(dict.fromkeys(args.world))
    print(f"cpattn {cpattn.__version__}: ring attention on W = {', '.join(map(str, worlds))} "
          f"ranks (gloo on CPU), seqlen {args.seqlen}, batch {args.batch}, heads "
          f"{args.heads}/{args.kv_heads} kv, head_dim {args.head_dim}, float32, {args.layout}, "
          f"causal={args.causal}, {args.iters} timed step(s) after a warm-up; the W ranks share "
          f"this machine's {os.cpu_count()} cores")
    args.world = worlds
    try:
        results = run_ranks(max(worlds), _rank_main, args, poison=False)[0]
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"\na rank failed: {e}")
        return 1

    # The check, after every measurement: the references live in this process only.
    (q, k, v), single, single_time, single_peak = _single_device(args)
    check_rows = torch.linspace(0, args.seqlen - 1, steps=min(args.seqlen, 64)).long()
    exact = reference_rows(q, k, v, check_rows, args.causal)
    rows = []
    for w in worlds:
        res = results[w]
        full = [torch.from_numpy(a) for a in res["full"]]
        fwd_c, fwd_w, bwd_c, bwd_w = res["stats"]
        rows.append(Row(
            world=w, step=sorted(res["times"])[len(res["times"]) // 2], peak=res["peak"],
            comm_wait=fwd_w + bwd_w,
            err_exact=(full[0][:, check_rows].double() - exact).abs().max().item(),
            err_single=max((a - b).abs().max().item() for a, b in zip(full, single))))
    print()
    print("\n".join(_table(rows, single_time, single_peak, args.seqlen)))
    verdict = _verdict(rows)
    print(verdict)
    return 0 if verdict.startswith("OK") else 1
