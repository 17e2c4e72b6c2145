"""The report of bench/bench_attention.py: machine line, GEMM ceiling, table rows and header; Report
and cpu_model serve the other benchmarks too."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys

import torch

import cpattn
from cpattn.core.flops import BACKWARD_FLOP_FACTOR
from cpattn.core.layout import DTYPES
from cpattn.core.machine import ceiling_dtype, cpu_model, gemm_ceiling  # noqa: F401 (re-exported)

from attention_cases import Result


class Report:
    """A benchmark's markdown: a title and machine line, then each line printed as it comes;
    write() saves it all (the --out file)."""

    def __init__(self, title: str, setup: str = "") -> None:
        self.lines = [f"# {title}, {datetime.date.today()}",
                      f"CPU: {cpu_model()}, {os.cpu_count()} cores; torch {torch.__version__}; "
                      f"cpattn ISA {cpattn.build_info()['cpu_isa']}, GEMM path "
                      f"{gemm_paths()}{setup}", ""]

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                f.write("\n".join(self.lines) + "\n")


def gemm_paths() -> str:
    """How the CPU kernels run their products per dtype (build_info's cpu_gemm), and AMX."""
    info = cpattn.build_info()
    paths = ", ".join(f"{d} {p}" for d, p in info["cpu_gemm"].items())
    amx = info["cpu_amx"]
    return f"{paths} (AMX: on the CPU {amx['cpu']}, used {amx['usable']})"


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
        f"- cpattn {cpattn.__version__}, CPU ISA: {info['cpu_isa']}, GEMM path: {gemm_paths()}",
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
