#!/usr/bin/env python3
"""Registers and spills per CUDA kernel, from a build log compiled with -Xptxas=-v
(CPATTN_CUDA_PTXAS_VERBOSE=ON).

    python .ci/ptxas_report.py BUILD_LOG [--out REPORT] [--fail-on-spill PATTERN ...]

Prints one line per (kernel, arch): registers, spill stores / loads, stack frame, shared memory
is dynamic (not reported by ptxas). Exits 1 when a kernel whose mangled name contains one of the
--fail-on-spill patterns spills, or when the log holds no ptxas report at all.
"""

from __future__ import annotations

import argparse
import re
import sys

ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(\w+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")


def short(mangled: str) -> str:
    name = re.sub(r"^_ZN6cpattn4cuda(\d+)", "", mangled)
    kernel = re.match(r"[a-z_]+", re.sub(r"^\d+", "", name))
    cfg = re.search(r"Config(?:For)?ILi(\d+)E", mangled) or re.search(r"ILi(\d+)E", mangled)
    dtype = "bf16" if "bfloat16" in mangled else ("fp16" if "__half" in mangled else "")
    # The output / gradient type is the last template argument: float ("f") or the input type.
    out = "f32out" if re.search(r"(bfloat16|__half)fE|EfEEv|IfS?\d*_?E|If13|If6|fLb[01]E",
                                mangled) else ""
    # The scored instantiations (kScored = true, fwd_kernel.cuh, bwd_kernel.cuh) and the dK/dV
    # kernel's accumulate one (kAccumulate, the bool after kScored).
    flags = re.search(r"Lb([01])E(?:Lb([01])E)?EEv", mangled)
    scored = "scored" if flags and flags.group(1) == "1" else ""
    acc = "acc" if flags and flags.group(2) == "1" else ""
    parts = [kernel.group(0) if kernel else name[:40]]
    if cfg:
        parts.append(f"hd{cfg.group(1)}")
    parts += [p for p in (dtype, out, scored, acc) if p]
    return " ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--out")
    parser.add_argument("--fail-on-spill", nargs="*", default=[])
    args = parser.parse_args()
    rows, kernel, arch, frame = [], None, None, None
    seen = set()
    for line in open(args.log, errors="replace"):
        m = ENTRY.search(line)
        if m:
            kernel, arch, frame = m.group(1), m.group(2), None
            continue
        m = FRAME.search(line)
        if m and kernel:
            frame = tuple(int(x) for x in m.groups())
            continue
        m = USED.search(line)
        if m and kernel and frame is not None:
            key = (kernel, arch)
            if key not in seen:
                seen.add(key)
                rows.append((kernel, arch, int(m.group(1)), *frame))
            kernel = None
    if not rows:
        print("ptxas_report: no ptxas -v output in", args.log)
        return 1
    lines = [f"{'kernel':56s} {'arch':6s} {'regs':>4s} {'spill st/ld':>11s} {'stack':>5s}"]
    bad = []
    for kernel, arch, regs, stack, st, ld in sorted(rows, key=lambda r: (short(r[0]), r[1])):
        lines.append(f"{short(kernel)[:56]:56s} {arch:6s} {regs:4d} {f'{st}/{ld}':>11s} {stack:5d}")
        if st and any(p in kernel for p in args.fail_on_spill):
            bad.append(lines[-1])
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if bad:
        print("ptxas_report: spills in kernels that must not spill:\n" + "\n".join(bad))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
