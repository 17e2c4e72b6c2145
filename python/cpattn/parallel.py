"""`cpattn.ContextParallel`: the context-parallel settings a model uses, made once.

One object holds the process group(s), the strategy and the layout, and answers everything that
depends on them: which tokens this rank holds (`positions`, `shard`, `unshard`) and the attention
call itself (`attention`). The transformers integration, `cpattn.shard_batch` and
`cpattn.cross_entropy` all take it, so positions, labels and attention cannot disagree.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Optional, Union

import torch

from cpattn.core.agreement import agree_on
from cpattn.core.layout import LAYOUTS
from cpattn.core.validation import check_timeout
from cpattn.sharding.packing import Documents
from cpattn.sharding.sequences import shard, unshard
from cpattn.strategies.base import Strategy
from cpattn.strategies.registry import PLAN_STRATEGIES
from cpattn.strategies.registry import STRATEGIES as _REGISTRY


class _WeakGroup:
    """A ContextParallel attribute that holds a process group by weak reference. The object
    lives as long as its user (a model's registered attention keeps it until exit); the group
    must not: torch.distributed holds every group until dist.destroy_process_group(), which then
    frees it and joins its threads (gloo's), not the interpreter's teardown later."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        ref = obj.__dict__[self.slot]
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError(
                f"cpattn.ContextParallel: its process group ({self.slot[1:]}) was destroyed "
                "(dist.destroy_process_group()); make a ContextParallel of a live group")
        return group

    def __set__(self, obj, group) -> None:
        obj.__dict__[self.slot] = None if group is None else weakref.ref(group)


class ContextParallel:
    """Context-parallel settings: who shares a sequence, and how attention runs over it.

    Args:
        group: the ranks that share each sequence: a torch.distributed ProcessGroup (default: the
            world) or a 1-D DeviceMesh. For strategy "hybrid": a 2-D DeviceMesh whose dim 0 is
            the ring and dim 1 Ulysses, or a pair (ring_group, ulysses_group).
        strategy: "ring" (K/V shards travel the ring), "allgather" (all-gather K/V), "ulysses"
            (all-to-all sequence <-> heads; heads % W == 0) or "hybrid" (Ulysses inside, ring
            across).
        layout: how the sequence is cut over the ranks: "zigzag" (default; balanced for causal),
            "contiguous" or "striped". Ulysses needs (and defaults to) "contiguous"; for hybrid
            the layout is that of the ring dimension.
        allgather_chunk: KV heads gathered at a time by "allgather" (default: Hkv / (4 W), at
            least 1).
        ring_chunk: KV heads per pass of "ring" (default: all, one pass; fewer divide the ring's
            memory, see cpattn.ring_attention).
        timeout: seconds to wait for a peer before raising (default $CPATTN_COMM_TIMEOUT, else the
            process group's own timeout).
        invariant: every attention call with invariant=True (results bitwise independent of the
            number of ranks: docs/invariance.md); default $CPATTN_INVARIANT.

    Every rank of the group must make the same object (same strategy and layout). It holds its
    groups by weak reference: it does not keep them alive past dist.destroy_process_group().
    """

    group = _WeakGroup()
    ring_group = _WeakGroup()
    ulysses_group = _WeakGroup()

    def __init__(
        self,
        group=None,
        *,
        strategy: str = "ring",
        layout: Optional[str] = None,
        allgather_chunk: Optional[int] = None,
        ring_chunk: Optional[int] = None,
        timeout: Optional[float] = None,
        invariant: bool = False,
    ) -> None:
        if not isinstance(invariant, bool):
            raise ValueError(f"cpattn.ContextParallel: invariant must be True or False, got "
                             f"{invariant!r}")
        self.invariant = invariant
        if strategy not in _REGISTRY:
            raise ValueError(f"cpattn.ContextParallel: strategy must be one of "
                             f"{tuple(_REGISTRY)}, got {strategy!r}")
        spec = _REGISTRY[strategy]
        if layout is None:
            layout = spec.default_layout
        if layout not in LAYOUTS:
            raise ValueError(
                f"cpattn.ContextParallel: layout must be one of {sorted(LAYOUTS)}, got {layout!r}"
            )
        spec.check_layout("cpattn.ContextParallel", layout)
        self.strategy, self.layout = strategy, layout
        self.allgather_chunk, self.ring_chunk, self.timeout = allgather_chunk, ring_chunk, timeout
        # group None for hybrid: the sequence spans both groups (see `rank` / `world_size`)
        self.group, self.ring_group, self.ulysses_group = spec.groups("cpattn.ContextParallel",
                                                                      group)
        self.rank, self.world_size = spec.rank_and_world(self)

    @property
    def spec(self) -> Strategy:
        """This object's entry of the strategy registry (cpattn.strategies.registry)."""
        return _REGISTRY[self.strategy]

    @property
    def groups(self) -> tuple:
        """The process groups the sequence spans: (group,), or for hybrid (ulysses_group,
        ring_group)."""
        return self.spec.sequence_groups(self)

    def agree(self, what: str, check: Callable[[], tuple[Any, list]],
              every_call: bool = False) -> Any:
        """check() (this rank's checked arguments and their fields, as agree_on takes it) agreed
        over every rank of the sequence: over each of its process groups in turn (hybrid: the
        Ulysses groups, then the ring groups), each carrying the earlier one's error, so a bad
        value on any rank raises on every rank. Returns check()'s checked arguments."""
        timeout = check_timeout(what, self.timeout, *self.groups)
        outcome: list = []  # (checked, fields) of the first group, or its error

        def first():
            try:
                outcome[:] = [check()]
            except (ValueError, TypeError, RuntimeError) as e:
                outcome[:] = [e]
                raise
            return outcome[0]

        def later():
            if isinstance(outcome[0], Exception):
                raise outcome[0]
            return outcome[0]

        try:
            for i, group in enumerate(self.groups):
                try:
                    checked = agree_on(what, group, timeout, first if i == 0 else later,
                                       every_call)
                except (ValueError, TypeError, RuntimeError) as e:
                    if i == len(self.groups) - 1:
                        raise
                    outcome[:] = [e]  # (what every rank of this group raised)
            return checked
        finally:
            outcome.clear()  # no cycle from a raised error's frames back to it

    def with_mode(self, options: dict) -> dict:
        """The attention options of a call made for this object (also by the integrations'
        generation and chunked paths): with invariant=True added when the object has it, so the
        call honours it or raises."""
        return {**options, "invariant": True} if self.invariant else options

    def __deepcopy__(self, memo) -> "ContextParallel":
        """The object itself: it holds process groups, which a copy of a model that refers to
        it (a parallelized model, copy.deepcopy for an EMA or reference model) shares."""
        return self

    def __copy__(self) -> "ContextParallel":
        return self

    def __repr__(self) -> str:
        return (f"ContextParallel(strategy={self.strategy!r}, layout={self.layout!r}, "
                f"rank={self.rank}, world_size={self.world_size})")

    @property
    def granularity(self) -> int:
        """Sequence lengths must be a multiple of this (2W for zigzag, W otherwise; for hybrid
        the ring's granularity times the Ulysses size)."""
        return self.spec.granularity(self)

    def check_seqlen(self, seqlen: int, what: str) -> None:
        """Raises ValueError naming `what` unless seqlen splits evenly under this layout."""
        if seqlen % self.granularity != 0:
            raise ValueError(
                f"{what}: the sequence length ({seqlen}) must be a multiple of "
                f"{self.granularity} for strategy {self.strategy!r} with layout {self.layout!r} "
                f"on {self.world_size} ranks (pad or trim the batch)"
            )

    def positions(self, seqlen: int, device: Optional[torch.device] = None) -> torch.Tensor:
        """Global positions (int64, (seqlen / W,)) of this rank's tokens, in local order."""
        self.check_seqlen(seqlen, "cpattn.ContextParallel.positions")
        return self.spec.positions(self, seqlen, device)

    def document_positions(self, documents: Documents) -> tuple[torch.Tensor, torch.Tensor]:
        """For this rank's local tokens of packed documents (shard_batch's sharding: with a
        plan, the plan's tokens of this rank; else per document over the ranks; for hybrid
        over the ring, each ring shard then cut in U contiguous parts): (index into the packed
        sequence, -1 for padding; position id, 0 for padding)."""
        if documents.plan is not None:
            self._check_plan(documents.plan, "cpattn.ContextParallel.document_positions")
            return documents.plan_positions(self.rank)
        return self.spec.document_positions(self, documents)

    def _check_plan(self, plan, what: str) -> None:
        """A DocumentPlan (from shard_batch) must fit these settings (the same on every rank)."""
        if not self.spec.runs_document_plans:
            raise ValueError(f"{what}: packed documents sharded by a DocumentPlan run with "
                             f"strategies {PLAN_STRATEGIES}, not {self.strategy!r} (shard the "
                             "batch with these settings: cpattn.shard_batch(batch, cp))")
        if (plan.world, plan.layout) != (self.world_size, self.layout):
            raise ValueError(f"{what}: the documents' plan is for {plan.world} ranks with layout "
                             f"{plan.layout!r}; these settings have {self.world_size} ranks "
                             f"with layout {self.layout!r} (shard the batch with them)")

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the full tensor x (sequence along `dim`)."""
        return shard(x, index=self.positions(x.shape[dim], device=x.device), dim=dim)

    def unshard(self, x_local: torch.Tensor, dim: int = 1,
                documents: Optional[Documents] = None) -> torch.Tensor:
        """All-gathers the shards of every rank back into sequence order (differentiable).
        For hybrid the whole world must be the mesh's ranks. documents: a packed batch's
        "cpattn_documents" (from shard_batch; ranks may hold different numbers of tokens):
        x_local's tokens are then shard_batch's, and the result is the packed sequence
        (padding dropped), batch 1 along dim - 1 kept (not with hybrid)."""
        if documents is not None:
            what = "cpattn.ContextParallel.unshard"
            if documents.plan is not None:
                self._check_plan(documents.plan, what)
                return documents.plan.unshard(x_local, group=self.group, dim=dim)
            return self.spec.unshard_documents(self, x_local, documents, dim, what)
        seqlen = x_local.shape[dim] * self.world_size
        return unshard(x_local, group=self.group, dim=dim, seqlen=seqlen,
                       index=self.positions(seqlen))

    def attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
        documents: Optional[Documents] = None, return_lse: bool = False,
        return_max_logits: bool = False, **options,
    ) -> Union[torch.Tensor, tuple[torch.Tensor, ...]]:
        """Exact attention over the sharded sequence with this object's strategy.

        q (batch, seqlen / W, heads, head_dim), k / v (batch, seqlen / W, kv_heads, head_dim),
        this rank's tokens in `positions` order. Returns out like q (and the LSE
        (batch, heads, seqlen / W) with return_lse). Differentiable (also in `sinks`).
        **options: the attention options (cpattn.attention), `causal` among them always (no
            default here: a model's attention is one or the other); the same on every rank.
        documents: packed documents (from cpattn.shard_batch): batch 1, this rank's tokens
            of shard_batch's sharding (document_positions): with documents.plan, the plan's
            (cpattn.shard_documents; the plan balances the work of the mask shard_batch was
            given, and any other causal / window runs exactly on the same tokens); else per
            document (cpattn.shard_varlen's layout; for hybrid over the ring, cut in U parts).
        return_max_logits: also each head's largest logit over the whole sequence (heads,),
            last (as cpattn.ring_attention).
        """
        if "causal" not in options:
            raise TypeError("cpattn.ContextParallel.attention: give causal=True or False")
        options = self.with_mode(options)
        common = dict(return_lse=return_lse, timeout=self.timeout,
                      return_max_logits=return_max_logits, **options)
        if documents is not None:
            if q.shape[0] != 1:
                raise ValueError("cpattn.ContextParallel.attention: packed documents are one "
                                 f"row, got a batch of {q.shape[0]}")
            if documents.plan is not None:
                self._check_plan(documents.plan, "cpattn.ContextParallel.attention")
            result = self.spec.attend_varlen(
                self, q[0], k[0], v[0],
                documents.plan if documents.plan is not None else documents.cu_seqlens,
                **common)
            if not isinstance(result, tuple):
                return result[None]
            out, *rest = result  # (lse (H, T) -> (1, H, T); the max logits stay (H,))
            return (out[None], *(t[None] for t in rest[:int(return_lse)]),
                    *rest[int(return_lse):])
        return self.spec.attend(self, q, k, v, **common)
