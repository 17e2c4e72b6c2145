"""One gated delta rule layer and one Mamba-2 layer under context parallelism on the GPU, in
bf16 (issue 54 item 6): the stage hybrid_cp of bench/gpu_check.sh.

    python bench/gpu_hybrid.py [--out DIR] [--world 4] [--seqlen 8192] [--dry-run]

Layers: the token mixers of bench/bench_hybrid_cp.py's models (bench/hybrid_cp_models.py:
Qwen3_5GatedDeltaNet and NemotronHMamba2Mixer, hidden 512), fp32 parameters under
torch.autocast(bfloat16), forward and backward of a fixed random upstream gradient. Per layer:
  cp     W zigzag ranks emulated in one process (cpattn.testing.mixers.emulate: a thread per
         rank, the exchange a stack of the ranks' tensors), each running cpattn's adapter of the
         module on its tokens (the code a rank runs, with the halo and the state scan)
  own    the module's own forward on the whole sequence (transformers' path on this machine:
         flash-linear-attention / mamba_ssm kernels where installed, else its torch reference)
  truth  the module's own forward and backward in float64 on the CPU
Check: the output, the input gradient and the parameters' gradients (each against its largest
entry, at least 1 % of the largest parameter gradient) of cp and own against the truth; PASS
when cp is within 2x of own's distance (+1e-4), the rule of issue 54 item 2.
local  where a fast kernel is installed (fla for the delta rule, mamba_ssm for Mamba-2): the
       module's own forward + backward on one rank's S / W tokens (the local piece, its kernels)
       against cpattn's torch path on the same tokens (the adapter with one piece), both against
       their float64 truth, timed alike; else SKIP (both would be torch code).
Times: CUDA events, median of 5 after 2 warm-ups (the emulated ranks run one after another on
the one GPU: cp's time is all W ranks' work, about W x one rank's).

The last line is `hybrid_cp: PASS|FAIL|SKIP (figures)`; gpu_hybrid.json goes to --out. Exit
status 1 on FAIL. --dry-run: the same on the CPU with small layers (hidden 64), S = 512, W = 2
(a check of this script; wall clock, one call; fast kernels not looked for). --ablate: the
ranks without the exchange (each rank's pieces alone), which the check must FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import io
import json
import logging
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybrid_cp_models import config  # noqa: E402 - the models of the CPU benchmark

FAST = {"gdn": "fla", "mamba2": "mamba_ssm"}  # the fast kernels' packages, by layer


def mixer(kind: str, small: bool) -> torch.nn.Module:
    """The first mixer module of bench_hybrid_cp's model `kind` (fp32, training mode)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(kind, small), dtype=torch.float32)
    layer = model.model.layers[0]
    return (layer.linear_attn if kind == "gdn" else layer.mixer).train()


def adapter_of(module: torch.nn.Module):
    """cpattn's adapter of the module's class: adapter(module, x, mixing) -> its output."""
    importlib.import_module("cpattn.integrations.hybrid.adapters")  # (registers them)
    from cpattn.integrations.hybrid.registry import adapter_of as find

    found = find(module)
    if found is None:
        raise ValueError(f"gpu_hybrid: cpattn has no adapter for {type(module).__name__}")
    return found.fn


def autocast(device: str):
    return torch.autocast(device, torch.bfloat16)


def run_own(module, x, grad):
    """(output, input gradient, parameter gradients) of the module's own forward + backward."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with autocast(x.device.type) if x.dtype != torch.float64 else contextlib.nullcontext():
        y = module(x)
    y = y[0] if isinstance(y, tuple) else y
    (y.to(grad.dtype) * grad).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()
                                if p.grad is not None}


def run_cp(module, x, grad, world: int, ablate: bool = False):
    """The same as run_own, by W emulated ranks (zigzag) running cpattn's adapter (ablate: each
    rank's pieces alone, zeros for the other ranks' halos and summaries)."""
    from cpattn.core.layout import shard_positions
    from cpattn.mixers import build_piece_map
    from cpattn.mixers.mixing import Mixing
    from cpattn.testing.mixers import emulate

    seqlen = x.shape[1]
    index = [shard_positions(seqlen, "zigzag", world, r).to(x.device) for r in range(world)]
    piece_map = build_piece_map([i.cpu() for i in index], (0, seqlen))
    adapter = adapter_of(module)
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)

    def rank(r, exchange):
        if ablate:
            exchange = lambda t: t.new_zeros((world, *t.shape))  # noqa: E731
        with autocast(x.device.type):
            out = adapter(module, x[:, index[r]], Mixing(piece_map, r, exchange, 1))
        return out[0] if isinstance(out, tuple) else out

    parts = emulate(world, rank)
    y = torch.empty((*x.shape[:2], parts[0].shape[-1]), dtype=parts[0].dtype, device=x.device)
    for r, part in enumerate(parts):
        y = y.index_copy(1, index[r], part)
    (y.to(grad.dtype) * grad).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()
                                if p.grad is not None}


def distance(got, truth) -> dict:
    """Relative distances of (output, input grad, param grads) to the float64 truth's."""
    def rel(a, b):
        return float((a.double().cpu() - b).abs().max() / b.abs().max().clamp_min(1e-30))

    largest = max(float(g.abs().max()) for g in truth[2].values())
    params = max(float((got[2][n].double().cpu() - g).abs().max())
                 / max(float(g.abs().max()), 1e-2 * largest) for n, g in truth[2].items())
    return {"out": rel(got[0], truth[0]), "dx": rel(got[1], truth[1]), "params": params}


def timed(fn, device: str) -> float:
    """Median seconds of fn(): CUDA events, 5 calls after 2 warm-ups (the CPU: one call)."""
    reps, warmup = (5, 2) if device == "cuda" else (1, 0)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def truth_of(module, x, grad):
    return run_own(copy.deepcopy(module).double().cpu(), x.double().cpu(), grad.double().cpu())


def layer(kind: str, world: int, seqlen: int, device: str, small: bool,
          ablate: bool = False) -> dict:
    """Every figure of one layer (see the module docstring)."""
    module = mixer(kind, small).to(device)
    gen = torch.Generator().manual_seed(54)
    hidden = module.out_proj.in_features if kind == "gdn" else module.hidden_size
    x = torch.randn(1, seqlen, hidden, generator=gen).to(device)
    grad = torch.randn(1, seqlen, module.out_proj.out_features, generator=gen).to(device)
    log = io.StringIO()  # transformers says when it falls back to its torch reference
    handler = logging.StreamHandler(log)
    logging.getLogger("transformers").addHandler(handler)
    try:
        truth = truth_of(module, x, grad)
        own, cp = run_own(module, x, grad), run_cp(module, x, grad, world, ablate)
        row = {"layer": type(module).__name__, "world": world, "seqlen": seqlen,
               "own": distance(own, truth), "cp": distance(cp, truth),
               "t_own": timed(lambda: run_own(module, x, grad), device),
               "t_cp": timed(lambda: run_cp(module, x, grad, world, ablate), device)}
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    row["fallback"] = sorted({line.split("`")[1] for line in log.getvalue().splitlines()
                              if "falling back" in line and "`" in line})
    row["ok"] = all(row["cp"][k] <= 2 * row["own"][k] + 1e-4 for k in row["cp"])
    package = FAST[kind]
    if device != "cuda" or importlib.util.find_spec(package) is None:
        row["local"] = f"SKIP ({package} not installed)" if device == "cuda" else "SKIP (dry run)"
        return row
    # The local piece: one rank's S / W tokens as a sequence of their own.
    xs, gs = x[:, :seqlen // world], grad[:, :seqlen // world]
    truth = truth_of(module, xs, gs)
    row["local"] = {"fast": distance(run_own(module, xs, gs), truth),
                    "torch": distance(run_cp(module, xs, gs, 1), truth),
                    "t_fast": timed(lambda: run_own(module, xs, gs), device),
                    "t_torch": timed(lambda: run_cp(module, xs, gs, 1), device)}
    local = row["local"]
    row["ok"] = row["ok"] and all(local["fast"][k] <= 2 * local["torch"][k] + 1e-4
                                  for k in local["fast"])
    return row


def summary(row: dict) -> str:
    """One layer's figures, in a line."""
    def errors(d):
        return "/".join(f"{d[k]:.1e}" for k in ("out", "dx", "params"))

    fallback = f" (torch reference: {', '.join(row['fallback'])})" if row["fallback"] else ""
    text = (f"{row['layer']} W={row['world']} S={row['seqlen']}: err out/dx/params cp "
            f"{errors(row['cp'])} vs own {errors(row['own'])}; fwd+bwd cp "
            f"{row['t_cp'] * 1e3:.1f} ms (all ranks), own {row['t_own'] * 1e3:.1f} ms{fallback}")
    local = row["local"]
    if isinstance(local, str):
        return f"{text}; local: {local}"
    return (f"{text}; local {row['seqlen'] // row['world']} tokens: fast {errors(local['fast'])} "
            f"{local['t_fast'] * 1e3:.1f} ms, torch {errors(local['torch'])} "
            f"{local['t_torch'] * 1e3:.1f} ms")


def short(row: dict) -> str:
    """The figures of one layer for gpu_check's summary line."""
    if "error" in row:
        return f"{row['layer']}: {row['error']}"
    worst = max(row["cp"].values()), max(row["own"].values())
    text = (f"{row['layer']}: err {worst[0]:.1e} (own {worst[1]:.1e}), "
            f"{row['t_cp'] * 1e3:.0f} ms (own {row['t_own'] * 1e3:.0f})")
    if isinstance(row["local"], dict):
        text += (f", local fast {row['local']['t_fast'] * 1e3:.0f} ms "
                 f"(torch {row['local']['t_torch'] * 1e3:.0f})")
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=8192)
    p.add_argument("--dry-run", action="store_true", help="CPU, small layers (hidden 64)")
    p.add_argument("--ablate", action="store_true",
                   help="ranks without the exchange (the check must FAIL)")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        print("hybrid_cp: SKIP (no CUDA device)")
        return 0
    if args.dry_run:
        args.world, args.seqlen = 2, 512
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # (the fp32 parts as fp32)
    rows, failed = [], []
    for kind in ("gdn", "mamba2"):
        try:
            row = layer(kind, args.world, args.seqlen, device, args.dry_run, args.ablate)
        except Exception as e:  # noqa: BLE001 - reported as this layer's failure
            traceback.print_exc()
            row = {"layer": kind, "error": f"{type(e).__name__}: {str(e)[:200]}", "ok": False}
        rows.append(row)
        print(row.get("error") or summary(row), flush=True)
        if not row["ok"]:
            failed.append(row["layer"])
    with open(os.path.join(args.out, "gpu_hybrid.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
                   "torch": torch.__version__, "rows": rows}, f, indent=1)
    verdict = "FAIL" if failed else "PASS"
    figures = "; ".join(short(r) for r in rows)
    print(f"hybrid_cp: {verdict} ({'dry run on the CPU, ' if args.dry_run else ''}W={args.world}"
          f" S={args.seqlen} bf16, fwd+bwd; {figures}; gpu_hybrid.json)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
