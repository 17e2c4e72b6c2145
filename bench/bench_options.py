"""Cost of each score option (sinks, softcap, ALiBi, prefix-LM) in the CPU kernel relative to plain
causal attention, in the same run: cpattn.attention forward and forward+backward, the variants
interleaved round by round so that machine noise hits them alike; min and median per variant.

    python bench/bench_options.py                  # every variant, fp32 and bf16
    python bench/bench_options.py --plain-only     # plain causal only: also runs on older builds
                                                   # (e.g. main's wheel) to compare the plain path
    python bench/bench_options.py --baseline /path/to/old/venv/bin/python
        # then "plain path not slower than before": plain causal (cpattn.attention, and the
        # ring's work of rank 0 at W=2 with the shifts as local copies) timed by this build and
        # by the baseline interpreter's build (its own installed cpattn), alternating --repeats
        # times in subprocesses (--plain-only --json), min over all rounds of each side

Prints markdown tables (times in ms, ratio = median / plain median; baseline ratio = this
build's min / the baseline's min).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import cpattn

VARIANTS = {
    "plain causal": {},
    "sinks": {"sinks": True},
    "softcap 30": {"softcap": 30.0},
    "ALiBi": {"alibi_slopes": True},
    "prefix 256": {"prefix_len": 256},
    "all four": {"sinks": True, "softcap": 30.0, "alibi_slopes": True, "prefix_len": 256},
}


def options(spec: dict, heads: int) -> dict:
    kwargs = {}
    if spec.get("sinks"):
        kwargs["sinks"] = torch.randn(heads).requires_grad_()
    if spec.get("alibi_slopes"):
        kwargs["alibi_slopes"] = torch.rand(heads) * 0.1
    for key in ("softcap", "prefix_len"):
        if key in spec:
            kwargs[key] = spec[key]
    return kwargs


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--plain-only", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the raw times as JSON only")
    parser.add_argument("--baseline", help="python of an older build to compare the plain path")
    parser.add_argument("--repeats", type=int, default=4, help="alternations with --baseline")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"plain causal": {}} if args.plain_only else VARIANTS
    times = measure(args, variants)
    if args.json:
        print(json.dumps(times))
        return
    print(f"cpattn {cpattn.__file__}, cpu isa {cpattn.build_info().get('cpu_isa')}, "
          f"{args.threads} threads, B=1 S={args.seqlen} H={args.heads} D={args.head_dim}, "
          f"{args.rounds} interleaved rounds (min / median ms)\n")
    print("| dtype | variant | fwd min | fwd median | fwd ratio | fwd+bwd min | fwd+bwd median "
          "| fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype, per_variant in times.items():
        base_f = statistics.median(per_variant["plain causal"]["fwd"])
        base_b = statistics.median(per_variant["plain causal"]["bwd"])
        for name, t in per_variant.items():
            mf, mb = statistics.median(t["fwd"]), statistics.median(t["bwd"])
            print(f"| {dtype} | {name} | {min(t['fwd']) * 1e3:.1f} | {mf * 1e3:.1f} | "
                  f"{mf / base_f:.3f} | {min(t['bwd']) * 1e3:.1f} | {mb * 1e3:.1f} | "
                  f"{mb / base_b:.3f} |")
    if args.baseline:
        compare_plain(args)


def compare_plain(args) -> None:
    """Plain causal, this build against the baseline interpreter's, in alternating
    subprocesses (so that machine noise hits both alike); min over every round of each side."""
    cmd = [__file__, "--plain-only", "--json", "--seqlen", str(args.seqlen), "--heads",
           str(args.heads), "--head-dim", str(args.head_dim), "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--dtypes", args.dtypes]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {"baseline": args.baseline, "this build": sys.executable}
    best: dict = {side: {} for side in sides}  # (dtype, path) -> (fwd min, fwd+bwd min)
    for _ in range(args.repeats):
        for side, python in sides.items():
            out = subprocess.run([python, *cmd], env=env, check=True, capture_output=True,
                                 text=True, cwd="/tmp").stdout
            for dtype, per_variant in json.loads(out.splitlines()[-1]).items():
                for path, t in per_variant.items():
                    old = best[side].get((dtype, path), (float("inf"), float("inf")))
                    best[side][dtype, path] = (min(old[0], min(t["fwd"])),
                                               min(old[1], min(t["bwd"])))
    print(f"\nPlain path, this build ({sys.executable}) vs baseline ({args.baseline}): "
          f"{args.repeats} alternating runs of {args.rounds} rounds each, min (ms)\n")
    print("| dtype | path | baseline fwd | this fwd | ratio | baseline fwd+bwd | this fwd+bwd "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for (dtype, path), (bf, bb) in best["baseline"].items():
        tf, tb = best["this build"][dtype, path]
        print(f"| {dtype} | {path} | {bf * 1e3:.1f} | {tf * 1e3:.1f} | {tf / bf:.3f} | "
              f"{bb * 1e3:.1f} | {tb * 1e3:.1f} | {tb / bb:.3f} |")


def loopback_op():
    """The ring's loopback timing op as f(q, k, v, dout, rank, world, layout, **options): in
    cpattn_testing (loaded by cpattn.testing.emulation.load_ops), or in cpattn in older builds,
    whose schema took the options positionally before the layout (so that --baseline can run on
    them)."""
    try:
        from cpattn.testing.emulation import load_ops
    except ImportError:  # an older build: the op is in cpattn itself
        pass
    else:
        load_ops()
    for namespace in (torch.ops.cpattn_testing, torch.ops.cpattn):
        if not hasattr(namespace, "ring_loopback_timing"):
            continue
        op = namespace.ring_loopback_timing
        if [a.name for a in op.default._schema.arguments][6] == "layout":
            return op

        def positional(q, k, v, dout, rank, world, layout, softmax_scale, causal=False,
                       window_left=-1, window_right=-1, op=op):
            return op(q, k, v, dout, rank, world, softmax_scale, causal, window_left,
                      window_right, layout)

        return positional
    raise RuntimeError("bench_options: this cpattn build has no ring_loopback_timing op")


def measure(args, variants: dict) -> dict:
    """{dtype: {variant: {"fwd": [s, ...], "bwd": [s, ...]}}}, the variants interleaved."""
    times = {}
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        gen = torch.Generator().manual_seed(0)
        shape = (1, args.seqlen, args.heads, args.head_dim)
        q, k, v, dout = (torch.randn(shape, generator=gen).to(dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_(True)
        kwargs = {name: options(spec, args.heads) for name, spec in variants.items()}

        def forward(name):
            with torch.no_grad():
                cpattn.attention(q, k, v, causal=True, **kwargs[name])

        def both(name):
            out = cpattn.attention(q, k, v, causal=True, **kwargs[name])
            leaves = [q, k, v] + ([kwargs[name]["sinks"]] if "sinks" in kwargs[name] else [])
            torch.autograd.grad(out, leaves, dout)

        fwd = {name: [] for name in variants}
        bwd = {name: [] for name in variants}
        for name in variants:  # warm-up
            forward(name)
            both(name)
        for _ in range(args.rounds):
            for name in variants:
                fwd[name].append(timed(lambda: forward(name)))
                bwd[name].append(timed(lambda: both(name)))
        times[str(dtype).replace("torch.", "")] = {
            name: {"fwd": fwd[name], "bwd": bwd[name]} for name in variants}
        if args.plain_only:  # the plain ring path too: rank 0 of W=2, shifts as local copies
            shard = [t.detach()[:, : args.seqlen // 2] for t in (q, k, v, dout)]
            ring = {"fwd": [], "bwd": []}
            for _ in range(args.rounds + 1):
                f, b = loopback_op()(*shard, 0, 2, 1, softmax_scale=args.head_dim ** -0.5,
                                     causal=True).tolist()
                ring["fwd"].append(f)
                ring["bwd"].append(f + b)
            times[str(dtype).replace("torch.", "")]["ring W=2 zigzag (loopback)"] = {
                key: values[1:] for key, values in ring.items()}  # without the warm-up
    return times


if __name__ == "__main__":
    main()
