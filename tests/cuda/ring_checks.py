"""The distributed checks: the emulated ring for W = 1..4 and every layout, NCCL over a one-rank
group, every strategy and the inference API on this device."""

from __future__ import annotations

import tempfile

import torch

import cpattn
from cpattn.core.layout import LAYOUTS

import check_harness as harness
from check_harness import (
    GRAD_TOL,
    OUT_TOL,
    check,
    check_close,
    check_grads,
    check_lse,
    gen_for,
    randn,
    reference,
    sync,
    world_of_one,
)


def _shard(x, layout, world, rank, dim=1):
    pos = cpattn.positions(x.shape[dim], layout=layout, rank=rank, world_size=world)
    return x.index_select(dim, pos.to(x.device))


def _unshard(parts, layout, world, dim=1):
    seqlen = parts[0].shape[dim] * world
    order = torch.cat([cpattn.positions(seqlen, layout=layout, rank=r, world_size=world)
                       for r in range(world)]).to(parts[0].device)
    full = torch.empty_like(torch.cat(parts, dim))
    full.index_copy_(dim, order, torch.cat(parts, dim))
    return full


def _emulated_ring_case(world):
    def run():
        for n, (layout, (causal, window), (h, hkv)) in enumerate(
                [(lay, m, hh) for lay in LAYOUTS
                 for m in [(False, (-1, -1)), (True, (-1, -1)), (True, (45, 0)), (False, (30, 20))]
                 for hh in [(4, 4), (4, 1)]]):
            g = gen_for(f"ring {world} {n}")
            seqlen = 2 * world * 48
            q, k, v = randn((2, seqlen, h, 64), g), randn((2, seqlen, hkv, 64), g), \
                randn((2, seqlen, hkv, 64), g)
            dout = randn(q.shape, g)
            what = f"W={world} {layout} causal={causal} window={window} heads={h}/{hkv}"
            sh = [[_shard(t, layout, world, r) for r in range(world)] for t in (q, k, v, dout)]
            opts = dict(softmax_scale=0.125, causal=causal, window_left=window[0],
                        window_right=window[1])
            outs, lses = torch.ops.cpattn_testing.ring_fwd_emulated(
                sh[0], sh[1], sh[2], LAYOUTS[layout], **opts)
            dqs, dks, dvs = torch.ops.cpattn_testing.ring_bwd_emulated(
                sh[3], sh[0], sh[1], sh[2], list(outs), list(lses), LAYOUTS[layout], **opts)
            sync()
            ref = reference(q, k, v, dout, causal=causal, window=window, scale=0.125)
            check_close(f"{what} out", _unshard(list(outs), layout, world), ref[0].to(harness.DEV),
                        OUT_TOL[torch.bfloat16])
            check_lse(_unshard(list(lses), layout, world, dim=2), ref[1])
            for name, parts, r in zip(("dq", "dk", "dv"), (dqs, dks, dvs), ref[2:]):
                check_close(f"{what} {name}", _unshard(list(parts), layout, world),
                            r.to(harness.DEV), GRAD_TOL[torch.bfloat16])

    return run


for _w in (1, 2, 3, 4):
    check(f"ring_emulated/W={_w}")(_emulated_ring_case(_w))


@check("ring_nccl/W=1")
def _nccl_w1():
    """A one-rank process group (gloo): NCCL bootstrap through it, send/recv to self, the ring
    forward / backward on CUDA tensors, and a re-created WORLD getting its own communicator."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            g = gen_for("nccl")
            x = randn((3, 1000), g)
            for i in range(20):  # more shifts than event slots
                y = torch.ops.cpattn_testing.ring_shift(x + i, group.group_name, 60.0)
                assert torch.equal(y, x + i), "NCCL send/recv to self changed the data"
            q, k, v = randn((1, 256, 4, 128), g), randn((1, 256, 2, 128), g), \
                randn((1, 256, 2, 128), g)
            dout = randn(q.shape, g)
            qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
            out = cpattn.ring_attention(qg, kg, vg, causal=True, layout="zigzag")
            dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
            ref = reference(q, k, v, dout, causal=True)
            check_close("nccl out", out.detach(), ref[0].to(harness.DEV), OUT_TOL[torch.bfloat16])
            for n, x_, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref[2:]):
                check_close(f"nccl {n}", x_, r.to(harness.DEV), GRAD_TOL[torch.bfloat16])
        finally:
            dist.destroy_process_group()
        # WORLD re-created under the same name without destroy_communicators(): the cached
        # communicator belongs to the old group object and must not be reused (it is aborted and
        # replaced), and the re-created group works.
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv2", rank=0, world_size=1)
        try:
            y = torch.ops.cpattn_testing.ring_shift(x, dist.group.WORLD.group_name, 60.0)
            assert torch.equal(y, x), "NCCL send/recv to self after re-initialisation"
            assert cpattn.destroy_communicators() == 1, "one live communicator expected"
            assert cpattn.destroy_communicators() == 0
        finally:
            dist.destroy_process_group()


@check("strategies/W=1")
def _strategies():
    """Every public strategy on this device's tensors over a one-rank group (NCCL for CUDA):
    ring and all-gather (fixed and varlen), Ulysses, hybrid; forward and backward."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        world_of_one(tmp)
        try:
            world = dist.group.WORLD
            g = gen_for("strategies")
            q, k, v = randn((1, 256, 4, 64), g), randn((1, 256, 2, 64), g), \
                randn((1, 256, 2, 64), g)
            dout = randn(q.shape, g)
            causal_ref = reference(q, k, v, dout, causal=True)
            for strategy in ("ring", "allgather"):
                check_grads(f"ring_attention {strategy}", lambda a, b, c: cpattn.ring_attention(
                    a, b, c, causal=True, layout="zigzag", strategy=strategy), q, k, v, dout,
                    causal_ref)
            window_ref = reference(q, k, v, dout, causal=True, window=(37, -1))
            check_grads("ring_attention allgather window", lambda a, b, c: cpattn.ring_attention(
                a, b, c, causal=True, window=(37, -1), strategy="allgather"), q, k, v, dout,
                window_ref)
            check_grads("ulysses_attention", lambda a, b, c: cpattn.ulysses_attention(
                a, b, c, causal=True), q, k, v, dout, causal_ref)
            check_grads("hybrid_attention", lambda a, b, c: cpattn.hybrid_attention(
                a, b, c, ulysses_group=world, ring_group=world, causal=True), q, k, v, dout,
                causal_ref)
            # Packed documents 100 + 156 (W = 1: the shard is the packed sequence itself).
            cu = torch.tensor([0, 100, 256])
            refs = [reference(q[:, a:b], k[:, a:b], v[:, a:b], dout[:, a:b], causal=True)
                    for a, b in ((0, 100), (100, 256))]
            # (out, lse, dq, dk, dv) of the packed sequence, batch dim dropped; lse is (H, T)
            doc_ref = [torch.cat([r[i][0] for r in refs], dim=1 if i == 1 else 0)
                       for i in range(5)]
            for strategy in ("ring", "allgather"):
                check_grads(f"ring_attention_varlen {strategy}",
                             lambda a, b, c: cpattn.ring_attention_varlen(
                                 a, b, c, cu, causal=True, strategy=strategy),
                             q[0], k[0], v[0], dout[0], doc_ref)
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()


@check("inference/W=1")
def _inference():
    """Chunked prefill into a KV cache on this device, then decode steps, over a one-rank group:
    every query against the float64 causal reference of the whole sequence."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        world_of_one(tmp)
        try:
            g = gen_for("inference")
            n, steps = 192, 3
            q, k, v = randn((2, n + steps, 4, 64), g), randn((2, n + steps, 2, 64), g), \
                randn((2, n + steps, 2, 64), g)
            full = reference(q, k, v, causal=True)[0]  # (B, S, H, D)
            cache = cpattn.KVCacheShard(2, 256, 2, 64, dtype=q.dtype, device=q.device)
            outs = [cpattn.prefill_attention(q[:, a:a + 96], k[:, a:a + 96], v[:, a:a + 96],
                                             cache, layout="zigzag") for a in (0, 96)]
            check_close("prefill (two chunks) out", torch.cat(outs, 1), full[:, :n].to(harness.DEV),
                        OUT_TOL[q.dtype])
            for step in range(steps):
                t = n + step
                cache.append(k[:, t:t + 1], v[:, t:t + 1])
                for comm in ("all_gather", "reduce_scatter"):
                    out = cpattn.decode_attention(q[:, t:t + 1], cache, comm=comm)
                    check_close(f"decode {comm} step {step}", out, full[:, t:t + 1].to(harness.DEV),
                                OUT_TOL[q.dtype])
            parts = [reference(q[:, -1:], k[:, a:b], v[:, a:b]) for a, b in ((0, 90), (90, n))]
            out, lse = cpattn.merge_attention_states([p[0].float().to(harness.DEV) for p in parts],
                                                     [p[1].float().to(harness.DEV) for p in parts])
            ref = reference(q[:, -1:], k[:, :n], v[:, :n])
            check_close("merge_attention_states out", out, ref[0].to(harness.DEV), 1e-5)
            check_lse(lse, ref[1].float())
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()
