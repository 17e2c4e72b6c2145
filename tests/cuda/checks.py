"""CUDA checks of cpattn against the float64 reference, runnable with or without pytest.

    python tests/cuda/checks.py [-k SUBSTRING] [--list]   # plain runner (exit 1 on a failure)
    python -m pytest tests/test_cuda.py                   # the same checks under pytest

Every check draws fresh random inputs (a seed per check), runs with outputs poisoned with NaN
(CPATTN_POISON=1: an unwritten element fails), and compares with float64 math in plain torch
(tests/reference.py). Criteria (the emulated kernel tests' rule, tests/emulate): relative error
||x - ref|| / ||ref|| within the INPUT dtype's band (bf16 1e-2, fp16 2e-3 for outputs, half that
for a float32 output: the kernels round P to the input dtype before P V, as FA2 does, so a float32
output only drops the last rounding; twice the band for gradients), LSE to 2e-3 absolute, exact
zeros / -inf for rows that see no key.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

os.environ.setdefault("CPATTN_POISON", "1")  # before cpattn is imported

import torch  # noqa: E402

import cpattn  # noqa: E402

# The checks register themselves in CHECKS as their modules are imported, in this order.
import check_harness as harness  # noqa: E402
import kernel_checks  # noqa: E402, F401
import op_checks  # noqa: E402, F401
import ring_checks  # noqa: E402, F401
from check_harness import (  # noqa: E402
    CHECKS,
    CUDA_ONLY,
    Skip,
    check,
    check_close,
    cuda_ok,
    gen_for,
    ops,
    randn,
    run_attention,
    sync,
)


@check("opcheck/cuda")
def _opcheck():
    g = gen_for("opcheck")
    q, k, v = randn((1, 70, 4, 64), g), randn((1, 90, 2, 64), g), randn((1, 90, 2, 64), g)
    opts = dict(softmax_scale=0.125, causal=True)
    torch.library.opcheck(ops.attention_fwd.default, (q, k, v, 20, 0, None), opts)
    out, lse = ops.attention_fwd(q, k, v, 20, 0, None, **opts)
    dout = randn(q.shape, g)
    torch.library.opcheck(ops.attention_bwd.default, (dout, q, k, v, out, lse, 20, 0, None, None),
                          opts, test_utils=("test_schema", "test_faketensor"))


@check("compile/attention_fullgraph")
def _compile():
    """torch.compile(fullgraph=True) of cpattn.attention (fake kernel + autograd registration):
    the same out and gradients as eager."""
    g = gen_for("compile")
    q, k, v = randn((1, 70, 4, 64), g), randn((1, 90, 2, 64), g), randn((1, 90, 2, 64), g)
    dout = randn(q.shape, g)

    def f(a, b, c):
        return cpattn.attention(a, b, c, causal=True)

    # no C++ codegen on the CPU dry run
    backend = "aot_eager" if harness.DEV == "cpu" else "inductor"
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend=backend)):
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = fn(qg, kg, vg)
        results.append((out, *torch.autograd.grad(out, (qg, kg, vg), dout)))
    for n, a, b in zip(("out", "dq", "dk", "dv"), *results):
        check_close(f"compiled {n}", b, a, 1e-6)


def sanitizer_case() -> None:
    """A small forward + backward (atomic and deterministic dQ) + emulated ring, for
    compute-sanitizer: every code path, little work."""
    g = gen_for("sanitizer")
    for causal, window in ((True, (-1, -1)), (False, (20, 7))):
        q, k, v = randn((1, 77, 2, 64), g), randn((1, 99, 1, 64), g), randn((1, 99, 1, 64), g)
        dout = randn(q.shape, g)
        run_attention(q, k, v, dout, causal, window)
        torch.use_deterministic_algorithms(True)
        run_attention(q, k, v, dout, causal, window)
        torch.use_deterministic_algorithms(False)
    q, k, v = randn((1, 40, 2, 128), g), randn((1, 40, 2, 128), g), randn((1, 40, 2, 128), g)
    run_attention(q, k, v, randn(q.shape, g), True, (-1, -1))
    torch.ops.cpattn_testing.ring_fwd_emulated([q[:, :20], q[:, 20:]], [k[:, :20], k[:, 20:]],
                                               [v[:, :20], v[:, 20:]], 0, softmax_scale=0.1,
                                               causal=True)
    # GQA / MQA backward with the query heads split over blocks, and the reduction of the splits.
    os.environ["CPATTN_BWD_HEAD_SPLITS"] = "2"
    try:
        q, k, v = randn((1, 50, 4, 64), g), randn((1, 60, 1, 64), g), randn((1, 60, 1, 64), g)
        run_attention(q, k, v, randn(q.shape, g), True, (-1, -1))
    finally:
        del os.environ["CPATTN_BWD_HEAD_SPLITS"]
    sync()

def main() -> int:
    parser = argparse.ArgumentParser(description="cpattn CUDA checks")
    parser.add_argument("-k", default="",
                        help="run the checks whose name contains one of these (comma-separated)")
    parser.add_argument("--first", action="store_true",
                        help="only the first check matching each -k substring (a quick pass)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--sanitizer-case", action="store_true",
                        help="run only the small case for compute-sanitizer")
    args = parser.parse_args()
    if not cuda_ok():
        print("SKIP: no CUDA device or cpattn built without CUDA")
        return 0
    if args.sanitizer_case:
        sanitizer_case()
        print("sanitizer case done")
        return 0
    runnable = [(n, f) for n, f in CHECKS if not (harness.DEV == "cpu" and n.startswith(CUDA_ONLY))]
    selected = []
    for sub in args.k.split(","):
        matching = [c for c in runnable if sub in c[0] and c not in selected]
        selected += matching[:1] if args.first else matching
    selected.sort(key=lambda c: runnable.index(c))
    if args.list:
        print("\n".join(n for n, _ in selected))
        return 0
    failed, skipped = [], 0
    t0 = time.time()
    for name, fn in selected:
        t = time.time()
        try:
            fn()
            sync()
            print(f"PASS {name} ({time.time() - t:.2f} s)", flush=True)
        except Skip as e:
            skipped += 1
            print(f"SKIP {name}: {e}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure, keep going
            failed.append(name)
            print(f"FAIL {name}: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc(limit=3)
    print(f"{len(selected) - len(failed) - skipped}/{len(selected)} checks passed, {skipped} "
          f"skipped, in {time.time() - t0:.1f} s")
    for name in failed:
        print(f"  failed: {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
