"""What the failure-semantics tests share: small inputs, and a valid ring call checked against the
emulated ring (the group still works after an error)."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.testing.emulation import ring_attention_emulated

TIMEOUT = 20  # a test that hangs fails on this instead of the CI limit


def qkv(seed: int, b=1, s=8, h=2, hkv=2, d=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, s, h, d, generator=gen, dtype=dtype),
            torch.randn(b, s, hkv, d, generator=gen, dtype=dtype),
            torch.randn(b, s, hkv, d, generator=gen, dtype=dtype))


@functools.cache
def emulated_ring(world: int) -> tuple[list, list]:
    """Every rank's shards of a valid call and the emulated ring's outputs for them."""
    shards = [qkv(100 + r) for r in range(world)]
    outs, _ = ring_attention_emulated([s[0] for s in shards], [s[1] for s in shards],
                                      [s[2] for s in shards], causal=True)
    return shards, outs


def valid_call_matches(rank: int, world: int) -> None:
    """A valid ring call on the group returns the emulated ring's result (the group works)."""
    shards, outs = emulated_ring(world)
    out = cpattn.ring_attention(*shards[rank], causal=True, timeout=TIMEOUT)
    assert torch.equal(out, outs[rank])


def raises_same_everywhere(match: str, fn, *args, group=None, within: float = 1.0,
                           **kwargs) -> str:
    """fn(*args, **kwargs) raises a ValueError matching `match` within `within` seconds on this
    rank, with the same text as on every other rank of `group` (every rank of it must call
    this). Returns the text."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=match) as info:
        fn(*args, **kwargs)
    elapsed = time.monotonic() - start
    assert elapsed < within, f"{match}: raised after {elapsed:.2f} s"
    text = str(info.value)
    texts = [None] * dist.get_world_size(group)
    dist.all_gather_object(texts, text, group=group)
    assert all(t == text for t in texts), "the ranks raised different texts:\n" + "\n".join(
        f"rank {r}: {t}" for r, t in enumerate(texts))
    return text
