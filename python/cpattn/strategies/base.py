"""Strategy: one way to split attention over the ranks that share a sequence, one object per
strategy (each strategy module defines its entry; cpattn.strategies.registry holds them all).
Its cost model is the planner's (cpattn.plan), which sits below the strategies."""

from collections.abc import Callable
from typing import Optional

import torch

from cpattn.core.layout import granularity, shard_positions
from cpattn.core.validation import group_info
from cpattn.plan.model import CostModel
from cpattn.plan.predict import COST_MODELS  # (through predict: it registers the built-in models)
from cpattn.sharding.sequences import positions, unshard_varlen


class Strategy:
    """One way to split attention over the ranks that share a sequence, as the rest of cpattn
    sees it (ContextParallel, context_attention, shard_batch): its name, whether it runs packed
    documents sharded by a DocumentPlan, the layouts it shards with, how it takes its process
    groups and shards a sequence, its attention entry points and its cost model. Each strategy
    module defines its entry (ring.py: RING, ALLGATHER; ulysses.py: ULYSSES; hybrid.py: HYBRID);
    cpattn.strategies.registry holds them all. Its checks: the layouts it takes (check_layout),
    its process groups (groups); the checks of a call are its attention functions' own.

    attend(cp, q, k, v, **call) and attend_varlen(cp, q, k, v, documents, **call): the public
    attention function of the strategy called with the settings of cp (a ContextParallel);
    `call`: return_lse, return_max_logits, timeout and the attention options, as the public
    functions take them; documents: cu_seqlens, or a DocumentPlan where runs_document_plans.
    emulate(q, k, v, layout, opts) -> (outs, lses): its forward for W ranks emulated in one
    process (lists of shards, AttentionOptions; cpattn.testing.emulation), or None.
    splits_heads: each rank attends the whole sequence with its share of the heads (Ulysses,
    the hybrid's inner groups) rather than moving K/V between sequence shards.
    This base takes one process group (ring, all-gather, Ulysses); hybrid.py's takes two."""

    def __init__(self, name: str, attend: Callable, attend_varlen: Callable, *,
                 layouts: tuple = ("zigzag", "contiguous", "striped"),
                 layout_rule: str = "", emulate: Optional[Callable] = None,
                 splits_heads: bool = False) -> None:
        self.name, self.attend, self.attend_varlen = name, attend, attend_varlen
        self.layouts, self.layout_rule = layouts, layout_rule
        self.emulate, self.splits_heads = emulate, splits_heads

    def __repr__(self) -> str:
        return f"Strategy({self.name!r})"

    @property
    def default_layout(self) -> str:
        return self.layouts[0]

    def check_layout(self, what: str, layout: str) -> None:
        """Raises ValueError unless the strategy shards with `layout` (any of LAYOUTS, checked
        before)."""
        if layout not in self.layouts:
            raise ValueError(f"{what}: strategy {self.name!r} {self.layout_rule}: layout must be "
                             f"{' or '.join(map(repr, self.layouts))}, got {layout!r}")

    # the argument that sets its KV heads per pass or per gather (ring_attention's strategies)
    chunk_option: Optional[str] = None

    def split_group(self, group, candidate) -> object:
        """ContextParallel's `group` argument that runs a planner's candidate (its ulysses and
        ring sizes) over the ranks of `group`."""
        return group

    def groups(self, what: str, group) -> tuple:
        """(group, ring_group, ulysses_group) from ContextParallel's `group` argument: a
        ProcessGroup (None: the world) or a 1-D DeviceMesh; the groups it has not None."""
        if hasattr(group, "get_group") and hasattr(group, "ndim"):  # a DeviceMesh
            if group.ndim != 1:
                raise ValueError(
                    f"{what}: strategy {self.name!r} needs a 1-D DeviceMesh, "
                    f"got {group.ndim} dims (use mesh['cp'] for the context-parallel dim)"
                )
            group = group.get_group()
        return group_info(group)[0], None, None

    def mesh_dims(self, what: str, cp_size: int, sizes: dict) -> tuple[tuple, tuple]:
        """The dims (sizes, names; innermost last) of a device mesh of cp_size ranks that
        `groups` takes (the trainers' (dp, ...) mesh). sizes: the strategy's own size arguments
        given (Ulysses' size for the hybrid), none here."""
        if sizes:
            raise ValueError(f"{what}: {', '.join(sizes)} is not an argument of strategy "
                             f"{self.name!r}")
        return (cp_size,), ("cp",)

    def sequence_groups(self, cp) -> tuple:
        return (cp.group,)

    def rank_and_world(self, cp) -> tuple[int, int]:
        _, rank, world = group_info(cp.group)
        return rank, world

    def granularity(self, cp) -> int:
        return granularity(cp.layout, cp.world_size)

    def positions(self, cp, seqlen: int, device) -> torch.Tensor:
        return positions(seqlen, layout=cp.layout, rank=cp.rank, world_size=cp.world_size,
                         device=device)

    def document_positions(self, cp, documents) -> tuple[torch.Tensor, torch.Tensor]:
        return documents.local_positions(cp.layout, cp.world_size, cp.rank)

    # Every rank's tokens, from any rank (the token mixers' piece map needs them all): a
    # hashable key of what the sharding depends on, then each rank's global indices.
    def shard_key(self, cp) -> tuple:
        """What this strategy's sharding of cp's ranks depends on (hashable)."""
        return (cp.layout, cp.world_size)

    def rank_positions(self, key: tuple, seqlen: int, rank: int) -> torch.Tensor:
        """Global positions (int64, CPU; -1 for padding) of `rank`'s tokens of a sequence of
        `seqlen` under the sharding `key` (shard_key's)."""
        layout, world = key
        return shard_positions(seqlen, layout, world, rank)

    def rank_document_positions(self, key: tuple, documents, rank: int) -> torch.Tensor:
        """Indices into the packed sequence (-1: padding) of `rank`'s tokens of packed
        `documents` sharded per document under `key`."""
        layout, world = key
        return documents.local_positions(layout, world, rank)[0]

    def unshard_documents(self, cp, x_local, documents, dim: int, what: str) -> torch.Tensor:
        return unshard_varlen(x_local, list(documents.cu_seqlens), group=cp.group,
                              layout=cp.layout, dim=dim)

    @property
    def cost_model(self) -> CostModel:
        """The planner's model of this strategy (cpattn.plan.model.COST_MODELS, by name)."""
        return COST_MODELS[self.name]

    @property
    def runs_document_plans(self) -> bool:
        """Whether it runs packed documents sharded by a DocumentPlan (its cost model says:
        the planner, below the strategies, plans documents with it)."""
        return self.cost_model.runs_document_plans
