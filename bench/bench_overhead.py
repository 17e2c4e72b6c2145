"""Per-call overhead of cpattn's Python layer on a W = 2 ring call with tiny tensors.

    python bench/bench_overhead.py [--calls 2000] [--rank-check always once never compiled]

Two spawned gloo ranks (one thread each) time, call by call, alternately and in lock step,
`cpattn.ring_attention` (the public call: argument checks, the rank-agreement check, autograd
Function, op) and the bare op it ends in, `torch.ops.cpattn.ring_fwd` with the same arguments
(kernel plus the ring's communication). Overhead = public call - bare op, forward only, no grad,
from the minimum over `calls` single calls of each (the minimum: the machine is shared and
noisy); medians are shown too (rank 0's clock). --rank-check: the
agreement check's modes to time (where this cpattn has cpattn.set_rank_check; older versions
check every call), and "compiled": the call under torch.compile(fullgraph=True) (inductor),
where the check runs once, while tracing.
"""

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist

from cpattn.core.layout import LAYOUTS
from cpattn.testing.distributed import run_ranks


def _worker(rank: int, world: int, args) -> dict:
    import cpattn

    torch.manual_seed(rank)
    q = torch.randn(1, 16, 2, 16)
    k, v = torch.randn(1, 16, 2, 16), torch.randn(1, 16, 2, 16)
    group_name = dist.group.WORLD.group_name
    code = LAYOUTS["zigzag"]
    results = {}
    for mode in args.rank_check:
        call = functools.partial(cpattn.ring_attention, causal=True)
        if hasattr(cpattn, "set_rank_check"):
            cpattn.set_rank_check("always" if mode == "compiled" else mode)
        if mode == "compiled":
            call = torch.compile(call, fullgraph=True)
        elif mode in ("once", "never") and not hasattr(cpattn, "set_rank_check"):
            continue  # this cpattn checks every call
        public, bare = [], []
        with torch.no_grad():
            call(q, k, v)  # warm-up (compiles)
            dist.barrier()
            for _ in range(args.calls):  # alternating, so that both see the same load
                t0 = time.perf_counter()
                call(q, k, v)
                t1 = time.perf_counter()
                torch.ops.cpattn.ring_fwd(q, k, v, group_name, code, 300.0, softmax_scale=0.25,
                                          causal=True)
                t2 = time.perf_counter()
                public.append(t1 - t0)
                bare.append(t2 - t1)
        results[mode] = (min(public), min(bare), statistics.median(public),
                         statistics.median(bare))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rank-check", nargs="+",
                        default=["always", "once", "never", "compiled"],
                        help="agreement-check modes to time; 'compiled': torch.compile(fullgraph)")
    args = parser.parse_args()
    results = run_ranks(2, _worker, args, poison=False)[0]  # rank 0's clock
    print("| rank check | public call (us), min / median | bare ring_fwd op (us), min / median "
          "| Python-layer overhead (us), from the mins |")
    print("|---|---|---|---|")
    for mode, (public, bare, public_med, bare_med) in results.items():
        print(f"| {mode} | {public * 1e6:.0f} / {public_med * 1e6:.0f} | {bare * 1e6:.0f} / "
              f"{bare_med * 1e6:.0f} | {(public - bare) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
