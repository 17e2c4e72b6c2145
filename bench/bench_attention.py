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
  python bench/bench_attention.py --out bench/RESULTS.md
  python bench/bench_attention.py --quick
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import cpattn
from cpattn._flops import BACKWARD_FLOP_FACTOR, attention_flops
from cpattn._layout import DTYPES

# A case passes when max|cpattn - sdpa| <= tolerance * max|sdpa|, for the output and for each
# gradient. A wrong kernel (mask, scale, a missed block) is off by O(1) of that.
TOLERANCE: dict[torch.dtype, float] = {
    torch.float32: 1e-4,
    torch.bfloat16: 4e-2,
    torch.float16: 5e-3,
}

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def run_cpattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """cpattn on (B, S, H, D) tensors."""
    return cpattn.attention(q, k, v, causal=causal)


def run_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """torch SDPA on the same (B, S, H, D) tensors, through (B, H, S, D) views."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


IMPLS: dict[str, Attention] = {"cpattn": run_cpattn, "sdpa": run_sdpa}


@dataclass(frozen=True)
class Case:
    """One benchmarked problem: batch 1, `heads` heads, self-attention of length `seqlen`."""

    seqlen: int
    head_dim: int
    heads: int
    causal: bool
    dtype: torch.dtype
    threads: int

    @property
    def batch(self) -> int:
        return 1

    @property
    def fwd_flops(self) -> float:
        return attention_flops(
            self.batch, self.heads, self.seqlen, self.seqlen, self.head_dim, self.causal
        )

    @property
    def shape(self) -> str:
        return f"{self.batch}x{self.seqlen}x{self.heads}x{self.head_dim}"


@dataclass
class Result:
    """Median seconds per call (None when the case was not timed) and the agreement check."""

    case: Case
    fwd_diff: float
    bwd_diff: float
    matches: bool
    fwd_s: dict[str, float] | None = None
    bwd_s: dict[str, float] | None = None


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of shape (B, S, H, D), standard normal, in the case's dtype."""
    gen = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.seqlen, case.heads, case.head_dim)
    return tuple(torch.randn(shape, generator=gen).to(case.dtype) for _ in range(4))


def forward_and_grads(
    impl: Attention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of one implementation."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = impl(*leaves, causal)
    grads = torch.autograd.grad(out, leaves, dout)
    return (out.detach(), *grads)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, that divided by max |b|), computed in fp32."""
    a, b = a.float(), b.float()
    diff = (a - b).abs().max().item()
    return diff, diff / max(b.abs().max().item(), 1e-30)


def check_case(case: Case, inputs: Sequence[torch.Tensor]) -> tuple[float, float, bool]:
    """Compares cpattn with SDPA: (max abs diff fwd, max abs diff over dq/dk/dv, within tol)."""
    got = forward_and_grads(run_cpattn, *inputs, case.causal)
    ref = forward_and_grads(run_sdpa, *inputs, case.causal)
    diffs = [max_rel_diff(g, r) for g, r in zip(got, ref)]
    tol = TOLERANCE[case.dtype]
    ok = all(rel <= tol for _, rel in diffs) and all(torch.isfinite(g).all() for g in got)
    return diffs[0][0], max(d for d, _ in diffs[1:]), ok


def interleaved_medians(
    fns: dict[str, Callable[[], object]], warmup: int, reps: int
) -> dict[str, float]:
    """Median wall-clock seconds per call of each function, calls interleaved round-robin."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def forward_call(impl: Attention, inputs: Sequence[torch.Tensor], causal: bool) -> Callable:
    """A no-argument forward call without autograd."""
    q, k, v, _ = inputs

    def call() -> torch.Tensor:
        with torch.no_grad():
            return impl(q, k, v, causal)

    return call


def backward_call(impl: Attention, inputs: Sequence[torch.Tensor], causal: bool) -> Callable:
    """A no-argument call of the backward alone, on a graph built here once and retained."""
    q, k, v, dout = inputs
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = impl(*leaves, causal)

    def call() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return call


def run_case(case: Case, warmup: int, reps: int) -> Result:
    """Checks one case, then times it if the two implementations agree."""
    torch.set_num_threads(case.threads)
    inputs = make_inputs(case)
    fwd_diff, bwd_diff, ok = check_case(case, inputs)
    result = Result(case, fwd_diff, bwd_diff, ok)
    if not ok:
        return result
    result.fwd_s = interleaved_medians(
        {name: forward_call(impl, inputs, case.causal) for name, impl in IMPLS.items()},
        warmup,
        reps,
    )
    result.bwd_s = interleaved_medians(
        {name: backward_call(impl, inputs, case.causal) for name, impl in IMPLS.items()},
        warmup,
        reps,
    )
    return result


def heads_for(seqlen: int, head_dim: int, causal: bool, target_gflop: float, multiple: int) -> int:
    """Heads (batch 1) so that one forward is about target_gflop, a multiple of `multiple`."""
    per_head = attention_flops(1, 1, seqlen, seqlen, head_dim, causal) / 1e9
    heads = max(1, round(target_gflop / per_head))
    return -(-heads // multiple) * multiple


# --------------------------------------------------------------------------------------------
# Report


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or platform's guess elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


class Report:
    """A benchmark's markdown: a title and machine line, then each line printed as it comes;
    write() saves it all (the --out file)."""

    def __init__(self, title: str, setup: str = "") -> None:
        self.lines = [f"# {title}, {datetime.date.today()}",
                      f"CPU: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; "
                      f"cpattn ISA {cpattn.build_info()['cpu_isa']}{setup}", ""]

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def sdpa_backend(dtype: torch.dtype) -> str:
    """The fused SDPA backend torch picks on the CPU for this dtype (e.g. FLASH_ATTENTION)."""
    try:
        from torch.nn.attention import SDPBackend

        q = torch.zeros(1, 2, 64, 64, dtype=dtype, requires_grad=True)
        return SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)).name
    except Exception as e:  # noqa: BLE001  (private API: report rather than fail)
        return f"unknown ({type(e).__name__})"


def gflops(flops: float, seconds: float) -> float:
    return flops / seconds / 1e9


_CEILINGS: dict[tuple[torch.dtype, int], float] = {}


def ceiling_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose GEMM bounds attention in `dtype`: fp16 has no dot-product instruction on
    these CPUs, so it runs as fp32 products (exact), and torch.mm in fp16 is no GEMM ceiling."""
    return torch.float32 if dtype == torch.float16 else dtype


def gemm_ceiling(dtype: torch.dtype, threads: int, size: int = 2048) -> float:
    """GFLOP/s of torch.mm (size^3) in this dtype and thread count: the machine's practical
    ceiling for the matrix products attention is made of. Measured once per (dtype, threads)."""
    dtype = ceiling_dtype(dtype)
    key = (dtype, threads)
    if key not in _CEILINGS:
        torch.set_num_threads(threads)
        a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
        torch.mm(a, b)
        times = []
        for _ in range(7):  # the best of several: a GEMM is as fast as the machine lets it be
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        _CEILINGS[key] = gflops(2 * size**3, min(times))
    return _CEILINGS[key]


TABLE_HEADER = (
    "| shape BxSxHxD | dtype | threads | causal "
    "| fwd cpattn | fwd sdpa | fwd ratio | bwd cpattn | bwd sdpa | bwd ratio "
    "| GEMM ceiling | cpattn fwd / bwd of ceiling | max abs diff fwd / bwd |\n"
    "|---|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|---|"
)


def table_row(r: Result) -> str:
    """One markdown table row: GFLOP/s of both, ratio cpattn / sdpa, and the check."""
    c = r.case
    dtype = str(c.dtype).removeprefix("torch.")
    diff = f"{r.fwd_diff:.1e} / {r.bwd_diff:.1e}"
    head = f"| {c.shape} | {dtype} | {c.threads} | {'yes' if c.causal else 'no'} "
    if r.fwd_s is None or r.bwd_s is None:
        return head + "| - | - | - | - | - | - | **MISMATCH** " + diff + " |"
    cells, ours_both = [], []
    for seconds, flops in ((r.fwd_s, c.fwd_flops), (r.bwd_s, BACKWARD_FLOP_FACTOR * c.fwd_flops)):
        ours, theirs = gflops(flops, seconds["cpattn"]), gflops(flops, seconds["sdpa"])
        cells += [f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}"]
        ours_both.append(ours)
    ceiling = gemm_ceiling(c.dtype, c.threads)
    cells += [f"{ceiling:.0f}",
              f"{100 * ours_both[0] / ceiling:.0f} % / {100 * ours_both[1] / ceiling:.0f} %"]
    return head + "| " + " | ".join(cells) + f" | {diff} |"


def header_lines(args: argparse.Namespace, probe: dict[str, int] | None) -> list[str]:
    """The bullet list describing machine, software and method."""
    info = cpattn.build_info()
    backend = torch.__config__.parallel_info().splitlines()[-1].split(":")[-1].strip()
    sdpa = ", ".join(f"{d} {sdpa_backend(DTYPES[d])}" for d in args.dtype)
    lines = [
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- CPU: {cpu_model()} ({os.cpu_count()} logical CPUs), {platform.machine()}",
        f"- torch {torch.__version__} (intra-op backend: {backend}), "
        + f"python {platform.python_version()}",
        f"- cpattn {cpattn.__version__}, CPU ISA: {info['cpu_isa']}",
        f"- SDPA CPU backend: {sdpa}",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        "- method: forward = one call under no_grad; backward = torch.autograd.grad alone on a "
        + "retained graph (no forward inside the timing); wall clock, median of "
        + f"{args.reps} after {args.warmup} warm-up, cpattn and SDPA interleaved",
        "- GEMM ceiling: torch.mm 2048^3 GFLOP/s in the row's dtype and thread count, measured "
        + "in the same run (bf16: bf16 products with fp32 accumulation; fp16: the fp32 GEMM, "
        + "since fp16 has no dot-product instruction here and runs as exact fp32 products)",
        "- units: GFLOP/s, flash-attn convention (fwd 4*B*H*S*S*D, halved for causal; bwd 2.5x "
        + "fwd); ratio = cpattn / sdpa (> 1: cpattn faster); B*H is sized so that one forward "
        + f"is about {args.target_gflop} GFLOP",
        "- check: each case runs both with gradients first; max abs diff of out and of "
        + "dq/dk/dv; a case beyond tolerance is reported as MISMATCH and not timed",
    ]
    if probe is not None:
        n = probe["threads"]
        counts = {name: count for name, count in probe.items() if name != "threads"}
        busy = ", ".join(f"{name} {count}" for name, count in counts.items())
        lines.append(f"- busy threads at torch.set_num_threads({n}) (probe): {busy}")
        lazy = [name for name, count in counts.items() if count < n]
        if lazy:
            lines.append(
                f"- **warning**: {', '.join(lazy)} used fewer threads than asked: "
                "they do not follow torch.set_num_threads"
            )
    return lines


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
