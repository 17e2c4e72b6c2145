#!/usr/bin/env python3
"""Times the local CPU kernel's backward (or with --pass fwd its forward; cpattn.attention, causal
unless --causal no) of two builds of cpattn in the same run: each build is an installed copy of
the package (a directory to put on sys.path); the builds alternate repeat by repeat, each repeat
a fresh process, so that drift in machine load hits both alike. Reports per case and build the
min and median over the repeats of the median time of each process (backward:
torch.autograd.grad on a graph built once, no forward inside; forward: under no_grad). --clock
cpu times the process's CPU seconds instead of the wall clock: at one thread, the kernel's time
without the waits that other processes on a shared machine add.

A build may also set environment variables for its processes, `name=path,VAR=VALUE,...` (a
value may hold commas: a part without "=" continues it): the same build on two kernel paths,
for instance (CPATTN_CPU_GEMM, docs/environment.md).

Example (the previous build installed with `pip install --no-deps --target /tmp/before .` from
its checkout, this one in the venv):
  python bench/bench_kernel_ab.py --builds before=/tmp/before after=$(python -c \\
      "import cpattn, os; print(os.path.dirname(os.path.dirname(cpattn.__file__)))")
  python bench/bench_kernel_ab.py --builds micro=$SITE,CPATTN_CPU_GEMM=micro \\
      brgemm=$SITE,CPATTN_CPU_GEMM=brgemm
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# (dtype, seqlen, heads, kv heads, head_dim): a Ulysses rank's local problem (MHA, GQA)
CASES = [
    ("float32", 4096, 4, 4, 128),
    ("float32", 4096, 4, 1, 128),
    ("float32", 4096, 8, 8, 64),
    ("bfloat16", 4096, 4, 1, 128),
    # backward in groups of KV heads (csrc/ops/attention_cpu.cpp): one KV head per call, two, one
    ("bfloat16", 8192, 4, 4, 128),
    ("bfloat16", 4096, 8, 8, 64),
    ("float32", 4096, 4, 4, 72),
    # GQA with one or two (batch, KV head) pairs: chunks shortened by the key splits
    ("float32", 4096, 8, 2, 128),
    ("float32", 4096, 8, 1, 64),
]


def _child(case: list, threads: int, calls: int, forward: bool, causal: bool, cpu: bool) -> None:
    """Prints the median backward (forward) time (s) of `calls` calls after one warm-up: wall
    clock, or with `cpu` the process's CPU time (at one thread the kernel's own time, which
    other processes on a shared machine do not stretch as they stretch the wall clock)."""
    import time

    import torch

    import cpattn

    torch.set_num_threads(threads)
    dtype, s, h, hkv, d = case
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, s, n, d, generator=gen).to(getattr(torch, dtype)).requires_grad_()
               for n in (h, hkv, hkv))
    dout = torch.randn(1, s, h, d, generator=gen).to(q.dtype)
    out = None if forward else cpattn.attention(q, k, v, causal=causal)
    clock = time.process_time if cpu else time.perf_counter
    times = []
    for _ in range(calls + 1):
        t0 = clock()
        if forward:
            with torch.no_grad():
                cpattn.attention(q, k, v, causal=causal)
        else:
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        times.append(clock() - t0)
    print(json.dumps(statistics.median(times[1:])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--builds", nargs="+", default=[],
                   help="name=path-of-the-installed-package[,VAR=VALUE...]")
    p.add_argument("--cases", nargs="+", type=int, default=list(range(len(CASES))),
                   help="indices into CASES")
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--pass", dest="direction", choices=["bwd", "fwd"], default="bwd")
    p.add_argument("--causal", choices=["yes", "no"], default="yes")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: the process's CPU seconds (a speed only at one thread)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        case, threads = json.loads(a.child)
        return _child(case, threads, a.calls, a.direction == "fwd", a.causal == "yes",
                      a.clock == "cpu")
    builds = dict(b.split("=", 1) for b in a.builds)
    print("| dtype | S | heads | kv heads | D | threads | "
          + " | ".join(f"{n} min / median (s)" for n in builds) + " |")
    print("|---|--:|--:|--:|--:|--:|" + "--:|" * len(builds))
    for case in (CASES[i] for i in a.cases):
        for threads in a.threads:
            times: dict[str, list[float]] = {n: [] for n in builds}
            for _ in range(a.repeats):
                for name, spec in builds.items():
                    path, *items = spec.split(",")
                    env = dict(os.environ, PYTHONPATH=path)
                    var = None
                    for item in items:  # an item without "=" continues the previous value
                        if "=" in item:
                            var, value = item.split("=", 1)
                            env[var] = value
                        elif var:
                            env[var] += "," + item
                    r = subprocess.run(
                        [sys.executable, __file__, "--calls", str(a.calls), "--pass", a.direction,
                         "--causal", a.causal, "--clock", a.clock,
                         "--child", json.dumps([case, threads])],
                        env=env, check=True, capture_output=True, text=True, cwd="/tmp")
                    times[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            cells = " | ".join(f"{min(t):.3f} / {statistics.median(t):.3f}"
                               for t in times.values())
            print(f"| {' | '.join(map(str, case))} | {threads} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
