"""Failure semantics, measured: bad inputs, cross-rank mismatches, faults and a leak loop on real
gloo ranks (CPU). Prints the markdown tables of the README's RELIABILITY section.

    python bench/bench_reliability.py [--world 2] [--loop 1000]

Every case runs on every rank; a case passes when every rank raises a cpattn error (ValueError or
RuntimeError naming the function) and the next valid ring call on the same group returns the
emulated ring's result. Crashes (a rank dying) and hangs (a call exceeding its timeout) are
counted by the parent process.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = 5.0  # per call: a case slower than this counts as a hang


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _qkv(seed: int, b=1, s=8, h=4, hkv=2, d=16):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, n, d, generator=gen) for n in (h, hkv, hkv))


def _bad_inputs(cpattn, rank: int, world: int) -> dict:
    """name -> a call(strategy) that must raise, the same on every rank; the ring calls are
    tried with both strategies."""
    q, k, v = _qkv(rank)
    r = torch.randn
    x = torch.randn(4, 2, 16)
    ring = cpattn.ring_attention
    ring_cases = {
        "mixed q/k dtypes": lambda s: ring(q.bfloat16(), k, v, strategy=s),
        "int32 q/k/v": lambda s: ring(q.int(), k.int(), v.int(), strategy=s),
        "head_dim 300": lambda s: ring(r(1, 8, 4, 300), r(1, 8, 2, 300), r(1, 8, 2, 300),
                                       strategy=s),
        "head_dim 0": lambda s: ring(r(1, 8, 4, 0), r(1, 8, 2, 0), r(1, 8, 2, 0), strategy=s),
        "H % Hkv != 0": lambda s: ring(r(1, 8, 3, 16), k, v, strategy=s),
        "batch 0": lambda s: ring(r(0, 8, 4, 16), r(0, 8, 2, 16), r(0, 8, 2, 16), strategy=s),
        "q/k shard lengths": lambda s: ring(q, k[:, :4], v[:, :4], strategy=s),
        "softmax_scale 0": lambda s: ring(q, k, v, softmax_scale=0.0, strategy=s),
        "softmax_scale nan": lambda s: ring(q, k, v, softmax_scale=float("nan"), strategy=s),
        "softmax_scale 1e-50 (0 in fp32)": lambda s: ring(q, k, v, softmax_scale=1e-50,
                                                         strategy=s),
        "window (-2, 0)": lambda s: ring(q, k, v, window=(-2, 0), strategy=s),
        "window (2.5, 0)": lambda s: ring(q, k, v, window=(2.5, 0), strategy=s),
        "causal 'yes'": lambda s: ring(q, k, v, causal="yes", strategy=s),
        "layout 'spiral'": lambda s: ring(q, k, v, layout="spiral", strategy=s),
        "timeout -1": lambda s: ring(q, k, v, timeout=-1, strategy=s),
        "allgather_chunk -1": lambda s: ring(q, k, v, strategy="allgather", allgather_chunk=-1),
        "odd zigzag shard": lambda s: ring(r(1, 7, 4, 16), r(1, 7, 2, 16), r(1, 7, 2, 16),
                                           strategy=s),
        "float cu_seqlens": lambda s: cpattn.ring_attention_varlen(
            x, x, x, torch.tensor([0.0, 4.0 * world]), strategy=s),
        "cu_seqlens not from 0": lambda s: cpattn.ring_attention_varlen(
            x, x, x, [1, 4 * world], strategy=s),
        "varlen wrong local length": lambda s: cpattn.ring_attention_varlen(
            x[:3], x[:3], x[:3], [0, 4 * world], strategy=s),
    }
    cases = {f"{name} [{s}]": functools.partial(call, s) for name, call in ring_cases.items()
             for s in ("ring", "allgather")}
    cases.update({
        "ulysses q/k lengths": lambda: cpattn.ulysses_attention(q, k[:, :4], v[:, :4]),
        "ulysses heads % W": lambda: cpattn.ulysses_attention(
            *(r(1, 8, world + 1, 16) for _ in range(3))),
        "decode q dtype != cache": lambda: cpattn.decode_attention(
            q[:, :1].bfloat16(), _cache(cpattn)),
        "decode no tokens appended": lambda: cpattn.decode_attention(
            q[:, :1], cpattn.KVCacheShard(1, 8, 2, 16)),
        "prefill over capacity": lambda: cpattn.prefill_attention(
            q, k, v, cpattn.KVCacheShard(1, 4, 2, 16), layout="contiguous"),
        # The raw op skips the Python checks: its kernel fails after the first shift is posted.
        "raw ring_fwd, mixed dtypes (in-ring)": lambda: torch.ops.cpattn.ring_fwd(
            q.bfloat16(), k, v, dist.group.WORLD.group_name, 1, TIMEOUT, softmax_scale=0.25,
            causal=True),
        "raw ring_fwd, head_dim 300 (in-ring)": lambda: torch.ops.cpattn.ring_fwd(
            r(1, 8, 4, 300), r(1, 8, 2, 300), r(1, 8, 2, 300), dist.group.WORLD.group_name, 1,
            TIMEOUT, softmax_scale=0.25, causal=True),
    })
    return cases


def _cache(cpattn):
    c = cpattn.KVCacheShard(1, 8, 2, 16)
    c.append(torch.ones(1, 2, 2, 16), torch.ones(1, 2, 2, 16))
    return c


def _mismatches(cpattn, rank: int, world: int) -> dict:
    """name -> a call that differs between the ranks."""
    q, k, v = _qkv(rank)
    x = torch.randn(4, 2, 16)
    calls = [
        lambda: cpattn.ring_attention(q, k, v),
        lambda: cpattn.ulysses_attention(q, k, v),
        lambda: cpattn.decode_attention(q[:, :1], _cache(cpattn)),
        lambda: cpattn.ring_attention_varlen(x, x, x, [0, 4 * world]),
    ]
    cus = [[0, 1, 3 * world - 1, 4 * world], [0, 2, 3 * world - 2, 4 * world]]
    return {
        "ring vs ulysses": calls[rank % 2],
        "ring vs decode": calls[2 * (rank % 2)],
        "ulysses vs varlen": calls[1 + 2 * (rank % 2)],
        "varlen: same total, other boundaries (ring)": lambda: cpattn.ring_attention_varlen(
            x, x, x, cus[rank % 2]),
        "varlen: same total, other boundaries (allgather)": lambda: cpattn.ring_attention_varlen(
            x, x, x, cus[rank % 2], strategy="allgather"),
        "causal on one rank": lambda: cpattn.ring_attention(q, k, v, causal=rank == 0),
        "head_dim differs": lambda: cpattn.ring_attention(
            *(t[..., : 16 - 8 * (rank % 2)].contiguous() for t in (q, k, v))),
        "bad input on one rank only": lambda: cpattn.ring_attention(
            q.bfloat16() if rank == 0 else q, k, v),
    }


def _valid(cpattn, rank: int, world: int) -> bool:
    shards = [_qkv(100 + r) for r in range(world)]
    from cpattn.testing.emulation import ring_attention_emulated

    outs, _ = ring_attention_emulated(*([s[i] for s in shards] for i in range(3)), causal=True)
    return torch.equal(cpattn.ring_attention(*shards[rank], causal=True), outs[rank])


def _run_case(cpattn, rank, world, call) -> dict:
    start = time.perf_counter()
    try:
        call()
        outcome, message = "no error", ""
    except (ValueError, RuntimeError) as e:
        outcome, message = type(e).__name__, str(e)
    seconds = time.perf_counter() - start
    usable = _valid(cpattn, rank, world)
    return {"outcome": outcome, "message": message, "seconds": seconds, "usable": usable}


def _worker(rank: int, world: int, init_file: str, loop: int, out_dir: str) -> None:
    os.environ["CPATTN_COMM_TIMEOUT"] = str(TIMEOUT)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    import cpattn

    res: dict = {"bad": {}, "mismatch": {}}
    for name, call in _bad_inputs(cpattn, rank, world).items():
        res["bad"][name] = _run_case(cpattn, rank, world, call)
    for name, call in _mismatches(cpattn, rank, world).items():
        res["mismatch"][name] = _run_case(cpattn, rank, world, call)

    # Leak loop: RSS over `loop` valid calls, then over `loop` calls that raise (agreement check
    # on every call, "always" mode).
    q, k, v = _qkv(rank)
    for name, call in (("valid ring_attention", lambda: cpattn.ring_attention(q, k, v)),
                       ("ring_attention raising (softmax_scale 0)",
                        lambda: cpattn.ring_attention(q, k, v, softmax_scale=0.0))):
        for _ in range(20):  # warm up allocator and caches
            try:
                call()
            except ValueError:
                pass
        rss, start = [_rss_mib()], time.perf_counter()
        for _ in range(2):  # two windows: growth that goes on in the second one is a leak
            for _ in range(loop):
                try:
                    call()
                except ValueError:
                    pass
            rss.append(_rss_mib())
        res.setdefault("leak", {})[name] = {
            "rss_mib": rss, "ms_per_call": 1e3 * (time.perf_counter() - start) / (2 * loop)}
    # Cost of the check: a small ring call in each mode.
    # (modes interleaved, so that the machine's noise hits them alike)
    times: dict = {"always": [], "once": [], "never": []}
    for _ in range(200):
        for mode, samples in times.items():
            cpattn.set_rank_check(mode)
            dist.barrier()
            t0 = time.perf_counter()
            cpattn.ring_attention(q, k, v)
            samples.append(1e3 * (time.perf_counter() - t0))
    res["check_cost_ms"] = {m: (min(t), sorted(t)[len(t) // 2]) for m, t in times.items()}
    cpattn.set_rank_check("always")
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)

    # Faults last: they leave the group broken by design. The last rank first freezes (makes no
    # call for 4 s), then dies without a word; the others call with timeout=2 s meanwhile.
    if rank == world - 1:
        time.sleep(4.0)
        os._exit(0)
    faults = {}
    for fault, timeout in (("frozen peer", 2.0), ("dead peer", 10.0)):
        start = time.perf_counter()
        try:
            cpattn.ring_attention(q, k, v, timeout=timeout)
            error = "no error"
        except (ValueError, RuntimeError) as e:
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"
        faults[fault] = {"error": error, "seconds": time.perf_counter() - start,
                         "timeout": timeout}
    with open(os.path.join(out_dir, f"fault{rank}.json"), "w") as f:
        json.dump(faults, f)
    os._exit(0)  # the group is broken: skip destroy_process_group


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--loop", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(args.world, os.path.join(tmp, "rdv"), args.loop,
                                                tmp), nprocs=args.world, join=False,
                                 start_method="spawn")
        crashed = False
        try:
            while not ctx.join(timeout=600):
                pass
        except mp.ProcessExitedException as e:
            crashed = True
            print(f"CRASH: {e}", file=sys.stderr)
        ranks = [_load(os.path.join(tmp, f"rank{r}.json")) for r in range(args.world)]
        faults = [_load(os.path.join(tmp, f"fault{r}.json")) for r in range(args.world - 1)]
    _report(ranks, faults, args, crashed)


def _report(ranks, faults, args, crashed) -> None:
    w = args.world

    def summarise(section: str, expect_error: bool = True):
        rows, stats = [], {"tried": 0, "errors": 0, "silent": 0, "hangs": 0, "broken": 0,
                           "texts differ": 0}
        for name in ranks[0][section]:
            per = [r[section][name] for r in ranks]
            stats["tried"] += 1
            raised = all(p["outcome"] != "no error" for p in per)
            stats["errors"] += raised
            stats["silent"] += not raised
            stats["texts differ"] += len({(p["outcome"], p["message"]) for p in per}) > 1
            slow = max(p["seconds"] for p in per)
            stats["hangs"] += slow >= TIMEOUT
            usable = all(p["usable"] for p in per)
            stats["broken"] += not usable
            first_line = per[0]["message"].splitlines()[0] if per[0]["message"] else ""
            rows.append(f"| {name} | {per[0]['outcome']}: {first_line[:90]} | "
                        f"{1e3 * slow:.1f} | {'yes' if usable else 'NO'} |")
        return rows, stats

    print(f"W = {w} gloo ranks on CPU, {TIMEOUT:.0f} s timeout per call"
          f"{' (a rank CRASHED)' if crashed else ''}.\n")
    for section, title in (("bad", "bad input (same on every rank)"),
                           ("mismatch", "ranks disagree")):
        rows, s = summarise(section)
        print(f"| {title} | error on rank 0 | time to error, slowest rank (ms) | next valid call "
              "ok |\n|---|---|---|---|")
        print("\n".join(rows))
        print(f"\n{section}: tried {s['tried']}, errors on every rank {s['errors']}, crashes "
              f"{int(crashed)}, hangs {s['hangs']}, silent (no error) {s['silent']}, group "
              f"unusable afterwards {s['broken']}, error texts that differ between ranks "
              f"{s['texts differ']}\n")
    print(f"| fault (rank {w - 1}) | rank | timeout (s) | error | time to error (s) |")
    print("|---|---|---|---|---|")
    for r, per in enumerate(faults):
        for fault, f in per.items():
            print(f"| {fault} | {r} | {f['timeout']:.0f} | {f['error']} | {f['seconds']:.2f} |")
    print(f"\n| leak loop (rank 0) | RSS before (MiB) | after {args.loop} calls | after "
          f"{2 * args.loop} calls | ms / call |\n|---|---|---|---|---|")
    for name, v in ranks[0]["leak"].items():
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in v["rss_mib"])
              + f" | {v['ms_per_call']:.2f} |")
    cost = ranks[0]["check_cost_ms"]
    print("\nsmall ring_attention call (1x8x4x16 per rank), 200 calls per mode, min / median: "
          + ", ".join(f"{m} {a:.2f} / {b:.2f} ms" for m, (a, b) in cost.items()))


if __name__ == "__main__":
    main()
