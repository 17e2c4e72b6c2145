"""cpattn's CUDA kernels against torch SDPA (flash and cuDNN backends), same run, same inputs.

    python bench/gpu_bench.py [--out DIR] [--budget SECONDS] [--quick | --dry-run]

bf16, head dims 64 and 128, S = 4K..32K, causal and not; batch * seqlen = 16K tokens (one
sequence from 16K on) and heads * head_dim = 2048 (flash-attn's benchmark shapes). --dry-run runs
the same code on the CPU at one tiny shape (SDPA's GPU backends then report errors): a test of
this script, no figures. TFLOP/s in flash-attn's convention:
forward 4 * B * H * S^2 * D (halved for causal), backward 2.5x the forward. Times are medians of
CUDA-event-timed calls after warm-up; backward is torch.autograd.grad alone on a retained graph.
Each case also checks cpattn's output against SDPA flash (max abs difference). Writes
gpu_bench.json and gpu_bench.md to --out and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import cpattn
from cpattn.core.flops import attention_flops

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
except ImportError:  # pragma: no cover - older torch
    SDPBackend = sdpa_kernel = None


def flops(b, h, s, d, causal, mode):
    return attention_flops(b, h, s, s, d, causal, backward=mode == "bwd")


DEVICE = "cuda"


def time_ms(fn, reps, warmup=2):
    if DEVICE == "cpu":  # the dry run: wall clock
        fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) * 1e3 / reps
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def make_impls():
    impls = {"cpattn": None}
    if sdpa_kernel is not None:
        impls["sdpa_flash"] = SDPBackend.FLASH_ATTENTION
        impls["sdpa_cudnn"] = SDPBackend.CUDNN_ATTENTION
    return impls


def forward(impl, backend, q, k, v, causal):
    if impl == "cpattn":
        return cpattn.attention(q, k, v, causal=causal)
    with sdpa_kernel(backend):  # SDPA takes (B, H, S, D): transposed views of the same data
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=causal)
    return o.transpose(1, 2)


def bench_case(d, s, causal, reps, tiny=False):
    b, h = (1, 2) if tiny else (max(1, 16384 // s), 2048 // d)
    g = torch.Generator(device=DEVICE)
    g.manual_seed(s * 1000 + d + int(causal))
    q, k, v, dout = (torch.randn(b, s, h, d, device=DEVICE, generator=g, dtype=torch.bfloat16)
                     for _ in range(4))
    row = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal}
    ref = None
    for impl, backend in make_impls().items():
        try:
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            with torch.no_grad():
                out = forward(impl, backend, q, k, v, causal)
            if impl == "sdpa_flash":
                ref = out
            elif impl == "cpattn":
                row["cpattn_out"] = out
            ms = time_ms(lambda: forward(impl, backend, q, k, v, causal), reps)
            row[f"{impl}_fwd"] = flops(b, h, s, d, causal, "fwd") / ms / 1e9
            o = forward(impl, backend, qg, kg, vg, causal)
            ms = time_ms(lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True),
                         reps)
            row[f"{impl}_bwd"] = flops(b, h, s, d, causal, "bwd") / ms / 1e9
            o = qg = kg = vg = None  # freed before the next implementation runs
        except Exception as e:  # noqa: BLE001 - one backend failing must not stop the table
            row[f"{impl}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    out = row.pop("cpattn_out", None)
    if out is not None and ref is not None:
        row["max_abs_diff_vs_flash"] = (out.float() - ref.float()).abs().max().item()
    return row


def fmt(x):
    return f"{x:.0f}" if isinstance(x, float) and math.isfinite(x) else "-"


def table(rows):
    lines = ["| hd | S | causal | fwd cpattn | fwd flash | fwd cudnn | fwd ratio | bwd cpattn | "
             "bwd flash | bwd cudnn | bwd ratio | diff |",
             "|--:|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        def ratio(mode):
            a, b = r.get(f"cpattn_{mode}"), r.get(f"sdpa_flash_{mode}")
            return f"{a / b:.2f}" if a and b else "-"

        diff = r.get("max_abs_diff_vs_flash")
        lines.append(
            f"| {r['head_dim']} | {r['seqlen']} | {'y' if r['causal'] else 'n'} | "
            f"{fmt(r.get('cpattn_fwd'))} | {fmt(r.get('sdpa_flash_fwd'))} | "
            f"{fmt(r.get('sdpa_cudnn_fwd'))} | {ratio('fwd')} | {fmt(r.get('cpattn_bwd'))} | "
            f"{fmt(r.get('sdpa_flash_bwd'))} | {fmt(r.get('sdpa_cudnn_bwd'))} | {ratio('bwd')} | "
            f"{'-' if diff is None else f'{diff:.1e}'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget", type=float, default=150.0, help="seconds; later cases skipped")
    parser.add_argument("--quick", action="store_true", help="S = 4K, 8K only, fewer reps")
    parser.add_argument("--dry-run", action="store_true", help="CPU, one tiny shape per case")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("gpu_bench: no CUDA device")
        return 0
    os.makedirs(args.out, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    seqlens = [4096, 8192] if args.quick else [4096, 8192, 16384, 32768]
    reps = 5 if args.quick else args.reps
    if args.dry_run:
        seqlens, reps = [256], 1
    t0 = time.time()
    rows, skipped = [], 0
    # Most informative cases first (the target: hd 128, long S), so a cut budget keeps them.
    cases = [(d, s, c) for d in (128, 64) for s in seqlens for c in (False, True)]
    cases.sort(key=lambda x: (x[0] != 128, x[1] < 8192, x[1], x[2]))
    for d, s, causal in cases:
        if time.time() - t0 > args.budget:
            skipped += 1
            continue
        row = bench_case(d, s, causal, reps, tiny=args.dry_run)
        rows.append(row)
        errs = {k: v for k, v in row.items() if k.endswith("_error")}
        print(f"hd={d} S={s} causal={causal}: " + ", ".join(
            f"{k}={v:.0f}" for k, v in row.items() if k.endswith(("_fwd", "_bwd"))) +
            (f" errors={errs}" if errs else ""), flush=True)
    rows.sort(key=lambda r: (r["head_dim"], r["seqlen"], r["causal"]))
    info = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpattn": cpattn.build_info(),
        "units": "TFLOP/s (flash-attn convention), median of CUDA-event-timed calls",
        "skipped_for_budget": skipped,
        "rows": rows,
    }
    with open(os.path.join(args.out, "gpu_bench.json"), "w") as f:
        json.dump(info, f, indent=1, default=str)
    text = (f"{info['device']}, torch {info['torch']}, CUDA {info['cuda']}; bf16; TFLOP/s; "
            f"ratio = cpattn / sdpa_flash\n\n" + table(rows))
    with open(os.path.join(args.out, "gpu_bench.md"), "w") as f:
        f.write(text + "\n")
    if skipped:
        print(f"({skipped} cases skipped: budget {args.budget:.0f} s)")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
