"""Invariant mode (invariant=True): results bitwise independent of the number of ranks, the
layout and the strategy (docs/invariance.md). checks.py: what a call needs; global_order.py:
every rank's operands in global order (gathered, streamed, relayouts); autograd.py: the
forward and backward over W ranks; kv_cache.py: a sharded KV cache's blocks of key tiles
(inference.py's prefill and decode)."""

from cpattn.invariant.autograd import InvariantAttention, invariant_attention
from cpattn.invariant.checks import check_invariant_call
from cpattn.invariant.global_order import gather_global, stream_global

__all__ = ["InvariantAttention", "check_invariant_call", "gather_global", "invariant_attention",
           "stream_global"]
