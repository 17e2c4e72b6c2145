"""Command line.

    python -m cpattn demo    ring attention on W local ranks (gloo on CPU) vs one device
    python -m cpattn local   cpattn.attention on one device vs torch SDPA
    python -m cpattn generate-demo   greedy generation on W ranks with a sharded KV cache
    python -m cpattn plan    which strategy: the cost model's ranked table (and --plot FILE.png)
"""

import argparse
import sys

import torch
import torch.nn.functional as F

import cpattn
from cpattn.core.flops import BACKWARD_FLOP_FACTOR, attention_flops
from cpattn.core.layout import DTYPES, LAYOUTS
from cpattn.core.machine import ceiling_dtype, cpu_model, gemm_ceiling, interleaved_medians
from cpattn.testing.reference import reference_rows


def _local_dtype(args: argparse.Namespace, name: str) -> bool:
    """One dtype of `local`: its table; False when cpattn's error is beyond the tolerance."""
    dtype = DTYPES[name]
    b, s, h, d = args.batch, args.seqlen, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=gen).to(dtype) for _ in range(4))
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    qt, kt, vt = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
    out = cpattn.attention(qc, kc, vc, causal=args.causal)
    ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=args.causal)
    ours_grads = torch.autograd.grad(out, (qc, kc, vc), dout, retain_graph=True)
    sdpa_grads = torch.autograd.grad(ref, (qt, kt, vt), dout.transpose(1, 2), retain_graph=True)

    def forward(fn, inputs):
        def call():
            with torch.no_grad():
                fn(*inputs)
        return call

    fwd = interleaved_medians({
        "cpattn": forward(lambda *t: cpattn.attention(*t, causal=args.causal), (q, k, v)),
        "sdpa": forward(lambda *t: F.scaled_dot_product_attention(*t, is_causal=args.causal),
                        (qt, kt, vt))}, 1, args.reps)
    bwd = interleaved_medians({
        "cpattn": lambda: torch.autograd.grad(out, (qc, kc, vc), dout, retain_graph=True),
        "sdpa": lambda: torch.autograd.grad(ref, (qt, kt, vt), dout.transpose(1, 2),
                                            retain_graph=True)}, 1, args.reps)

    rows = torch.linspace(0, s - 1, steps=min(s, 64)).long()
    exact = reference_rows(q, k, v, rows, args.causal)
    err = (out.detach()[:, rows].double() - exact).abs().max().item()
    err_sdpa = (ref.detach().transpose(1, 2)[:, rows].double() - exact).abs().max().item()
    grad_diff = max((a.float() - bt.float().transpose(1, 2)).abs().max().item()
                    for a, bt in zip(ours_grads, sdpa_grads))

    flops = attention_flops(b, h, s, s, d, args.causal)
    ceiling = gemm_ceiling(dtype, args.threads)  # the same thread count
    info = cpattn.build_info()
    print(f"\n{name}, causal={args.causal}: cpattn's GEMM path {info['cpu_gemm'][name]}; "
          f"GEMM ceiling (torch.mm 2048^3, {ceiling_dtype(dtype)}) {ceiling:.0f} GFLOP/s\n")
    print("| | cpattn | torch SDPA | speed-up |")
    print("|---|---|---|---|")
    for label, t, f in (("forward", fwd, flops), ("backward", bwd, BACKWARD_FLOP_FACTOR * flops)):
        ours, theirs = f / t["cpattn"] / 1e9, f / t["sdpa"] / 1e9
        print(f"| {label} (s) | {t['cpattn']:.3f} | {t['sdpa']:.3f} | "
              f"{t['sdpa'] / t['cpattn']:.2f}x |")
        print(f"| {label} GFLOP/s | {ours:.1f} | {theirs:.1f} | |")
        print(f"| {label}, of the GEMM ceiling | {ours / ceiling:.2f} | {theirs / ceiling:.2f} | |")
    print(f"| max error vs float64 (64 rows) | {err:.2e} | {err_sdpa:.2e} | |")
    print(f"\nmax |grad cpattn - grad SDPA| over q, k, v: {grad_diff:.2e}")
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    if err > tolerance:
        print(f"FAILED: error {err:.2e} above {tolerance:.0e}")
        return False
    return True


def local(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    print(f"cpattn {cpattn.__version__} {cpattn.build_info()}")
    print(f"CPU: {cpu_model()}; torch {torch.__version__}")
    print(f"attention on one device: batch {args.batch}, seqlen {args.seqlen}, heads {args.heads}, "
          f"head_dim {args.head_dim}, {args.threads} thread(s); median of {args.reps} calls after "
          "a warm-up, cpattn and SDPA interleaved")
    ok = [_local_dtype(args, name) for name in args.dtype]
    return 0 if all(ok) else 1


def _count(text: str) -> int:
    """1024, 32K, 1M -> int (K = 1024, M = 1024 * 1024)."""
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqlen", type=_count, default=None, help="global tokens, e.g. 128K, 1M")
    p.add_argument("--documents", default=None,
                   help="packed document lengths (varlen), comma separated, e.g. 30K,2K,96K")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window", type=int, nargs=2, default=(-1, -1), metavar=("LEFT", "RIGHT"))
    p.add_argument("--mode", choices=["train", "forward", "prefill", "decode"], default="train")
    p.add_argument("--decode-tokens", type=int, default=1)
    p.add_argument("--world", type=int, default=8, help="ranks (W)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: the machine's")
    p.add_argument("--machine", default="h100-ib",
                   help="a preset (h100-ib, h200-ib, a100-ib, cpu-gloo) or a calibration file")
    p.add_argument("--plot", default=None, metavar="FILE.png",
                   help="also draw time and memory per rank against W and sequence length")
    p.add_argument("--mixer", default=None, metavar="LAYER",
                   help="also the state scan of a mixer layer: qwen3.5-27b, or KIND:HEADS:K:V"
                   "[:LAYERS] (KIND scalar, diagonal or matrix), e.g. matrix:48:128:128:48")
    p.add_argument("--mixer-layout", choices=["zigzag", "contiguous"], default="zigzag",
                   help="the sequence's layout for --mixer")


def plan_command(args: argparse.Namespace) -> int:
    import dataclasses

    from cpattn import plan as P

    machine = P.machine(args.machine)
    if args.ranks_per_node:
        machine = dataclasses.replace(machine, ranks_per_node=args.ranks_per_node)
    docs = tuple(_count(x) for x in args.documents.split(",")) if args.documents else None
    if args.seqlen is None and docs is None:
        print("python -m cpattn plan: give --seqlen or --documents", file=sys.stderr)
        return 2
    problem = P.Problem(
        args.seqlen or 0, args.heads, args.kv_heads or args.heads, args.head_dim,
        batch=args.batch, dtype=args.dtype, causal=args.causal, window=tuple(args.window),
        documents=docs, mode=args.mode, decode_tokens=args.decode_tokens)
    ranked, why = P.plan(problem, machine, args.world)
    print(f"machine: {machine.name} ({machine.source}); {machine.ranks_per_node} ranks per node")
    print(f"problem: {problem}")
    print(f"W = {args.world}\n")
    print(P.table(ranked))
    print(f"\nchoice: {why}")
    if docs is not None and problem.mode in ("train", "forward"):
        _document_plans(docs, problem, machine, args.world)
    if args.mixer:
        _mixer_scan(args.mixer, args.mixer_layout, args.batch, machine, args.world)
    if args.plot:
        from cpattn.plan.plot import plot_plan

        worlds = [w for w in (1, 2, 4, 8, 16, 32, 64, 128, 256) if w <= max(8, 4 * args.world)]
        seqlens = [problem.seqlen * f for f in (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1, 2, 4)]
        step = 2 * max(worlds) * max(args.heads, 1)
        seqlens = sorted({max(step, int(s) // step * step) for s in seqlens})
        plot_plan(problem, machine, worlds, seqlens, args.world, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _mixer_scan(spec: str, layout: str, batch: int, machine, world: int) -> None:
    """The mixers' state scan for a layer (a preset name or KIND:HEADS:K:V[:LAYERS]): both
    methods' model per rank and the choice (cpattn.plan.mixer_scan)."""
    import dataclasses

    from cpattn.plan import mixer_scan as S

    if spec in S.LAYERS:
        layer = dataclasses.replace(S.LAYERS[spec], batch=batch)
    else:
        parts = spec.split(":")
        if len(parts) not in (4, 5) or not all(x.isdigit() for x in parts[1:]):
            raise SystemExit(f"python -m cpattn plan: --mixer {spec!r}: must be one of "
                             f"{sorted(S.LAYERS)} or KIND:HEADS:K:V[:LAYERS]")
        layer = S.MixerLayer(spec, parts[0], *(int(x) for x in parts[1:]), batch=batch) \
            if len(parts) == 4 else S.MixerLayer(spec, parts[0], *(int(x) for x in parts[1:4]),
                                                 batch=batch, layers=int(parts[4]))
    traffic = S.tree_traffic(S.sequence_chains(layout, world), world)
    preds = S.predict_scan(layer, traffic, machine)
    print(f"\nmixer layer: {layer}; {layout} sequence; per rank and layer:")
    print(S.scan_table(layer, preds))
    print(f"choice: {S.explain_scan(layer, preds, world)}")


def _document_plans(docs, problem, machine, world: int) -> None:
    """The shardings of packed documents (cpattn.shard_documents) ranked by the model."""
    import cpattn
    from cpattn import plan as P

    cu = [0]
    for n in docs:
        cu.append(cu[-1] + n)
    plans = {s: cpattn.shard_documents(cu, world_size=world, causal=problem.causal,
                                       window=problem.window, split=s)
             for s in ("balanced", "all", "none")}
    ranked = P.plan_documents(plans, machine, heads=problem.heads, kv_heads=problem.kv_heads,
                              head_dim=problem.head_dim, dtype=problem.dtype,
                              training=problem.mode == "train")
    names = {id(d): s for s, d in reversed(plans.items())}
    print("\nsharding of the documents (cpattn.shard_documents, split=):")
    print("| split | documents split | time (ms) | sent per rank (MiB) | work max/min |")
    print("|---|---|---|---|---|")
    for d, pred in ranked:
        print(f"| {names[id(d)]} | {len(d.split)} of {len(d.lengths)} | {pred.time * 1e3:.4g} | "
              f"{pred.bytes_sent / 2**20:.4g} | {d.balance:.3f} |")
    print(f'split="auto" picks {names[id(ranked[0][0])]}: {ranked[0][0].describe()}')


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _worlds(text: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4]."""
    return [_positive(w) for w in text.split(",") if w.strip()]


def _shape_arguments(p: argparse.ArgumentParser, seqlen: int) -> None:
    """The problem options `demo` and `local` share."""
    p.add_argument("--seqlen", type=int, default=seqlen, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpattn")
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("demo", help="ring attention on W local ranks vs one device: time and "
                       "memory per rank against W")
    r.add_argument("--world", "--worlds", type=_worlds, nargs="+", default=[[1, 2, 4]],
                   help="ranks to spawn (W), one run each: e.g. 1,2,4 or 1 2 4 (default 1,2,4)")
    _shape_arguments(r, seqlen=4096)
    r.add_argument("--kv-heads", type=int, default=2)
    r.add_argument("--layout", choices=list(LAYOUTS), default="zigzag")
    r.add_argument("--iters", type=_positive, default=2, help="timed forward+backward steps")
    p = sub.add_parser("local", help="attention on a long sequence vs torch SDPA")
    _shape_arguments(p, seqlen=8192)
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["float32"],
                   help="one table per dtype (default float32)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--reps", type=_positive, default=3, help="timed calls per median")
    _plan_arguments(sub.add_parser(
        "plan", help="which strategy for a problem and machine: the cost model's ranking"))
    from cpattn.cli.generate_demo import add_arguments as _generate_arguments

    _generate_arguments(sub.add_parser(
        "generate-demo", help="greedy generation on W ranks with a sharded KV cache"))
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command(args)
    if args.command == "generate-demo":
        from cpattn.cli.generate_demo import generate_demo

        return generate_demo(args)
    if args.command == "demo":
        from cpattn.cli.demo import ring_demo

        args.world = [w for ws in args.world for w in ws]

        return ring_demo(args)
    return local(args)


if __name__ == "__main__":
    sys.exit(main())
