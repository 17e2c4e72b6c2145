"""The mixers' state scan: the all-gather against the tree (issue 54 item 4), measured on gloo
ranks against the model of cpattn.plan.mixer_scan, then the model's figures at large W.

    python bench/bench_scan.py [--worlds 2 3 4 6 8] [--kinds matrix scalar]
                               [--model-worlds 64 256 1024] [--out FILE.md]

Measured per rank (1 thread per rank, zigzag sequence, one layer's scan, forward + backward,
the most of any rank), for each method forced with cpattn.mixers.tree_scan.with_scan:
  sent   bytes the rank's process wrote to its sockets (/proc/self/io wchar: gloo's writes,
         every thread), forward + backward
  peak   the most bytes alive at once that the forward allocated (cpattn.memory.counting)
  kept   the bytes the forward leaves allocated: its output and what autograd keeps for the
         backward
  time   wall seconds of forward + backward, the median of 3 after a warm-up, the slowest rank
         (W ranks share 2 cores beyond W = 2: a loaded figure)
against the model's prediction of the same (predict_allgather / predict_tree on the piece map's
traffic, cpattn.mixers.tree_scan.scan_traffic; machine cpu-gloo). Layers measured: "matrix" (a
gated delta rule: 4 heads, K = V = 64) and "scalar" (Mamba-2-like: 8 heads, K = V = 64), batch 1.
Then the model alone for a Qwen3.5-27B gated delta rule layer (48 heads, K = V = 128, 48 such
layers) on the h100-ib preset at the model worlds, zigzag: both methods per rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from cpattn.core.machine import cpu_model  # noqa: E402
from cpattn.plan.mixer_scan import (  # noqa: E402
    LAYERS,
    MixerLayer,
    predict_allgather,
    predict_tree,
    scan_table,
    sequence_chains,
    tree_traffic,
)
from cpattn.plan.model import machine  # noqa: E402

SHAPES = {"matrix": MixerLayer("GDN-like", "matrix", 4, 64, 64),
          "scalar": MixerLayer("Mamba-2-like", "scalar", 8, 64, 64)}


def _written() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["wchar"])


def _rank(rank: int, world: int, kinds: list) -> dict:
    import cpattn
    from cpattn.memory import counting
    from cpattn.mixers import state_scan
    from cpattn.mixers.sharded import exchange_of, piece_map_of
    from cpattn.mixers.tree_scan import with_scan

    cp = cpattn.ContextParallel(layout="zigzag")
    piece_map = piece_map_of(cp, 8)
    exchange = exchange_of(cp)
    n = len(piece_map.pieces[rank])
    out = {}
    for kind in kinds:
        layer = SHAPES[kind]
        h, k, v = layer.heads, layer.key_dim, layer.value_dim
        m_shape = {"matrix": (h, k, k), "scalar": (h,)}[kind]
        gen = torch.Generator().manual_seed(rank)
        m = (torch.rand(1, n, *m_shape, generator=gen) * 0.1).requires_grad_(True)
        s = torch.randn(1, n, h, k, v, generator=gen).requires_grad_(True)
        for method in ("allgather", "tree"):
            ex = with_scan(exchange, method)
            times = []
            for _ in range(4):  # the first: a warm-up (plans, caches)
                dist.barrier()
                w0, t0 = _written(), time.perf_counter()
                with counting() as c:
                    entry = state_scan(m, s, piece_map, rank, kind, ex)
                w1 = _written()
                entry.sum().backward()
                times.append(time.perf_counter() - t0)
                w2 = _written()
            out[(kind, method)] = dict(sent=w2 - w0, fwd=w1 - w0, peak=c.peak, kept=c.current,
                                       time=sorted(times[1:])[1])
            del entry
    return out


def measure(worlds: list, kinds: list) -> list:
    from distributed import run_ranks

    rows = []
    gloo = machine("cpu-gloo")
    for world in worlds:
        per_rank = run_ranks(world, _rank, kinds, poison=False)
        traffic = tree_traffic(sequence_chains("zigzag", world), world)
        for kind in kinds:
            layer = SHAPES[kind]
            for method, model in (("allgather", predict_allgather), ("tree", predict_tree)):
                got = {key: max(r[(kind, method)][key] for r in per_rank)
                       for key in ("sent", "peak", "kept", "time")}
                pred = model(layer, traffic, gloo)
                rows.append((world, kind, method, got, pred))
    return rows


def measured_table(rows: list) -> str:
    lines = ["| W | layer | scan | sent KiB (model) | peak KiB (model) | kept KiB (model) "
             "| time ms (model) |", "|--:|---|---|--:|--:|--:|--:|"]
    for world, kind, method, got, pred in rows:
        cells = [f"{got[k] / 1024:.0f} ({v / 1024:.0f})"
                 for k, v in (("sent", pred.bytes_sent), ("peak", pred.peak),
                              ("kept", pred.kept))]
        cells.append(f"{got['time'] * 1e3:.2f} ({pred.time * 1e3:.2f})")
        lines.append(f"| {world} | {SHAPES[kind].name} {kind} | {method} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def model_tables(worlds: list) -> str:
    layer, h100 = LAYERS["qwen3.5-27b"], machine("h100-ib")
    parts = []
    for world in worlds:
        traffic = tree_traffic(sequence_chains("zigzag", world), world)
        preds = [predict_allgather(layer, traffic, h100), predict_tree(layer, traffic, h100)]
        for p in preds:
            p.fits = layer.layers * p.kept + p.peak <= h100.memory
        parts.append(f"W = {world}\n{scan_table(layer, preds)}")
    return "\n\n".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4, 6, 8])
    p.add_argument("--kinds", nargs="+", choices=sorted(SHAPES), default=["matrix", "scalar"])
    p.add_argument("--model-worlds", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    head = (f"{datetime.date.today()}, {cpu_model()}, torch {torch.__version__}, gloo, 1 thread "
            f"per rank\n`python bench/bench_scan.py {' '.join(argv or sys.argv[1:])}`")
    text = [head, "", measured_table(measure(args.worlds, args.kinds)), "",
            "Model, Qwen3.5-27B gated delta rule layer (48 heads, K = V = 128, fp32 summaries, "
            "batch 1; x layers: 48 layers), h100-ib, zigzag, per rank:", "```",
            model_tables(args.model_worlds), "```"]
    report = "\n".join(text)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
