"""W ranks emulated in one process, for tests and single-device experiments: the test-only ops
(torch.ops.cpattn_testing, a library of their own, loaded by load_ops) and
ring_attention_emulated on them."""

import functools
import glob
import os

import torch

import cpattn
from cpattn.attention import attention
from cpattn.core.layout import LAYOUTS, kv_heads_for_ranks
from cpattn.core.options import AttentionOptions
from cpattn.core.validation import check_choice


@functools.cache
def load_ops() -> None:
    """Loads torch.ops.cpattn_testing (the library next to the installed cpattn._C, built with
    it) and registers its fake kernels; idempotent."""
    here = os.path.dirname(cpattn._C.__file__)  # the compiled files' folder (editable installs)
    found = sorted(glob.glob(os.path.join(here, "libcpattn_testing*.so")))
    if not found:
        raise ImportError(f"cpattn.testing: libcpattn_testing.so not found next to cpattn in "
                          f"{here}: reinstall cpattn from the source tree")
    torch.ops.load_library(found[0])

    @torch.library.register_fake("cpattn_testing::ring_fwd_emulated")
    def _ring_fwd_emulated_fake(q, k, v, layout, *options, **named_options):
        return ([t.new_empty((*t.shape[:-1], vt.shape[-1])) for t, vt in zip(q, v)],
                [t.new_empty((t.shape[0], t.shape[2], t.shape[1]), dtype=torch.float32)
                 for t in q])

    @torch.library.register_fake("cpattn_testing::ring_bwd_emulated")
    def _ring_bwd_emulated_fake(dout, q, k, v, out, lse, layout, *options, **named_options):
        return ([t.new_empty(t.shape) for t in q], [t.new_empty(t.shape) for t in k],
                [t.new_empty(t.shape) for t in v])

    @torch.library.register_fake("cpattn_testing::ring_shift")
    def _ring_shift_fake(send, group_name, timeout_s):
        return send.new_empty(send.shape)

    @torch.library.register_fake("cpattn_testing::ring_post_timing")
    def _ring_post_timing_fake(send, group_name, shifts, timeout_s):
        return torch.empty((2,), dtype=torch.float64)

    @torch.library.register_fake("cpattn_testing::ring_loopback_timing")
    def _ring_loopback_timing_fake(q, k, v, dout, rank, world, layout, *options, **named_options):
        return q.new_empty((2,), dtype=torch.float64)


def ring_attention_emulated(
    q: list, k: list, v: list, *, layout: str = "zigzag", strategy: str = "ring", **options,
) -> tuple[list, list]:
    """W ranks emulated in this process; lists hold one shard per rank. Returns (outs, lses).

    strategy "ring": one thread per rank exchanging K/V through an in-process mailbox (the same
    driver as real ranks, bitwise the same results; on CUDA tensors each virtual rank computes
    on its own stream and receives on its own comm stream, ordered by events as with NCCL).
    "allgather": every rank's steps against the stacked shards. "ulysses": the all-to-alls done
    by concatenation; Ulysses shards contiguously, so it needs layout="contiguous".
    Forward only. **options: causal, softmax_scale, window (as cpattn.attention).
    """
    what = "cpattn.ring_attention_emulated"
    check_choice(what, "strategy", strategy, ("ring", "allgather", "ulysses"))
    check_choice(what, "layout", layout, tuple(LAYOUTS))
    if strategy == "ulysses" and layout != "contiguous":
        raise ValueError(f"{what}: layout={layout!r}: strategy='ulysses' shards the sequence "
                         "contiguously, so it needs layout='contiguous'")
    opts = AttentionOptions.checked(what, q[0].shape[-1],
                                    only=("causal", "softmax_scale", "window"), **options)
    if strategy == "ring":
        load_ops()
        outs, lses = torch.ops.cpattn_testing.ring_fwd_emulated(q, k, v, LAYOUTS[layout],
                                                                 **opts.op_kwargs())
        return list(outs), list(lses)
    world = len(q)
    if strategy == "allgather":
        k_all, v_all = torch.stack(k), torch.stack(v)
        results = [torch.ops.cpattn.gathered_fwd(q[r], k_all, v_all, r, LAYOUTS[layout],
                                                 **opts.op_kwargs())
                   for r in range(world)]
        return [o for o, _ in results], [lse for _, lse in results]
    if q[0].shape[2] % world != 0:
        raise ValueError(f"{what}: heads={q[0].shape[2]}: strategy='ulysses' needs heads "
                         f"divisible by the number of ranks ({world})")
    full_q, full_k, full_v = (torch.cat(t, dim=1) for t in (q, k, v))
    heads = full_q.shape[2]
    repeats = kv_heads_for_ranks(heads, full_k.shape[2], world)
    if repeats is not None:
        full_k, full_v = (t.repeat_interleave(repeats, dim=2) for t in (full_k, full_v))
    per_rank, kv_per_rank = heads // world, full_k.shape[2] // world
    outs, lses = [], []
    for r in range(world):  # rank r: all tokens, its heads
        qh = slice(r * per_rank, (r + 1) * per_rank)
        kh = slice(r * kv_per_rank, (r + 1) * kv_per_rank)
        out, lse = attention(full_q[:, :, qh], full_k[:, :, kh], full_v[:, :, kh],
                             causal=opts.causal, softmax_scale=opts.softmax_scale,
                             window=opts.window, return_lse=True)
        outs.append(out)
        lses.append(lse)
    out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=1)
    return list(out.chunk(world, dim=1)), list(lse.chunk(world, dim=2))
