"""The GPU hot path (issue 29) on one GPU: one stage per process, for bench/gpu_check.sh.

    python bench/gpu_hot_path.py STAGE [--out DIR] [--dry-run]

Stages, each over a one-rank NCCL-only process group (at W = 1 the ring does no shift: ring
shifts are exercised by the test op ring_post_timing, NCCL send / recv to self, and W = 4 by the
emulation cpattn.testing.emulation, W virtual ranks on this GPU, each with its own streams):
  sync_free  host syncs of each public function under torch.cuda.set_sync_debug_mode("error"),
             after one warm-up call, forward + backward where differentiable, bf16 (target: 0)
  run_ahead  host time of each call while ~50 ms of GPU work is queued (target: < 1 ms, the GPU
             still busy after it); host microseconds per post and per wait of 1,000 ring shifts
  capture    a CUDA graph of a ring layer's forward + backward (W = 1), replayed: bitwise equal
             to eager; a capture of a ring shift raises "cannot be captured in a CUDA graph", and
             the communicator still works after it
  streams    the ring layer (W = 1) and the emulated W = 4 ring on a side stream and after the
             caching allocator's memory was filled with NaN: bitwise equal to the default stream
  profile    torch.profiler timelines: an emulated W = 4 ring layer's GPU idle fraction (kernels
             only) and copy/compute overlap; a B = 64, 128K-token decode step's KV read rate
             against H200 HBM (4.8 TB/s)

Each stage prints `NAME: PASS|FAIL|SKIP (figures or reason)` as its last line (exit status 1 on
FAIL only) and writes hot_path_NAME.json (the profile: also its gzipped chrome traces) to --out.
Without CUDA, or with --dry-run, every stage is SKIP: the CPU stand-in of sync_free is
tests/test_hot_path.py. Inputs are seeded. Bitwise comparisons run with CPATTN_DETERMINISTIC=1
(dQ without atomics); timings and profiles without CPATTN_POISON (no NaN-fill kernels).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager

import torch
import torch.distributed as dist

try:  # a failed build still gives each stage its FAIL line
    import cpattn
    from cpattn.core.layout import LAYOUTS
    from cpattn.testing.emulation import load_ops, ring_attention_emulated
    IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - an ImportError, or a library that fails to load
    IMPORT_ERROR = e

SEED = 29
DEVICE = "cuda"  # of the calls' tensors (a check of this script can run them on the CPU)
BF16 = torch.bfloat16
HBM_TBPS = 4.8  # H200 datasheet
CPU_STAND_IN = "the CPU stand-in is tests/test_hot_path.py"
# Per stage, set before its first op (cpattn reads these once per process).
STAGE_ENV = {"capture": {"CPATTN_DETERMINISTIC": "1"}, "streams": {"CPATTN_DETERMINISTIC": "1"},
             "run_ahead": {"CPATTN_POISON": "0"}, "profile": {"CPATTN_POISON": "0"}}


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return (lines[0] if lines else type(e).__name__)[:200]


def rand(*shape, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=BF16).requires_grad_(grad)


@contextmanager
def one_rank_group():
    """The world as a one-rank NCCL-only process group on GPU 0."""
    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()


# ---- the calls ----------------------------------------------------------------------------------

def public_calls(group) -> list:
    """(name, forward) per public function; forward() returns the output to differentiate, or
    None (forward-only functions)."""
    b, s, h, hkv, d = 1, 1024, 8, 2, 128
    q, k, v = rand(b, s, h, d, grad=True), rand(b, s, hkv, d, grad=True), rand(b, s, hkv, d,
                                                                              grad=True)
    sinks = torch.randn(h, device=DEVICE, requires_grad=True)
    ring_group = dist.new_group([0])  # hybrid: Ulysses over the world, a ring of its own
    cu = [0, 384, 1024]  # global documents on the host; even lengths: no zigzag padding at W = 1
    cache = cpattn.KVCacheShard(2, 1024, hkv, d, dtype=BF16, device=DEVICE, group=group)
    prompt = [rand(2, 256, n, d) for n in (h, hkv, hkv)]

    def ring(strategy):
        return lambda: cpattn.ring_attention(q, k, v, group=group, causal=True, sinks=sinks,
                                             strategy=strategy)

    def prefill_decode():  # two prompt chunks (the second over cached tokens, padded), 2 decodes
        cache.clear()
        cpattn.prefill_attention(*prompt, cache, group=group, causal=True)
        cpattn.prefill_attention(*prompt, cache, group=group, causal=True, seqlen=255)
        cache.append(prompt[1][:, :1], prompt[2][:, :1])
        cpattn.decode_attention(prompt[0][:, :1], cache, group=group, causal=True)
        cpattn.decode_attention(prompt[0][:, :1], cache, group=group, causal=True,
                                comm="reduce_scatter")

    return [
        ("attention", lambda: cpattn.attention(q, k, v, causal=True, sinks=sinks)),
        ("ring_attention(strategy='ring')", ring("ring")),
        ("ring_attention(strategy='allgather')", ring("allgather")),
        ("ulysses_attention", lambda: cpattn.ulysses_attention(q, k, v, group=group, causal=True,
                                                               sinks=sinks)),
        ("hybrid_attention", lambda: cpattn.hybrid_attention(
            q, k, v, ulysses_group=group, ring_group=ring_group, causal=True)),
        ("ring_attention_varlen", lambda: cpattn.ring_attention_varlen(
            q[0], k[0], v[0], cu, group=group, causal=True)),
        ("ulysses_attention_varlen", lambda: cpattn.ulysses_attention_varlen(
            q[0], k[0], v[0], cu, group=group, causal=True)),
        ("prefill_attention + decode_attention", prefill_decode),
    ]


def backward(out) -> None:
    if out is not None:
        out.float().sum().backward()


def ring_layer(group, b=1, s=2048, h=8, hkv=2, d=128):
    """A ring layer at W = 1 on fresh seeded inputs: (out, dq, dk, dv)."""
    q, k, v = rand(b, s, h, d, grad=True), rand(b, s, hkv, d, grad=True), rand(b, s, hkv, d,
                                                                              grad=True)
    dout = rand(b, s, h, d)
    out = cpattn.ring_attention(q, k, v, group=group, causal=True)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), dout)]


def emulated_inputs(world=4, b=1, s=1024, h=8, hkv=2, d=128) -> list:
    """Seeded shards of s tokens per rank for the emulated ring: q, k, v, dout (lists of W)."""
    return [[rand(b, s, n, d) for _ in range(world)] for n in (h, hkv, hkv, h)]


def emulated_ring(q, k, v, dout) -> list:
    """The emulated W-rank ring (zigzag, causal), forward + backward: outs, lses, dqs, dks, dvs,
    rank by rank."""
    opts = dict(causal=True, softmax_scale=q[0].shape[-1] ** -0.5)
    outs, lses = ring_attention_emulated(q, k, v, **opts)
    grads = torch.ops.cpattn_testing.ring_bwd_emulated(dout, q, k, v, outs, lses,
                                                       LAYOUTS["zigzag"], **opts)
    return [*outs, *lses, *(t for part in grads for t in part)]


def bitwise_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- the stages ---------------------------------------------------------------------------------

def sync_free(group, out_dir):
    calls = public_calls(group)
    raised = {}
    for name, forward in calls:
        try:  # warm-up: the first call of a signature may sync (the agreement check)
            backward(forward())
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported with the others
            raised[name] = f"warm-up call: {type(e).__name__}: {first_line(e)}"
            continue
        try:
            torch.cuda.set_sync_debug_mode("error")
            backward(forward())
        except Exception as e:  # noqa: BLE001 - the syncing call raises RuntimeError
            raised[name] = f"{type(e).__name__}: {first_line(e)}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    figures = f"{len(calls) - len(raised)} of {len(calls)} functions sync-free"
    if raised:
        figures += "; raised: " + "; ".join(f"{n}: {m}" for n, m in raised.items())
    return ("FAIL" if raised else "PASS"), figures, {"raised": raised,
                                                     "functions": [n for n, _ in calls]}


def sleep_cycles(ms: float) -> int:
    """torch.cuda._sleep cycles that keep the GPU busy about `ms` ms (timed with CUDA events)."""
    n = 10_000_000
    torch.cuda._sleep(n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return int(n * ms / start.elapsed_time(end))


def run_ahead(group, out_dir):
    cycles = sleep_cycles(50.0)
    host_ms, idle_after = {}, []
    for name, forward in public_calls(group):
        backward(forward())  # warm-up
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        queued = torch.cuda.Event()
        queued.record()  # done once the queued work is: the GPU has gone idle
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        backward(out)
        t2 = time.perf_counter()
        if queued.query():
            idle_after.append(name)
        host_ms[f"{name} forward"] = (t1 - t0) * 1e3
        if out is not None:
            host_ms[f"{name} backward"] = (t2 - t1) * 1e3
        del out
        torch.cuda.synchronize()
    x = rand(1 << 19)  # 1 MiB per shift
    torch.ops.cpattn_testing.ring_post_timing(x, group.group_name, 10, 60.0)  # the communicator
    torch.cuda.synchronize()
    post_us, wait_us = torch.ops.cpattn_testing.ring_post_timing(x, group.group_name, 1000,
                                                                 60.0).tolist()
    slowest = max(host_ms, key=host_ms.get)
    ok = host_ms[slowest] < 1.0 and not idle_after
    figures = (f"max {host_ms[slowest]:.3f} ms ({slowest}) of {len(host_ms)} calls, target < 1 ms; "
               f"GPU idle after: {', '.join(idle_after) or 'none'}; ring post {post_us:.1f} us, "
               f"wait {wait_us:.1f} us per shift (1,000 shifts of 1 MiB)")
    return ("PASS" if ok else "FAIL"), figures, {
        "host_ms": host_ms, "gpu_idle_after": idle_after, "sleep_cycles_50ms": cycles,
        "ring_post_us": post_us, "ring_wait_us": wait_us}


def capture_error(fn) -> Exception | None:
    """Runs fn() inside a CUDA-graph capture on a side stream; returns what it raised (None if
    nothing). The capture is ended whatever happens (an aborted one raises at its end: ignored)."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    torch.cuda.synchronize()
    error = None
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            error = e
        finally:
            try:
                graph.capture_end()
            except RuntimeError:
                pass
    del graph
    torch.cuda.synchronize()
    return error


def capture(group, out_dir):
    details, problems = {}, []
    # a ring layer's forward + backward on static inputs: captured once, replayed twice
    q, k, v = rand(1, 2048, 8, 128, grad=True), rand(1, 2048, 2, 128, grad=True), \
        rand(1, 2048, 2, 128, grad=True)
    dout = rand(*q.shape)

    def layer():
        out = cpattn.ring_attention(q, k, v, group=group, causal=True)
        return [out, *torch.autograd.grad(out, (q, k, v), dout)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the usual warm-up, on a side stream
        for _ in range(3):
            layer()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        static = layer()
    for replay in range(2):  # the captured values, then new values in the static inputs
        if replay:
            for t in (q, k, v, dout):
                t.detach().copy_(torch.randn_like(t))
        graph.replay()
        eager = [t.detach() for t in layer()]
        torch.cuda.synchronize()
        equal = bitwise_equal([t.detach() for t in static], eager)
        details[f"replay {replay} bitwise equal to eager"] = equal
        if not equal:
            problems.append(f"replay {replay} differs from eager")
    del graph, static
    # ring shifts refused inside a capture, the communicator alive after it
    x = rand(3, 1000)
    shift = torch.ops.cpattn_testing.ring_shift
    alive_before = torch.equal(shift(x, group.group_name, 60.0), x)  # makes the communicator
    for name, fn in (("ring_shift", lambda: shift(x, group.group_name, 60.0)),
                     ("ring_post_timing", lambda: torch.ops.cpattn_testing.ring_post_timing(
                         x, group.group_name, 10, 60.0))):
        e = capture_error(fn)
        details[f"{name} in a capture"] = None if e is None else f"{type(e).__name__}: {e}"
        if not (isinstance(e, RuntimeError) and "cannot be captured in a CUDA graph" in str(e)):
            problems.append(f"{name} in a capture: "
                            + ("no error" if e is None else f"{type(e).__name__}: {first_line(e)}"))
    alive_after = torch.equal(shift(x, group.group_name, 60.0), x)
    details.update(eager_shift_before=alive_before, eager_shift_after=alive_after)
    if not (alive_before and alive_after):
        problems.append("an eager ring_shift changed the data "
                        + ("after the refused captures" if alive_before else "before any capture"))
    figures = "; ".join(problems) or (
        "ring layer fwd + bwd (W = 1) replayed bitwise equal to eager, twice; ring_shift and "
        "ring_post_timing refused in a capture; eager ring_shift still right after")
    return ("FAIL" if problems else "PASS"), figures, details


def fill_allocator_with_nan() -> None:
    """Allocates and frees blocks of every pool size filled with 0xFF bytes (NaN in every float
    dtype) on the current stream, so that its next allocations reuse them."""
    big = [torch.full((1 << 30,), 255, dtype=torch.uint8, device="cuda") for _ in range(4)]
    small = [torch.full((1 << 19,), 255, dtype=torch.uint8, device="cuda") for _ in range(256)]
    del big, small


def streams(group, out_dir):
    cases = {"ring layer (W = 1)": lambda: ring_layer(group),
             "emulated ring (W = 4)": lambda: emulated_ring(*emulated_inputs())}
    details, problems = {}, []
    for name, case in cases.items():
        torch.manual_seed(SEED)
        baseline = case()
        torch.cuda.synchronize()
        for where, stream in (("side stream", torch.cuda.Stream()),
                              ("default stream", torch.cuda.current_stream())):
            with torch.cuda.stream(stream):
                fill_allocator_with_nan()
                torch.manual_seed(SEED)  # the same inputs, made on this stream
                got = case()
            torch.cuda.synchronize()
            equal = bitwise_equal(got, baseline)
            details[f"{name}, {where} after NaN reuse"] = equal
            if not equal:
                problems.append(f"{name} on the {where} after NaN reuse differs")
            del got
    figures = "; ".join(problems) or (
        "ring layer (W = 1) and emulated ring (W = 4) fwd + bwd bitwise equal on a side stream "
        "and after NaN-filled memory reuse")
    return ("FAIL" if problems else "PASS"), figures, details


def union_us(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_timeline(fn, path: str) -> dict:
    """Profiles fn() (after one warm-up call) and saves the gzipped chrome trace at `path`;
    returns its GPU activity: {"kernel" / "gpu_memcpy": [(start_us, end_us, stream, name)]}."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)  # ".gz": gzipped
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    found = {"kernel": [], "gpu_memcpy": []}
    for e in events:
        if e.get("cat") in found and e.get("ph") == "X":
            stream = e.get("args", {}).get("stream", e.get("tid"))
            found[e["cat"]].append((e["ts"], e["ts"] + e["dur"], stream, e["name"]))
    if not found["kernel"]:
        raise RuntimeError(f"the profiler recorded no CUDA kernel ({path})")
    return found


def ring_figures(activity: dict) -> dict:
    kernels, copies = activity["kernel"], activity["gpu_memcpy"]
    everything = kernels + copies
    span = max(e[1] for e in everything) - min(e[0] for e in everything)
    overlapped = sum(union_us([(max(a, ka), min(b, kb)) for ka, kb, ks, _ in kernels
                               if ks != s and ka < b and kb > a]) for a, b, s, _ in copies)
    copy_us = sum(b - a for a, b, _, _ in copies)
    return {"span_us": span, "kernel_union_us": union_us([(a, b) for a, b, _, _ in kernels]),
            "idle_fraction": 1 - union_us([(a, b) for a, b, _, _ in kernels]) / span,
            "copies": len(copies), "copy_us": copy_us,
            "copy_overlap": overlapped / copy_us if copy_us else None,
            "streams": len({e[2] for e in everything})}


def decode_figures(activity: dict, kv_bytes: int) -> dict:
    kernels = activity["kernel"]
    # the batched split-KV kernels (csrc/cuda/decode_kernel.cuh), else the per-span forward
    attention = [e for e in kernels if "decode_" in e[3] or "attention_fwd" in e[3]] or kernels
    kernel_us = sum(b - a for a, b, _, _ in attention)
    span = max(e[1] for e in kernels) - min(e[0] for e in kernels)
    return {"kv_bytes": kv_bytes, "attention_kernels": len(attention), "kernels": len(kernels),
            "kernel_names": sorted({e[3][:120] for e in kernels})[:20],
            "attention_kernel_us": kernel_us, "span_us": span,
            "tbps_kernels": kv_bytes / kernel_us / 1e6, "tbps_span": kv_bytes / span / 1e6}


def profile_stage(group, out_dir):
    shards = emulated_inputs(s=4096, h=16, hkv=4)  # 16K tokens over 4 virtual ranks
    ring = ring_figures(gpu_timeline(lambda: emulated_ring(*shards),
                                     os.path.join(out_dir, "trace_ring_w4.json.gz")))
    batch, tokens, kv_heads, head_dim = 64, 131072, 2, 128
    cache = cpattn.KVCacheShard(batch, tokens, kv_heads, head_dim, dtype=BF16, device="cuda",
                                group=group)
    cache.k.normal_()
    cache.v.normal_()
    cache.lengths.fill_(tokens)
    q = rand(batch, 1, 16, head_dim)
    kv_bytes = 2 * batch * tokens * kv_heads * head_dim * cache.k.element_size()
    decode = decode_figures(gpu_timeline(lambda: cpattn.decode_attention(q, cache, group=group),
                                         os.path.join(out_dir, "trace_decode_b64_128k.json.gz")),
                            kv_bytes)
    overlap = "no copies" if ring["copy_overlap"] is None else f"{ring['copy_overlap']:.0%}"
    figures = (f"ring W = 4 fwd + bwd: GPU idle {ring['idle_fraction']:.1%} of "
               f"{ring['span_us'] / 1e3:.2f} ms, copy/compute overlap {overlap} of "
               f"{ring['copy_us'] / 1e3:.2f} ms copies; decode B = 64, 128K: "
               f"{decode['tbps_kernels']:.2f} TB/s in its attention kernels "
               f"({decode['tbps_kernels'] / HBM_TBPS:.0%} of {HBM_TBPS} TB/s), "
               f"{decode['tbps_span']:.2f} TB/s over its span; traces trace_*.json.gz")
    return "PASS", figures, {"ring_w4": ring, "decode": decode}


STAGES = {"sync_free": sync_free, "run_ahead": run_ahead, "capture": capture,
          "streams": streams, "profile": profile_stage}


def run_stage(name: str, out_dir: str, dry_run: bool) -> tuple[str, str, dict]:
    """(verdict, figures, details) of one stage; any exception is its FAIL."""
    if dry_run:
        return "SKIP", f"dry run: needs a GPU; {CPU_STAND_IN}", {}
    if IMPORT_ERROR is not None:
        return "FAIL", f"cpattn not importable: {first_line(IMPORT_ERROR)}", {}
    if not (torch.cuda.is_available() and cpattn.build_info()["with_cuda"]):
        return "SKIP", f"no CUDA device, or cpattn built without CUDA: {CPU_STAND_IN}", {}
    os.environ.update(STAGE_ENV.get(name, {}))
    torch.manual_seed(SEED)
    try:
        load_ops()  # torch.ops.cpattn_testing: the emulated ring, ring_shift, ring_post_timing
        with one_rank_group() as group:
            return STAGES[name](group, out_dir)
    except Exception as e:  # noqa: BLE001 - the stage's FAIL line, with the error
        traceback.print_exc()
        return "FAIL", f"{type(e).__name__}: {first_line(e)}", {"error": traceback.format_exc()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=STAGES)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--dry-run", action="store_true", help="no GPU work: every stage SKIP")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    verdict, figures, details = run_stage(args.stage, args.out, args.dry_run)
    with open(os.path.join(args.out, f"hot_path_{args.stage}.json"), "w") as f:
        json.dump({"stage": args.stage, "verdict": verdict, "figures": figures,
                   "seconds": round(time.time() - t0, 1), **details}, f, indent=1, default=str)
    sys.stderr.flush()
    print(f"{args.stage}: {verdict} ({figures})", flush=True)
    return 1 if verdict == "FAIL" else 0


if __name__ == "__main__":
    # No interpreter teardown (NCCL's and the profiler's exit hooks): the verdict is printed.
    os._exit(main())
