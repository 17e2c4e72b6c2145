"""W ranks emulated in one process, for tests and single-device experiments: the test-only ops
(torch.ops.cpattn_testing, a library of their own, loaded by load_ops) and
ring_attention_emulated on them."""

import functools
import glob
import os

import torch

import cpattn
from cpattn.core.layout import LAYOUTS
from cpattn.core.options import AttentionOptions
from cpattn.core.validation import check_choice
from cpattn.strategies.registry import STRATEGIES


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
    emulated = tuple(name for name, s in STRATEGIES.items() if s.emulate is not None)
    check_choice(what, "strategy", strategy, emulated)
    check_choice(what, "layout", layout, tuple(LAYOUTS))
    spec = STRATEGIES[strategy]
    spec.check_layout(what, layout)
    opts = AttentionOptions.checked(what, q[0].shape[-1],
                                    only=("causal", "softmax_scale", "window"), **options)
    load_ops()
    return spec.emulate(q, k, v, layout, opts, what)
