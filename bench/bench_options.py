"""Cost of each score option (sinks, softcap, ALiBi, prefix-LM) in the CPU kernel relative to plain
causal attention, in the same run: cpattn.attention forward and forward+backward, the variants
interleaved round by round so that machine noise hits them alike; min and median per variant.

    python bench/bench_options.py                  # every variant, fp32 and bf16
    python bench/bench_options.py --plain-only     # plain causal only: also runs on older builds
                                                   # (e.g. main's wheel) to compare the plain path

Prints a markdown table (times in ms, ratio = median / plain median).
"""

from __future__ import annotations

import argparse
import statistics
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"plain causal": {}} if args.plain_only else VARIANTS
    print(f"cpattn {cpattn.__file__}, cpu isa {cpattn.build_info().get('cpu_isa')}, "
          f"{args.threads} threads, B=1 S={args.seqlen} H={args.heads} D={args.head_dim}, "
          f"{args.rounds} interleaved rounds (min / median ms)\n")
    print("| dtype | variant | fwd min | fwd median | fwd ratio | fwd+bwd min | fwd+bwd median "
          "| fwd+bwd ratio |")
    print("|---|---|---|---|---|---|---|---|")
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
        base_f = statistics.median(fwd["plain causal"])
        base_b = statistics.median(bwd["plain causal"])
        for name in variants:
            mf, mb = statistics.median(fwd[name]), statistics.median(bwd[name])
            print(f"| {str(dtype).replace('torch.', '')} | {name} | {min(fwd[name]) * 1e3:.1f} | "
                  f"{mf * 1e3:.1f} | {mf / base_f:.3f} | {min(bwd[name]) * 1e3:.1f} | "
                  f"{mb * 1e3:.1f} | {mb / base_b:.3f} |")


if __name__ == "__main__":
    main()
