"""Command line.

    python -m cpattn demo    ring attention on W local ranks (gloo on CPU) vs one device
    python -m cpattn local   cpattn.attention on one device vs torch SDPA
    python -m cpattn generate-demo   greedy generation on W ranks with a sharded KV cache
"""

import argparse
import math
import sys
import time

import torch
import torch.nn.functional as F

import cpattn


def _reference_rows(q, k, v, rows, causal, scale):
    """float64 attention output for a sample of query rows (the full matrix would not fit)."""
    qs = q[:, rows].double()
    s = torch.einsum("bqhd,bkhd->bhqk", qs, k.double()) * scale
    if causal:
        keys = torch.arange(k.shape[1])
        hidden = keys[None, :] > torch.as_tensor(rows)[:, None] + (k.shape[1] - q.shape[1])
        s = s.masked_fill(hidden, -math.inf)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v.double())


def _timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def local(args: argparse.Namespace) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    q, k, v = (torch.randn(b, s, h, d, dtype=dtype) for _ in range(3))
    dout = torch.randn(b, s, h, d, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    print(f"cpattn {cpattn.__version__} {cpattn.build_info()}")
    print(f"attention on one device: batch {b}, seqlen {s}, heads {h}, head_dim {d}, {args.dtype}, "
          f"causal={args.causal}, {args.threads} thread(s)")

    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    out, t_fwd = _timed(lambda: cpattn.attention(qc, kc, vc, causal=args.causal))
    _, t_bwd = _timed(lambda: out.backward(dout))

    qt, kt, vt = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    ref, s_fwd = _timed(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal))
    _, s_bwd = _timed(lambda: ref.backward(dout.transpose(1, 2)))

    rows = torch.linspace(0, s - 1, steps=min(s, 64)).long()
    exact = _reference_rows(q, k, v, rows, args.causal, scale)
    err = (out[:, rows].double() - exact).abs().max().item()
    err_sdpa = (ref.transpose(1, 2)[:, rows].double() - exact).abs().max().item()
    grad_diff = max(
        (a.grad - bt.grad.transpose(1, 2)).abs().max().item()
        for a, bt in ((qc, qt), (kc, kt), (vc, vt))
    )

    flops = 4 * b * h * s * s * d / (2 if args.causal else 1)
    print()
    print("| | cpattn | torch SDPA | speed-up |")
    print("|---|---|---|---|")
    print(f"| forward (s) | {t_fwd:.3f} | {s_fwd:.3f} | {s_fwd / t_fwd:.2f}x |")
    print(f"| backward (s) | {t_bwd:.3f} | {s_bwd:.3f} | {s_bwd / t_bwd:.2f}x |")
    print(f"| forward GFLOP/s | {flops / t_fwd / 1e9:.1f} | {flops / s_fwd / 1e9:.1f} | |")
    print(f"| backward GFLOP/s | {2.5 * flops / t_bwd / 1e9:.1f} | {2.5 * flops / s_bwd / 1e9:.1f} | |")
    print(f"| max error vs float64 (64 rows) | {err:.2e} | {err_sdpa:.2e} | |")
    print(f"\nmax |grad cpattn - grad SDPA| over q, k, v: {grad_diff:.2e}")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if err > tolerance:
        print(f"FAILED: error {err:.2e} above {tolerance:.0e}")
        return 1
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpattn")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("demo", help="ring attention on W local ranks vs one device")
    r.add_argument("--world", type=int, default=2, help="ranks to spawn (W)")
    r.add_argument("--seqlen", type=int, default=16384, help="global sequence length")
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--heads", type=int, default=8)
    r.add_argument("--kv-heads", type=int, default=2)
    r.add_argument("--head-dim", type=int, default=64)
    r.add_argument("--layout", choices=["zigzag", "contiguous", "striped"], default="zigzag")
    r.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--iters", type=int, default=2, help="timed forward+backward steps")
    p = sub.add_parser("local", help="attention on a long sequence vs torch SDPA")
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    from cpattn._generate_demo import add_arguments as _generate_arguments

    _generate_arguments(sub.add_parser(
        "generate-demo", help="greedy generation on W ranks with a sharded KV cache"))
    args = parser.parse_args(argv)
    if args.command == "generate-demo":
        from cpattn._generate_demo import generate_demo

        return generate_demo(args)
    if args.command == "demo":
        from cpattn._demo import ring_demo

        return ring_demo(args)
    return local(args)


if __name__ == "__main__":
    sys.exit(main())
