"""Memory per rank of one forward + backward call, cpattn against the peers, in one run.

    pip install --no-deps yunchang==0.6.4   # the peers (pure Python); without it: rows skipped
    python bench/bench_memory.py [--world 2 4] [--dtype float32 bfloat16] [--seqlen 8192 16384]
                                 [--kv-heads 8 2] [--out FILE.md]

Causal attention, heads 8, head_dim 128, batch 1, W gloo ranks x 1 thread. Methods:
  cpattn ring (zigzag), cpattn ring in passes (ring_chunk = a quarter of the KV heads, at
  least 1), cpattn Ulysses, cpattn all-gather (zigzag, its default chunk: KV heads / 4W, at
  least 1);
  yunchang zigzag ring and yunchang Ulysses (yunchang 0.6.4: its ring driver and all-to-alls run
  as they are; their flash-attn calls, CUDA only, are patched to cpattn's CPU kernel, the same
  local kernel cpattn's strategies use: the rows compare what the drivers hold around it);
  yunchang Ulysses + SDPA: its layer around torch's CPU flash attention instead;
  hand-written all-gather + SDPA (K/V all-gathered with an autograd all-gather, then
  torch SDPA on the local queries with a boolean causal mask).
Per rank and method: the peak bytes of the tensors the call allocates on top of its inputs
(cpattn.memory.counting: every CPU tensor allocation, in any thread), the peak RSS growth over
the call (VmHWM reset before it; allocations of 64 KiB or more are mmapped, so freed memory goes
back to the OS between methods: MALLOC_MMAP_THRESHOLD_), and for cpattn the model
(cpattn.plan.memory). Max over ranks. Each method first runs once on a small shape (gloo
connections, lazy initialisation), then once measured; cpattn's cached ring buffers are freed
before (cpattn.release_buffers), so the figures include them.
"""

import argparse
import contextlib
import datetime
import gc
import os

import torch
import torch.distributed as dist

HEADS, HEAD_DIM = 8, 128
METHODS = ["cpattn ring", "cpattn ring passes", "cpattn ulysses", "cpattn allgather",
           "yunchang ring", "yunchang ulysses", "yunchang ulysses + sdpa", "allgather + sdpa"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (Linux >= 4.0)
        f.write("5")


def _yunchang_kernels():
    """yunchang's flash-attn entry points, replaced by cpattn's CPU kernel (same arguments and
    results as flash-attn's: out in q's dtype and fp32 LSE; gradients written into the buffers
    yunchang passes)."""
    def fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            return_softmax):
        return torch.ops.cpattn.attention_fwd(q, k, v, 0, 0, softmax_scale=softmax_scale,
                                              causal=causal)

    def bwd(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
            softcap, alibi_slopes, deterministic, rng_state=None):
        a, b, c = torch.ops.cpattn.attention_bwd(dout, q, k, v, out, lse, 0, 0,
                                                 softmax_scale=softmax_scale, causal=causal)
        dq.copy_(a)
        dk.copy_(b)
        dv.copy_(c)

    return lambda impl, stage="fwd-bwd", attn_processor=None: fwd if stage == "fwd-only" else bwd


def _passes_chunk(kv_heads: int) -> int:
    """KV heads per pass of "cpattn ring passes": a quarter, at least one."""
    return max(1, kv_heads // 4)


def _method(name: str, group, world: int, hkv: int):
    """fn(q, k, v) -> out for a method, or a reason it cannot run."""
    import cpattn

    if name == "cpattn ring":
        return lambda q, k, v: cpattn.ring_attention(q, k, v, causal=True, layout="zigzag")
    if name == "cpattn ring passes":
        return lambda q, k, v: cpattn.ring_attention(q, k, v, causal=True, layout="zigzag",
                                                     ring_chunk=_passes_chunk(hkv))
    if name == "cpattn allgather":
        return lambda q, k, v: cpattn.ring_attention(q, k, v, causal=True, layout="zigzag",
                                                     strategy="allgather")
    if name == "cpattn ulysses":
        if HEADS % world:
            return "heads % W != 0"
        return lambda q, k, v: cpattn.ulysses_attention(q, k, v, causal=True)
    if name == "allgather + sdpa":
        rank = dist.get_rank()

        def gathered(q, k, v):
            kf, vf = (cpattn.comm.all_gather(t, dim=1) for t in (k, v))
            L, S = q.shape[1], kf.shape[1]
            mask = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + rank * L
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2), attn_mask=mask,
                enable_gqa=hkv != HEADS)
            return out.transpose(1, 2)
        return gathered
    try:
        import yunchang  # noqa: F401
    except ImportError as e:
        return f"yunchang not installed ({e})"
    if name == "yunchang ring":
        import yunchang.ring.zigzag_ring_flash_attn as zz

        zz.select_flash_attn_impl = _yunchang_kernels()
        return lambda q, k, v: zz.zigzag_ring_flash_attn_func(q, k, v, causal=True, group=group)
    if name.startswith("yunchang ulysses"):
        if hkv % world or HEADS % world:
            return "yunchang Ulysses needs kv heads % W == 0"
        from yunchang.kernels import AttnType
        from yunchang.ulysses.attn_layer import UlyssesAttention

        def local(q, k, v, softmax_scale=None, causal=False, **_):
            if name.endswith("sdpa"):  # torch's CPU flash attention, as the issue measured
                return torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                    scale=softmax_scale, enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)
            return cpattn.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)

        layer = UlyssesAttention(group, attn_type=AttnType.TORCH_FLASH)
        layer.attn_fn = local
        return lambda q, k, v: layer(q, k, v, causal=True)
    raise ValueError(name)


def _worker(rank: int, world: int, cfg: dict) -> list:
    import cpattn
    from cpattn import plan as P

    group = dist.group.WORLD
    results = []
    dtype = getattr(torch, cfg["dtype"])
    L, hkv = cfg["seqlen"] // world, cfg["kv_heads"]
    for name in cfg.get("methods", METHODS):
        fn = _method(name, group, world, hkv)
        if isinstance(fn, str):
            results.append({"rank": rank, "method": name, "skip": fn})
            continue
        for n in (4 * world, L):  # a small warm-up call, then the measured one
            torch.manual_seed(rank)
            q = torch.randn(1, n, HEADS, HEAD_DIM, dtype=dtype, requires_grad=True)
            k = torch.randn(1, n, hkv, HEAD_DIM, dtype=dtype, requires_grad=True)
            v = torch.randn(1, n, hkv, HEAD_DIM, dtype=dtype, requires_grad=True)
            g = torch.randn(1, n, HEADS, HEAD_DIM, dtype=dtype)
            if hasattr(cpattn, "memory"):  # (an older cpattn, for a before / after: RSS only)
                cpattn.release_buffers()
            gc.collect()
            dist.barrier()
            _reset_peak_rss()
            rss0 = _status_kib("VmRSS")
            counting = getattr(cpattn, "memory", None)
            with counting.counting() if counting else contextlib.nullcontext() as counts:
                fn(q, k, v).backward(g)
            rss = _status_kib("VmHWM") - rss0
            dist.barrier()
            del q, k, v, g
        model = scratch = None
        if name.startswith("cpattn") and hasattr(P, "memory"):
            strategy = name.split()[1]
            p = P.Problem(cfg["seqlen"], HEADS, hkv, HEAD_DIM, dtype=cfg["dtype"], causal=True)
            layout = "contiguous" if strategy == "ulysses" else "zigzag"
            chunk = _passes_chunk(hkv) if name == "cpattn ring passes" else None
            m = P.memory(p, strategy, world, layout, chunk, gloo=True)
            model, scratch = m["peak"], m.get("scratch", 0)
        results.append({"rank": rank, "method": name, "alloc": counts.peak if counts else None,
                        "rss": rss * 1024, "scratch": scratch, "model": model})
    return results


def run(world: int, cfg: dict) -> dict:
    """The rows of every method, by method: one dict per rank."""
    from cpattn.testing.distributed import run_ranks

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    by_method = {}
    for rank_rows in run_ranks(world, _worker, cfg, poison=False):
        for r in rank_rows:
            by_method.setdefault(r["method"], []).append(r)
    return by_method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--seqlen", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[8, 2])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    emit(f"Memory per rank, one causal forward + backward, heads {HEADS}, head_dim {HEAD_DIM}, "
         f"batch 1, max over ranks; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
         f"UTC; torch {torch.__version__}")
    emit("")
    emit("| W | dtype | S | kv heads | method | tensors (MiB) | model: tensors + kernel scratch "
         "(MiB) | RSS growth (MiB) |")
    emit("|---|---|---|---|---|--:|--:|--:|")
    mib = 2 ** 20
    for world in args.world:
        for dtype in args.dtype:
            for seqlen in args.seqlen:
                for hkv in args.kv_heads:
                    cfg = {"dtype": dtype, "seqlen": seqlen, "kv_heads": hkv,
                           "methods": args.methods}
                    res = run(world, cfg)
                    for name in args.methods:
                        rows = res[name]
                        head = f"| {world} | {dtype} | {seqlen} | {hkv} | {name} |"
                        if "skip" in rows[0]:
                            emit(f"{head} - | - | - ({rows[0]['skip']}) |")
                            continue
                        alloc = rows[0]["alloc"] and max(r["alloc"] for r in rows) / mib
                        rss = max(r["rss"] for r in rows) / mib
                        model = rows[0]["model"]
                        alloc_s = "-" if alloc is None else f"{alloc:.0f}"
                        model_s = "-" if model is None else (f"{model / mib:.0f} + "
                                                             f"{rows[0]['scratch'] / mib:.0f}")
                        emit(f"{head} {alloc_s} | {model_s} | {rss:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
