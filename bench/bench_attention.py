#!/usr/bin/env python3
"""Times cpattn.attention against torch SDPA on the CPU, forward and backward.

Both get the same (batch, seqlen, heads, head_dim) tensors (SDPA through transposed views). Each
case is first checked (outputs and gradients of the two must agree) and only then timed:
  forward   one call under torch.no_grad(), wall clock;
  backward  the backward alone: torch.autograd.grad on a graph built once with retain_graph=True,
            so no forward is inside the timed region;
both after warm-up, median of the repetitions, cpattn and SDPA interleaved call by call so that
drift in machine load hits both alike. GFLOP/s use the flash-attn convention: forward
4 * B * H * S * S * D, halved when causal; backward 2.5x forward.

Examples:
  python bench/bench_attention.py --out /tmp/bench_attention.md   # a whole report
  python bench/bench_attention.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import torch

from cpattn.core.flops import BACKWARD_FLOP_FACTOR, attention_flops  # noqa: F401
from cpattn.core.layout import DTYPES

# The cases and the report live in attention_cases.py and bench_report.py; the names the other
# benchmarks and bench/test_bench_attention.py import from here are re-exported.
from attention_cases import (  # noqa: F401
    IMPLS,
    TOLERANCE,
    Case,
    Result,
    backward_call,
    forward_and_grads,
    forward_call,
    heads_for,
    make_inputs,
    max_rel_diff,
    run_case,
)
from bench_report import TABLE_HEADER, Report, cpu_model, header_lines, table_row  # noqa: F401

# --------------------------------------------------------------------------------------------
# Thread probe: which implementation really runs on N threads. Runs in a child process with
# OMP_WAIT_POLICY=passive, so that idle OpenMP workers sleep instead of spinning, and counts
# the threads of the process that gathered CPU time (from /proc/self/task) during the calls.


def _thread_ticks() -> dict[str, int]:
    ticks = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks


def _busy_threads(fn: Callable[[], object], seconds: float) -> int:
    fn()
    before, start = _thread_ticks(), time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
    deltas = [t - before.get(tid, 0) for tid, t in _thread_ticks().items()]
    busiest = max(deltas)
    return sum(d >= max(2, 0.25 * busiest) for d in deltas)


def probe_threads_child(threads: int, seconds: float) -> None:
    """Prints {impl pass: busy threads} as JSON (child side of the probe)."""
    torch.set_num_threads(threads)
    case = Case(1024, 64, 4 * threads, False, torch.float32, threads)
    inputs = make_inputs(case)
    counts: dict[str, int] = {"threads": threads}
    for name, impl in IMPLS.items():
        counts[f"{name} fwd"] = _busy_threads(forward_call(impl, inputs, False), seconds)
        counts[f"{name} bwd"] = _busy_threads(backward_call(impl, inputs, False), seconds)
    print(json.dumps(counts))


def probe_threads(threads: int, seconds: float) -> dict[str, int] | None:
    """Runs the probe in a child process; None where /proc is missing or the child fails."""
    if threads < 2 or not os.path.isdir("/proc/self/task"):
        return None
    env = dict(os.environ, OMP_WAIT_POLICY="passive")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--probe-threads",
        str(threads),
        "--probe-seconds",
        str(seconds),
    ]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"thread probe failed:\n{proc.stderr}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=["float32"])
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument(
        "--threads",
        nargs="+",
        type=int,
        default=[1, 2],
        help="torch.set_num_threads values (default: 1 2)",
    )
    p.add_argument(
        "--target-gflop",
        type=float,
        default=16.0,
        help="forward GFLOP per call that B*H is sized for (default 16)",
    )
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5, help="timed calls per measurement (median)")
    p.add_argument("--out", help="also write the report (markdown) to this file")
    p.add_argument(
        "--quick", action="store_true", help="tiny smoke run: S=256, D=64, small B*H, 2 reps"
    )
    p.add_argument("--probe-threads", type=int, help=argparse.SUPPRESS)
    p.add_argument("--probe-seconds", type=float, default=0.3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.seqlens, args.head_dims, args.target_gflop = [256], [64], 0.05
        args.warmup, args.reps, args.probe_seconds = 1, 2, 0.1
    if min(args.threads) < 1 or args.reps < 1 or args.warmup < 0:
        p.error("--threads must be >= 1, --reps >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe_threads:
        probe_threads_child(args.probe_threads, args.probe_seconds)
        return 0

    started = time.perf_counter()
    default_threads = torch.get_num_threads()
    probe = probe_threads(max(args.threads), args.probe_seconds)
    lines = ["# cpattn vs torch SDPA, CPU attention", "", *header_lines(args, probe), ""]
    print("\n".join(lines), TABLE_HEADER, sep="\n", flush=True)

    causal_values = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    multiple = max(args.threads)
    results: list[Result] = []
    for dtype_name in args.dtype:
        for head_dim in args.head_dims:
            for seqlen in args.seqlens:
                for causal in causal_values:
                    heads = heads_for(seqlen, head_dim, causal, args.target_gflop, multiple)
                    for threads in args.threads:
                        case = Case(seqlen, head_dim, heads, causal, DTYPES[dtype_name], threads)
                        results.append(run_case(case, args.warmup, args.reps))
                        print(table_row(results[-1]), flush=True)
    torch.set_num_threads(default_threads)

    failed = [r for r in results if not r.matches]
    footer = ["", f"total time {time.perf_counter() - started:.0f} s"]
    if failed:
        footer.append(f"**{len(failed)} case(s) MISMATCH between cpattn and SDPA: not timed**")
    print("\n".join(footer))
    if args.out:
        table = [TABLE_HEADER, *(table_row(r) for r in results)]
        with open(args.out, "w") as f:
            f.write("\n".join([*lines, *table, *footer]) + "\n")
        print(f"wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
