"""What a benchmark says about the machine it ran on: the CPU model, the GEMM ceiling and the
interleaved timing of calls, for bench/ and `python -m cpattn local` alike."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, as lscpu prints it (or platform's guess)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ceiling_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose GEMM bounds attention in `dtype`: fp16 has no dot-product instruction on
    these CPUs, so it runs as fp32 products (exact), and torch.mm in fp16 is no GEMM ceiling."""
    return torch.float32 if dtype == torch.float16 else dtype


_CEILINGS: dict[tuple[torch.dtype, int, int], float] = {}


def gemm_ceiling(dtype: torch.dtype, threads: int, size: int = 2048) -> float:
    """GFLOP/s of torch.mm (size^3) in this dtype and thread count: the machine's practical
    ceiling for the matrix products attention is made of. Measured once per (dtype, threads,
    size), best of 7; leaves torch's thread count at `threads`."""
    dtype = ceiling_dtype(dtype)
    key = (dtype, threads, size)
    if key not in _CEILINGS:
        torch.set_num_threads(threads)
        a, b = (torch.randn(size, size).to(dtype) for _ in range(2))
        torch.mm(a, b)
        times = []
        for _ in range(7):  # the best of several: a GEMM is as fast as the machine lets it be
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
        _CEILINGS[key] = 2 * size**3 / min(times) / 1e9
    return _CEILINGS[key]


def interleaved_medians(fns: dict[str, Callable[[], object]], warmup: int, reps: int
                        ) -> dict[str, float]:
    """Median wall-clock seconds per call of each no-argument function over `reps` calls after
    `warmup` ones, the functions interleaved call by call (drift in load hits all alike)."""
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
