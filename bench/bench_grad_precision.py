"""bf16 gradients' error against float64: cpattn's local backward (fp32 sums of dQ / dK / dV,
rounded once) vs torch SDPA's CPU backward, and the floor (the float64 gradients rounded once to
bf16). What the memory comparison with SDPA trades: torch's CPU flash backward accumulates its
gradients in the bf16 gradient tensors themselves (no fp32 buffer), so its dK / dV error grows
with the number of query blocks summed.

    python bench/bench_grad_precision.py --seqlen 4096 16384   # ~2 min on a 2-vCPU machine
"""

import argparse

import torch

import cpattn


def sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)


def cp(q, k, v):
    return cpattn.attention(q, k, v, causal=True)


def grads(fn, inputs, dout):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    return torch.autograd.grad(fn(*leaves), leaves, dout)


def reference(inputs, dout):
    """float64 gradients of the bf16 inputs (their exact values), torch SDPA in float64, one head
    at a time."""
    heads = inputs[0].shape[2]
    ref = [torch.empty(t.shape, dtype=torch.float64) for t in inputs]
    for h in range(heads):
        one = [t[:, :, h:h + 1].double() for t in inputs]
        for r, g in zip(ref, grads(sdpa, one, dout[:, :, h:h + 1].double())):
            r[:, :, h:h + 1] = g
    return ref


def rel_l2(a, r):
    return ((a.double() - r).norm() / r.norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    print(f"bf16 causal backward, batch 1, heads {args.heads}, head_dim {args.head_dim}, "
          f"torch {torch.__version__}; relative L2 error of each gradient vs float64\n")
    print("| S | method | dq | dk | dv |")
    print("|--:|---|--:|--:|--:|")
    for s in args.seqlen:
        torch.manual_seed(s)
        shape = (1, s, args.heads, args.head_dim)
        q, k, v, dout = (torch.randn(shape).bfloat16() for _ in range(4))
        ref = reference((q, k, v), dout)
        rows = [("float64 rounded to bf16", [r.bfloat16() for r in ref]),
                ("cpattn.attention", grads(cp, (q, k, v), dout)),
                ("torch SDPA", grads(sdpa, (q, k, v), dout))]
        for name, got in rows:
            errs = " | ".join(f"{rel_l2(g, r):.2e}" for g, r in zip(got, ref))
            print(f"| {s} | {name} | {errs} |", flush=True)


if __name__ == "__main__":
    main()
