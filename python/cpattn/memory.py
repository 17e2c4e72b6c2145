"""Measuring memory: bytes the CPU allocator hands out, and the buffers cpattn keeps.

`counting()` counts, in any thread, every CPU tensor allocation made inside the block and gives
the peak of those bytes alive at once: the memory a call adds on top of what existed before it
(its inputs). It sees every at::Tensor (outputs, saved tensors, the ring's buffers, packing
copies, gloo receives into tensors), not the CPU kernels' small per-thread scratch (malloc'd
directly) nor Python objects. On CUDA use torch.cuda.max_memory_allocated. The model of these
bytes, per strategy, is cpattn.plan.memory.

`release_buffers()` frees the receive buffers and dK/dV accumulators the CPU ring keeps between
calls (reused by the next call of the same shapes, e.g. the next layer).
"""

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Counts:
    """Bytes of the allocations made in a `counting()` block: `peak` alive at once, `current`
    still alive at its end (both 0 until the block ends)."""

    peak: int = 0
    current: int = 0


@contextlib.contextmanager
def counting() -> Iterator[Counts]:
    """with cpattn.memory.counting() as c: ...; then c.peak (bytes). Not nestable."""
    counts = Counts()
    torch.ops.cpattn.memory_counting(True)
    try:
        yield counts
    finally:
        counts.current, counts.peak = torch.ops.cpattn.memory_counts()
        torch.ops.cpattn.memory_counting(False)


def release_buffers() -> int:
    """Frees the ring's receive buffers and fp32 dK/dV accumulators kept between calls (CPU
    tensors; on CUDA torch's caching allocator keeps them: torch.cuda.empty_cache()). Returns
    their bytes. The next ring call allocates them again."""
    return int(torch.ops.cpattn.release_buffers())
