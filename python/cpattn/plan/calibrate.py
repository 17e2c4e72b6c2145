"""Machines measured: calibrate(group) times this group's kernels, copies, ring link and
collectives (seconds, every rank at once, so shared cores count), identical on every rank, cached
to a file."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import socket
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from cpattn import comm
from cpattn.attention import attention
from cpattn.core.validation import env_plan_cache
from cpattn.plan.model import Link, Machine


def _cache_path(key: str) -> str:
    root = env_plan_cache() or os.path.join(
        os.path.expanduser("~"), ".cache", "cpattn")
    return os.path.join(root, f"machine-{key}.json")


def _timed(fn, repeats: int, sync=None, slowest: bool = False, device=None) -> float:
    """Best of `repeats` after a warm-up (the least disturbed run); sync() before each run lines
    the ranks up, so that they compute (and share cores) at the same time. slowest: each run
    ends at a second sync(), when the slowest rank is done: for compute probes, where timing
    each rank's own call ran up to a third fast with 4 ranks on 2 cores (the scheduler lets some
    ranks finish first, and the others then run faster too; a strategy waits for the slowest).
    Collectives need no second sync (they end together), and it would add a barrier's latency.
    device: a CUDA device is synchronised before the clock starts and before it stops (a kernel
    or an NCCL collective returns when queued, not when done)."""
    on_gpu = device is not None and torch.device(device).type == "cuda"

    def drain():
        if on_gpu:
            torch.cuda.synchronize(device)

    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        if sync is not None:
            sync()
        drain()
        start = time.perf_counter()
        fn()
        if slowest:
            sync()
        drain()
        best = min(best, time.perf_counter() - start)
    return best


def _ring_shift(send: torch.Tensor, recv: torch.Tensor, group) -> None:
    """One shift of the ring, to rank + 1 and from rank - 1 of `group`, by the point-to-point
    calls of torch.distributed (c10d's send / recv, as the CPU ring driver makes them)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    prev = dist.get_global_rank(group, (me - 1) % world)
    nxt = dist.get_global_rank(group, (me + 1) % world)
    ops = [dist.P2POp(dist.irecv, recv, prev, group), dist.P2POp(dist.isend, send, nxt, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    if recv.is_cuda:  # NCCL's wait only orders the stream: time the transfer, not its launch
        torch.cuda.synchronize(recv.device)


def _probe_kernel(device, dtype: torch.dtype, block: tuple, sync) -> tuple:
    """(fwd FLOP/s, bwd FLOP/s, seconds per call) from two sizes of a non-causal problem."""
    heads, dim = 4, 64
    big = 2048 if device.type == "cpu" else 8192
    results = []
    for seqlen in (big // 4, big):
        q, k, v = (torch.randn(1, seqlen, heads, dim, device=device, dtype=dtype)
                   .requires_grad_() for _ in range(3))
        dout = torch.randn_like(q)
        t_fwd = _timed(lambda: attention(q, k, v), 3, sync, slowest=True, device=device)
        t_all = _timed(lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout), 3, sync,
                       slowest=True, device=device)
        tiles = -(-seqlen // block[0]) * block[0] * (-(-seqlen // block[1]) * block[1])
        results.append((tiles * heads * dim, t_fwd, max(t_all - t_fwd, 1e-9)))
    (w0, f0, b0), (w1, f1, b1) = results
    fwd_rate = 4 * (w1 - w0) / max(f1 - f0, 1e-9)
    bwd_rate = 10 * (w1 - w0) / max(b1 - b0, 1e-9)
    # inside each timing above (slowest=True), not a call's cost
    barrier = _timed(sync, 5, device=device)
    overhead = max(f0 - barrier - 4 * w0 / fwd_rate, 0.0)
    return fwd_rate, bwd_rate, overhead


def _probe_collectives(group, device, sync) -> dict:
    """{name: (seconds per byte, seconds per call)} of the collectives the all-gather and Ulysses
    strategies call, each timed at two sizes; bytes = what ideally leaves one rank."""
    world = dist.get_world_size(group)
    probes = {
        "all_gather": lambda x: comm.all_gather_flat(
            x.new_empty(world * x.numel()), x, group=group),
        "reduce_scatter": lambda x: comm.reduce_scatter_flat(
            x.new_empty(x.numel() // world), x, group=group),
        # through the helper Ulysses uses: its chunk / concatenate copies count
        "all_to_all": lambda x: comm.all_to_all(x.view(world, -1), 0, 1, group),
    }
    result = {}
    for name, call in probes.items():
        points = []
        for per_rank in (16 << 10, 1 << 20):  # floats per rank's part
            x = torch.randn(world * per_rank, device=device)
            if name == "all_gather":
                x = x[:per_rank].clone()
            points.append(((world - 1) * per_rank * 4,
                           _timed(lambda: call(x), 3, sync, device=device)))
        (n0, t0), (n1, t1) = points
        per_byte = max(t1 - t0, 1e-9) / (n1 - n0)
        result[name] = (per_byte, max(t0 - n0 * per_byte, 1e-7))
    return result


def calibrate(group=None, *, dtypes: Sequence[str] = (), refresh: bool = False,
              memory: Optional[float] = None) -> Machine:
    """Measures this group (a few seconds, every rank at once, so shared cores count) and caches
    the result to ~/.cache/cpattn (or $CPATTN_PLAN_CACHE). Collective: every rank of `group`
    must call it; all get the same Machine (rank 0's cache or the max over ranks of the probes).

    dtypes: those to probe (default: float32 on CPU, bfloat16 and float16 on CUDA).
    """
    group = group if group is not None else dist.group.WORLD
    world, me = dist.get_world_size(group), dist.get_rank(group)
    backend = dist.get_backend(group)
    # GPU ranks whenever the group has NCCL, alone or beside gloo ("cpu:gloo,cuda:nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else \
        torch.device("cpu")
    if not dtypes:
        dtypes = ("float32",) if device.type == "cpu" else ("bfloat16", "float16")
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    ranks_per_node = max(hosts.count(h) for h in hosts)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    key_text = json.dumps([backend, world, ranks_per_node, name, torch.__version__,
                           torch.get_num_threads(), sorted(dtypes)])
    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    box = [None]
    if me == 0 and not refresh and os.path.exists(_cache_path(key)):
        with open(_cache_path(key)) as f:
            box[0] = f.read()
    src = dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    if box[0] is not None:
        return Machine.from_json(box[0])

    block = (64, 128) if device.type == "cpu" else (128, 128)
    sync = functools.partial(dist.barrier, group=group)
    fwd, bwd, overhead = {}, {}, 0.0
    for dt in dtypes:
        f, b, o = _probe_kernel(device, getattr(torch, dt), block, sync)
        fwd[dt], bwd[dt], overhead = f, b, max(overhead, o)
    # elementwise bandwidth: a 32 MiB copy
    src_t = torch.randn(8 << 20, device=device)
    dst_t = torch.empty_like(src_t)
    mem_bw = 2 * src_t.numel() * 4 / _timed(lambda: dst_t.copy_(src_t), 3, sync, slowest=True,
                                           device=device)
    # the ring link: one shift of two sizes
    if world > 1:
        small = torch.zeros(1024, device=device)
        big = torch.zeros(2 << 20, device=device)
        received = torch.empty_like(big)
        shift = lambda t: _ring_shift(t, received[:t.numel()], group)  # noqa: E731
        t_small = _timed(lambda: shift(small), 5, device=device)
        t_big = _timed(lambda: shift(big), 3, device=device)
        bw = (big.numel() - small.numel()) * 4 / max(t_big - t_small, 1e-9)
        lat = max(t_small - small.numel() * 4 / bw, 1e-7)
        collectives = _probe_collectives(group, device, sync)
    else:
        bw, lat, collectives = 1e12, 1e-6, {}
    names = sorted(collectives)
    # every rank gets the mean over ranks of the seconds per unit (one rank's noise is diluted)
    mine = torch.tensor([1 / fwd[d] for d in dtypes] + [1 / bwd[d] for d in dtypes] +
                        [overhead, 1 / mem_bw, 1 / bw, lat] +
                        [x for name in names for x in collectives[name]], dtype=torch.float64)
    mine = mine.to(device)
    dist.all_reduce(mine, group=group)
    v = (mine / world).cpu().tolist()
    n = len(dtypes)
    link = Link(1 / v[2 * n + 2], v[2 * n + 3])
    measured = {name: Link(1 / v[2 * n + 4 + 2 * i], v[2 * n + 5 + 2 * i])
                for i, name in enumerate(names)}
    if memory is None:
        memory = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
                  else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / world)
    m = Machine(
        name=f"calibrated-{name}-W{world}", source=f"measured by cpattn.plan.calibrate on "
        f"{time.strftime('%Y-%m-%d %H:%M')} ({backend}, {world} ranks, {ranks_per_node} per node)",
        ranks_per_node=ranks_per_node, intra=link, inter=link,
        fwd_flops={d: 1 / v[i] for i, d in enumerate(dtypes)},
        bwd_flops={d: 1 / v[n + i] for i, d in enumerate(dtypes)},
        call_overhead=v[2 * n], mem_bandwidth=1 / v[2 * n + 1], memory=float(memory),
        # CPU ranks: gloo's TCP transfers take CPU time from the cores that compute
        overlap=0.5 if device.type == "cpu" else 1.0, block=block,
        reduce_scatter_factor=2.0 if backend == "gloo" else 1.0, collectives=measured)
    if me == 0:
        path = _cache_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(m.to_json())
    return m
