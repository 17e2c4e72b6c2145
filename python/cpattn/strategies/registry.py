"""The registry of the context-parallel strategies: one entry (a Strategy, strategies/base.py)
each, defined next to its code. Every list of strategy names and every choice by strategy name
outside the strategies themselves asks this (ContextParallel, context_attention, shard_batch)."""

from cpattn.strategies.base import Strategy
from cpattn.strategies.hybrid import HYBRID
from cpattn.strategies.ring import ALLGATHER, RING
from cpattn.strategies.ulysses import ULYSSES

# By name, in the order error messages list them.
STRATEGIES: dict[str, Strategy] = {s.name: s for s in (RING, ALLGATHER, ULYSSES, HYBRID)}
# Those that run packed documents sharded by a DocumentPlan (shard_batch's default for them).
PLAN_STRATEGIES = tuple(name for name, s in STRATEGIES.items() if s.runs_document_plans)
