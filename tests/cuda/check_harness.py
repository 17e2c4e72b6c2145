"""The harness of the CUDA checks (tests/cuda/checks.py): device, seeds, tolerances, the float64
reference, comparisons and the CHECKS registry that the check modules (kernel_checks, op_checks,
ring_checks, and checks.py itself) add to, in the order checks.py imports them.
"""

from __future__ import annotations

import os
import sys
import zlib
from typing import Callable

os.environ.setdefault("CPATTN_POISON", "1")  # before cpattn is imported

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import cpattn  # noqa: E402
from cpattn.testing.emulation import load_ops  # noqa: E402

from reference import reference_attention  # noqa: E402

load_ops()  # torch.ops.cpattn_testing: the emulated ring, ring_shift
ops = torch.ops.cpattn
# CPATTN_CHECKS_DEVICE=cpu runs the device-independent checks on the CPU kernels: a test of the
# checks themselves (references, tolerances, sharding) on a machine without a GPU.
DEV = os.environ.get("CPATTN_CHECKS_DEVICE", "cuda")
CUDA_ONLY = ("errors/", "ring_nccl/", "opcheck/")
OUT_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}
GRAD_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_ATOL = 2e-3


def out_tol(in_dtype: torch.dtype, out_dtype: torch.dtype) -> float:
    """Tolerance of an output computed from `in_dtype` inputs, written in `out_dtype`."""
    tol = OUT_TOL[in_dtype]
    return tol / 2 if out_dtype == torch.float32 and in_dtype != torch.float32 else tol


def cuda_ok() -> bool:
    if DEV == "cpu":
        return True
    return torch.cuda.is_available() and cpattn.build_info()["with_cuda"]


def sync() -> None:
    if DEV != "cpu":
        torch.cuda.synchronize()


def gen_for(name: str) -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.manual_seed(zlib.crc32(name.encode()) & 0x7FFFFFFF)
    return g


def randn(shape, g, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=g, device=DEV, dtype=torch.float32).to(dtype)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    den = ref.norm().item()
    return (x - ref).norm().item() / (den if den > 0 else 1.0)


def check_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(x).all(), f"{name}: {int((~torch.isfinite(x)).sum())} non-finite values"
    err = rel_err(x, ref)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


def check_lse(lse: torch.Tensor, ref: torch.Tensor) -> None:
    ref = ref.to(lse.device)
    empty = torch.isinf(ref)
    assert torch.equal(torch.isinf(lse), empty), "lse: -inf positions differ"
    assert (lse[empty] < 0).all(), "lse: +inf where -inf expected"
    assert not torch.isnan(lse).any(), "lse: NaN"
    if (~empty).any():
        err = (lse[~empty].double() - ref[~empty].double()).abs().max().item()
        assert err <= LSE_ATOL, f"lse: max abs error {err:.3g} > {LSE_ATOL}"


def reference(q, k, v, dout=None, causal=False, window=(-1, -1), scale=None, q_offset=None,
              k_offset=0, dlse=None):
    """float64 reference on the CPU: out, lse and (with dout) dq, dk, dv."""
    qr, kr, vr = (t.detach().double().cpu().requires_grad_(dout is not None) for t in (q, k, v))
    out, lse = reference_attention(qr, kr, vr, causal=causal, window=window, scale=scale,
                                   q_offset=q_offset, k_offset=k_offset)
    if dout is None:
        return out.detach(), lse.detach()
    loss = (out * dout.double().cpu()).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse, torch.zeros_like(lse)) * dlse.double().cpu()).sum()
    dq, dk, dv = torch.autograd.grad(loss, (qr, kr, vr))
    return out.detach(), lse.detach(), dq, dk, dv


def run_attention(q, k, v, dout, causal, window, scale=None, dlse=None):
    """cpattn.attention forward (out, lse) and gradients for dout (and dlse)."""
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = cpattn.attention(qg, kg, vg, causal=causal, window=window, softmax_scale=scale,
                                return_lse=True)
    outputs, grads = [out], [dout]
    if dlse is not None:
        outputs.append(lse)
        grads.append(dlse)
    dq, dk, dv = torch.autograd.grad(outputs, (qg, kg, vg), grads)
    return out.detach(), lse.detach(), dq, dk, dv


def compare_all(name, got, ref, dtype, grads=True):
    out, lse = got[0], got[1]
    check_close(f"{name} out", out, ref[0].to(out.device), out_tol(dtype, out.dtype))
    check_lse(lse, ref[1])
    if grads:
        for n, g, r in zip(("dq", "dk", "dv"), got[2:], ref[2:]):
            assert g.dtype == dtype, f"{name} {n}: dtype {g.dtype} != {dtype}"
            check_close(f"{name} {n}", g, r.to(g.device), GRAD_TOL[dtype])


# ---------------------------------------------------------------------------------------------
# The checks: (name, function) pairs, collected in CHECKS.

CHECKS: list[tuple[str, Callable[[], None]]] = []


def check(name: str):
    def deco(fn):
        CHECKS.append((name, fn))
        return fn

    return deco


class Skip(Exception):
    """A check that does not apply to this build (reported as SKIP, not as a failure)."""


def world_of_one(tmp: str) -> None:
    """A one-rank process group: gloo for CPU tensors, NCCL for CUDA ones (as on a GPU cluster)."""
    import torch.distributed as dist

    backend = "gloo" if DEV == "cpu" else "cpu:gloo,cuda:nccl"
    if DEV != "cpu":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)


def check_grads(what, fn, q, k, v, dout, ref):
    """fn(q, k, v) -> out, differentiated against dout; compared with ref (out, lse, dq, dk, dv)."""
    qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fn(qg, kg, vg)
    dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    check_close(f"{what} out", out.detach(), ref[0].to(out.device), out_tol(q.dtype, out.dtype))
    for n, x, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
        check_close(f"{what} {n}", x, r.to(x.device), GRAD_TOL[q.dtype])

