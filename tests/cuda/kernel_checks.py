"""The kernel checks: forward and backward of cpattn.attention on a grid of shapes, masks and
dtypes, every head dim, and the score options (softcap, ALiBi, prefix, sinks, v's head dim)."""

from __future__ import annotations

import tempfile

import torch

import cpattn

import check_harness as harness
from check_harness import (
    GRAD_TOL,
    OUT_TOL,
    Skip,
    check,
    check_close,
    check_grads,
    check_lse,
    compare_all,
    gen_for,
    out_tol,
    randn,
    reference,
    reference_attention,
    run_attention,
    world_of_one,
)

MASKS = {
    "full": (False, (-1, -1)),
    "causal": (True, (-1, -1)),
    "left": (False, (37, -1)),
    "both": (False, (70, 9)),
    "causal_left": (True, (129, -1)),
    "zero": (False, (0, 0)),
}
# (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim)
SHAPES = [
    (1, 1, 1, 1, 1, 64),
    (2, 7, 7, 2, 2, 128),
    (1, 63, 65, 3, 3, 64),
    (1, 65, 63, 4, 1, 128),
    (2, 129, 200, 4, 2, 64),
    (1, 200, 129, 4, 2, 128),
    (1, 1, 300, 4, 1, 64),
    (1, 300, 300, 2, 1, 40),
    (3, 17, 5, 6, 2, 80),
    (1, 1000, 1000, 2, 2, 128),
    (1, 777, 1500, 8, 1, 64),
]


def _shape_id(s):
    return "x".join(map(str, s))


def _fwd_bwd_case(shape, mask, dtype):
    def run():
        name = f"fwd_bwd {_shape_id(shape)} {mask} {dtype}"
        g = gen_for(name)
        b, sq, sk, h, hkv, d = shape
        causal, window = MASKS[mask]
        q, k, v = randn((b, sq, h, d), g, dtype), randn((b, sk, hkv, d), g, dtype), \
            randn((b, sk, hkv, d), g, dtype)
        dout = randn((b, sq, h, d), g, dtype)
        got = run_attention(q, k, v, dout, causal, window)
        ref = reference(q, k, v, dout, causal, window)
        compare_all(name, got, ref, dtype)

    return run


for _shape in SHAPES:
    for _mask in MASKS:
        for _dtype in (torch.bfloat16, torch.float16):
            if _dtype == torch.float16 and _mask not in ("full", "causal"):
                continue
            check(f"fwd_bwd/{_shape_id(_shape)}/{_mask}/{str(_dtype)[6:]}")(
                _fwd_bwd_case(_shape, _mask, _dtype))


def _compiled_head_dims() -> list[int]:
    if harness.DEV == "cpu":
        return [32, 64, 96, 128, 160, 192, 256]  # the CPU kernels take every head dim
    return [int(x) for x in str(cpattn.build_info()["cuda_head_dims"]).replace(";", ",").split(",")
            if x.strip()]


def _head_dim_case(d):
    def run():
        if d > max(_compiled_head_dims()):  # a smaller one is zero-padded up to a compiled one
            raise Skip(f"no compiled head dim >= {d} (CPATTN_CUDA_HEAD_DIMS=ALL builds them all)")
        for dtype, (causal, window) in ((torch.bfloat16, (True, (-1, -1))),
                                        (torch.float16, (False, (40, 7)))):
            name = f"head_dim {d} {dtype}"
            g = gen_for(name)
            q, k, v = randn((2, 77, 4, d), g, dtype), randn((2, 93, 2, d), g, dtype), \
                randn((2, 93, 2, d), g, dtype)
            dout = randn(q.shape, g, dtype)
            got = run_attention(q, k, v, dout, causal, window)
            compare_all(name, got, reference(q, k, v, dout, causal, window), dtype)

    return run


for _d in (32, 64, 96, 128, 160, 192, 256):
    check(f"head_dim/{_d}")(_head_dim_case(_d))


# Score options (issue 12): softcap, ALiBi, prefix-LM, sinks, v's own head dim; forward, lse and
# every gradient (the sinks' too) against the float64 reference, alone and combined.
# (name, (batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, head_dim_v), causal, window,
#  options of cpattn.attention)
SCORE_CASES = [
    ("softcap_causal", (1, 131, 131, 2, 2, 64, 64), True, (-1, -1), {"softcap": 1.5}),
    ("alibi_gqa_bottom_right", (1, 100, 150, 4, 2, 64, 64), True, (-1, -1), {"alibi": True}),
    ("prefix", (2, 90, 140, 2, 1, 128, 128), True, (-1, -1), {"prefix_len": 100}),
    ("prefix_window", (1, 80, 260, 2, 2, 64, 64), True, (16, -1), {"prefix_len": 40}),
    ("sinks_window", (2, 70, 90, 2, 1, 64, 64), False, (40, 9), {"sinks": True}),
    ("sinks_empty_rows", (1, 40, 50, 2, 1, 64, 64), True, (3, -1), {"sinks": True}),
    ("softcap_alibi_window", (1, 130, 200, 4, 2, 128, 128), True, (30, -1),
     {"softcap": 2.0, "alibi": True}),
    ("dv_gqa", (1, 77, 93, 4, 2, 128, 64), True, (-1, -1), {}),
    ("all_dv", (1, 77, 163, 4, 2, 64, 40), True, (60, -1),
     {"softcap": 3.0, "alibi": True, "prefix_len": 20, "sinks": True}),
]


def _score_case(shape, causal, window, opts, dtype):
    def run():
        name = f"score_options {_shape_id(shape)} {opts} {dtype}"
        g = gen_for(name)
        b, sq, sk, h, hkv, d, dv = shape
        q, k, v = randn((b, sq, h, d), g, dtype), randn((b, sk, hkv, d), g, dtype), \
            randn((b, sk, hkv, dv), g, dtype)
        dout = randn((b, sq, h, dv), g, dtype)
        kw = {"softcap": opts.get("softcap", 0.0), "prefix_len": opts.get("prefix_len", 0)}
        if opts.get("alibi"):
            kw["alibi_slopes"] = 0.5 ** torch.arange(1, h + 1, dtype=torch.float32)
        sinks = torch.randn(h, generator=g).float() if opts.get("sinks") else None
        # reference: float64 on the CPU, the sinks' gradient included
        qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
        sr = sinks.double().requires_grad_(True) if sinks is not None else None
        out_r, lse_r = reference_attention(qr, kr, vr, causal=causal, window=window, sinks=sr,
                                           **kw)
        ref_grads = torch.autograd.grad((out_r * dout.double().cpu()).sum(),
                                        (qr, kr, vr) + ((sr,) if sr is not None else ()))
        # cpattn on this device
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        sg = sinks.to(harness.DEV).requires_grad_(True) if sinks is not None else None
        dkw = dict(kw)
        if "alibi_slopes" in dkw:
            dkw["alibi_slopes"] = dkw["alibi_slopes"].to(harness.DEV)
        out, lse = cpattn.attention(qg, kg, vg, causal=causal, window=window, sinks=sg,
                                    return_lse=True, **dkw)
        grads = torch.autograd.grad(out, (qg, kg, vg) + ((sg,) if sg is not None else ()), dout)
        check_close(f"{name} out", out.detach(), out_r.detach().to(out.device),
                    out_tol(dtype, out.dtype))
        check_lse(lse.detach(), lse_r.detach().float())
        for n, x, r in zip(("dq", "dk", "dv"), grads[:3], ref_grads[:3]):
            assert x.shape == r.shape, f"{name} {n}: shape {tuple(x.shape)} != {tuple(r.shape)}"
            check_close(f"{name} {n}", x, r.to(x.device), GRAD_TOL[dtype])
        if sg is not None:
            check_close(f"{name} dsinks", grads[3], ref_grads[3].to(grads[3].device),
                        GRAD_TOL[dtype])

    return run


for _name, _shape, _causal, _window, _opts in SCORE_CASES:
    for _dtype in (torch.bfloat16, torch.float16):
        check(f"score_options/{_name}/{str(_dtype)[6:]}")(
            _score_case(_shape, _causal, _window, _opts, _dtype))


@check("score_options/ring_decode_sinks_W=1")
def _score_options_strategies():
    """Sinks (and ALiBi, softcap) through the drivers that merge partial results and add the sinks
    once at the end (apply_sinks_ / sink_bwd on this device): ring over a one-rank group, and
    prefill + decode against the float64 reference."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        world_of_one(tmp)
        try:
            g = gen_for("score_options strategies")
            q, k, v = randn((1, 256, 4, 64), g), randn((1, 256, 2, 64), g), \
                randn((1, 256, 2, 64), g)
            dout = randn(q.shape, g)
            sinks = torch.randn(4, generator=g).float()
            slopes = 0.5 ** torch.arange(1, 5, dtype=torch.float32)
            kw = {"causal": True, "softcap": 2.0}
            qr, kr, vr = (t.detach().double().cpu().requires_grad_(True) for t in (q, k, v))
            sr = sinks.double().requires_grad_(True)
            out_r, _ = reference_attention(qr, kr, vr, sinks=sr, alibi_slopes=slopes, **kw)
            ref = (out_r.detach(), None) + torch.autograd.grad(
                (out_r * dout.double().cpu()).sum(), (qr, kr, vr))
            sg = sinks.to(harness.DEV).requires_grad_(True)
            for strategy in ("ring", "allgather"):
                sg.grad = None
                check_grads(f"ring_attention {strategy} sinks+alibi+softcap",
                             lambda a, b, c: cpattn.ring_attention(
                                 a, b, c, layout="zigzag", strategy=strategy, sinks=sg,
                                 alibi_slopes=slopes.to(harness.DEV), **kw), q, k, v, dout, ref)
            # prefill then decode with sinks: the sink counted once per row
            n = 192
            full = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                       causal=True, sinks=sinks.double())[0]
            cache = cpattn.KVCacheShard(1, 256, 2, 64, dtype=q.dtype, device=q.device)
            out = cpattn.prefill_attention(q[:, :n], k[:, :n], v[:, :n], cache, layout="zigzag",
                                           sinks=sinks.to(harness.DEV))
            check_close("prefill sinks out", out, full[:, :n].to(harness.DEV), OUT_TOL[q.dtype])
            cache.append(k[:, n:n + 1], v[:, n:n + 1])
            out = cpattn.decode_attention(q[:, n:n + 1], cache, sinks=sinks.to(harness.DEV))
            check_close("decode sinks out", out, full[:, n:n + 1].to(harness.DEV), OUT_TOL[q.dtype])
        finally:
            cpattn.destroy_communicators()
            dist.destroy_process_group()


@check("decode/batched_split_kv")
def _decode_batched():
    """cache_attention_fwd on this device (CUDA: the batched split-KV decode kernel) against the
    CPU op over the same shards, rank by rank: sequences of 0, 1, 37 and 2000 tokens, W ranks x
    interleave, GQA, Sq 1 and 3, masks, a prefix, softcap and ALiBi on global positions."""
    g = gen_for("decode batched split-kv")
    ops = torch.ops.cpattn
    lens = torch.tensor([0, 1, 37, 2000])
    b, h, hkv, d = 4, 8, 2, 64
    slopes = 0.5 ** torch.arange(1, h + 1, dtype=torch.float32)
    options = [{}, {"causal": True}, {"causal": True, "window_left": 100},
               {"causal": True, "window_left": 30, "prefix_len": 50},
               {"causal": True, "softcap": 3.0, "alibi_slopes": slopes}]
    for world, interleave in ((1, 1), (2, 4), (3, 1)):
        slots = ops.cache_local_count(int(lens.max()), 0, world, interleave) + 3
        kc, vc = randn((b, slots, hkv, d), g), randn((b, slots, hkv, d), g)
        for sq in (1, 3):
            q = randn((b, sq, h, d), g)
            q_start = (lens - sq).clamp(min=0)
            for kw in options:
                for rank in range(world):
                    def run(dev):
                        a = {k: (x.to(dev) if torch.is_tensor(x) else x) for k, x in kw.items()}
                        return ops.cache_attention_fwd(
                            q.to(dev), kc.to(dev), vc.to(dev), lens, q_start, rank, world,
                            interleave, torch.float32, softmax_scale=d ** -0.5, **a)
                    out, lse = run(harness.DEV)
                    ref_out, ref_lse = run("cpu")
                    name = f"decode W={world} I={interleave} Sq={sq} rank {rank} {sorted(kw)}"
                    check_close(name, out, ref_out.to(out.device), OUT_TOL[torch.bfloat16])
                    check_lse(lse, ref_lse)
