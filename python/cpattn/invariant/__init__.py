"""Invariant mode (invariant=True): results bitwise independent of the number of ranks, the
layout and the strategy (docs/invariance.md)."""

from cpattn.invariant.autograd import (
    InvariantAttention, check_invariant_call, gather_global, invariant_attention, stream_global)

__all__ = ["InvariantAttention", "check_invariant_call", "gather_global", "invariant_attention",
           "stream_global"]
