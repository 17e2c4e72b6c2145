"""torch.compile(fullgraph=True) of a tiny transformers Llama under context parallelism (W = 2):
0 graph breaks, and the same loss and gradients as the single-process step (ring; the other
strategies compile at the op level in tests/test_fake_kernels.py). The rank-agreement check runs
while a graph is traced, not in the compiled graph: once per compiled signature; a mismatch
raises on every rank. The position check runs in the graph (an all-reduced flag): positions
wrong on one rank raise on every rank. Packed documents compile too (ring and Ulysses).

The aot_eager backend traces exactly what inductor would receive (dynamo graph, fake kernels,
AOT autograd's joint graph) without code generation, which would take minutes on CI's 2 cores."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import cpattn  # noqa: E402

from distributed import run_ranks  # noqa: E402
from transformers_models import (  # noqa: E402
    assert_step_matches,
    cp_model,
    cp_run,
    reference_step,
    tiny_batch,
    tiny_config,
)


def _agreement_header_rounds() -> int:
    from cpattn.core import agreement as _agreement

    return _agreement.header_rounds


def _compiled_steps(rank, world, strategies):
    from torch._dynamo.utils import counters

    config = tiny_config()
    batch = tiny_batch(config)
    ref = reference_step(config, batch)
    for strategy in strategies:
        torch._dynamo.reset()
        counters.clear()
        if strategy == "hybrid":
            from torch.distributed.device_mesh import init_device_mesh

            cp = cpattn.ContextParallel(init_device_mesh("cpu", (2, 2)), strategy="hybrid")
        else:
            cp = cpattn.ContextParallel(strategy=strategy)
        group = dist.group.WORLD
        before = _agreement_header_rounds()
        model, forward = cp_model(config, cp, f"cpattn_{strategy}", compile_model="aot_eager")
        got = cp_run(model, forward, batch, cp, loss_group=group)
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert_step_matches(ref, got, f"compiled {strategy} W={world}")
        traced = _agreement_header_rounds() - before
        assert traced > 0, "the agreement check did not run while tracing"
        # A second step reuses the graphs: the same result, no check, no recompilation.
        assert_step_matches(ref, cp_run(model, forward, batch, cp, loss_group=group),
                            f"second compiled {strategy} step")
        assert _agreement_header_rounds() - before == traced


def _compiled_mismatch(rank, world):
    """Ranks that trace different signatures (here: head dims) all raise the agreement error."""
    cp = cpattn.ContextParallel()
    d = 16 if rank == 0 else 8
    q, k, v = (torch.randn(1, 8, 2, d) for _ in range(3))
    f = torch.compile(lambda q, k, v: cp.attention(q, k, v, causal=True), fullgraph=True,
                      backend="aot_eager")
    with pytest.raises(Exception, match="disagree"):
        f(q, k, v)
    # The group is still usable afterwards (reset: rank 1 would now compile head_dim as dynamic,
    # rank 0 not, and a dynamic dimension is compared by name only).
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    f(q, k, v)


def _compiled_positions(rank, world):
    """Compiled: position ids wrong on rank 1 only (local ones: rank 0's are global under the
    contiguous layout) raise on both ranks, from the graph's all-reduced check."""
    from cpattn.integrations.transformers import register

    torch._dynamo.reset()
    cp = cpattn.ContextParallel(layout="contiguous")
    config = tiny_config()
    model, forward = cp_model(config, cp, register(cp, "cpattn_positions"),
                              compile_model="aot_eager")
    local = cpattn.shard_batch(tiny_batch(config), cp)
    forward(input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False)
    wrong = torch.arange(local["input_ids"].shape[1])[None].expand_as(local["position_ids"])
    with pytest.raises(RuntimeError, match="position_ids are not the position ids"):
        forward(input_ids=local["input_ids"], position_ids=wrong.contiguous(), use_cache=False)


def _compiled_packed(rank, world):
    """Compiled: a packed batch (DataCollatorWithFlattening) with ring and Ulysses, loss and
    gradients equal to one process running each document on its own."""
    from test_transformers_models import LENGTHS, cp_step, model_config, packed, reference

    config = model_config("llama")
    batch = packed(LENGTHS)
    ref = reference(config, batch, lengths=LENGTHS)
    for strategy in ("ring", "ulysses"):
        torch._dynamo.reset()
        got = cp_step(config, batch, cpattn.ContextParallel(strategy=strategy),
                      compile_backend="aot_eager")
        assert_step_matches(ref, got, f"compiled packed {strategy}")
    # shard_batch's DocumentPlan with a split document and whole ones (ranks hold different
    # numbers of tokens), compiled.
    from test_transformers_models import PLAN_LENGTHS

    batch = packed(PLAN_LENGTHS)
    torch._dynamo.reset()
    got = cp_step(config, batch, cpattn.ContextParallel(), compile_backend="aot_eager",
                  check=lambda local: local["cpattn_documents"].plan.split or pytest.fail())
    assert_step_matches(reference(config, batch, lengths=PLAN_LENGTHS), got,
                        "compiled packed plan")


def _compiled_w2(rank, world):
    _compiled_steps(rank, world, ["ring"])
    _compiled_mismatch(rank, world)
    _compiled_positions(rank, world)
    _compiled_packed(rank, world)


def test_fullgraph_compile_matches_eager_and_mismatch_raises_w2():
    """One spawn: the model compiled (ring), then the mismatch (CI time: each model compile
    costs tens of seconds here; allgather, Ulysses, hybrid and varlen compile at the op level in
    tests/test_fake_kernels.py, through the same autograd Functions and fakes)."""
    run_ranks(2, _compiled_w2)
