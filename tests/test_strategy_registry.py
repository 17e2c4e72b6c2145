"""The strategy registry (cpattn.strategies.registry): one entry per strategy, which every list of
strategy names and every choice by name outside the strategies asks."""


import pytest
import torch

import cpattn
from cpattn import plan
from cpattn.parallel import PLAN_STRATEGIES
from cpattn.plan.model import COST_MODELS, CostModel, register_cost_model
from cpattn.strategies import registry
from cpattn.strategies.base import Strategy
from cpattn.strategies.ring import RING_ATTENTION_STRATEGIES

from distributed import run_ranks
from reference import reference_attention


def test_names_come_from_the_registry():
    assert tuple(registry.STRATEGIES) == ("ring", "allgather", "ulysses", "hybrid")
    assert registry.PLAN_STRATEGIES == PLAN_STRATEGIES == ("ring", "allgather")
    assert RING_ATTENTION_STRATEGIES == ("ring", "allgather", "auto")
    assert all(s.name == name for name, s in registry.STRATEGIES.items())


def test_every_strategy_has_its_cost_model():
    """The planner's models (below the strategies) know every registered strategy; the hybrid's
    memory is part of its time model."""
    for name, s in registry.STRATEGIES.items():
        assert s.cost_model is COST_MODELS[name]
        assert (s.cost_model.memory is None) == (name == "hybrid")
        assert s.runs_document_plans == (name in PLAN_STRATEGIES)
    p = plan.Problem(4096, 8, 2, 64, causal=True)
    assert (registry.STRATEGIES["ring"].cost_model.memory(p, 2, "zigzag", None, False)
            == plan.memory(p, "ring", 2))


def test_contextparallel_checks_stay_as_they_were():
    with pytest.raises(ValueError, match=r"strategy must be one of \('ring', 'allgather', "
                                         r"'ulysses', 'hybrid'\), got 'rings'"):
        cpattn.ContextParallel(strategy="rings")
    with pytest.raises(ValueError, match="strategy 'ulysses' shards the sequence contiguously: "
                                         "layout must be 'contiguous', got 'zigzag'"):
        cpattn.ContextParallel(strategy="ulysses", layout="zigzag")
    with pytest.raises(ValueError, match="strategy 'hybrid' needs group = a 2-D DeviceMesh"):
        cpattn.ContextParallel(strategy="hybrid")


# --- a new strategy: its module's Strategy, its registry entry and its cost model --------------

_TOY_CALLS: list = []


def _toy_attend(cp, q, k, v, **call):
    """The toy strategy runs the ring (contiguous), counting its calls."""
    _TOY_CALLS.append(cp.strategy)
    return cpattn.ring_attention(q, k, v, group=cp.group, layout=cp.layout, **call)


def _toy_candidates(p, world, layouts):
    if p.mode == "decode" or world == 1 or "contiguous" not in layouts:
        return []
    return [plan.Candidate("toy", "contiguous")]


def _toy_time(p, m, world, c):  # faster than anything: "auto" picks it where it is offered
    return plan.Prediction(c, 1e-9, 1e-9, 0.0, 0.0, 0.0)


TOY = Strategy("toy", _toy_attend, _toy_attend, layouts=("contiguous",))
TOY_COST = CostModel("toy", _toy_time, _toy_candidates, lambda c: f"toy/{c.layout}")


class _Registered:
    """The toy strategy in both registries while the block runs."""

    def __enter__(self):
        registry.STRATEGIES["toy"] = TOY
        register_cost_model(TOY_COST)

    def __exit__(self, *exc):
        registry.STRATEGIES.pop("toy")
        COST_MODELS.pop("toy")


def test_a_new_strategy_is_a_candidate_and_named_by_its_cost_model():
    p = plan.Problem(4096, 8, 2, 64, causal=True)
    with _Registered():
        names = [c.name for c in plan.candidates(p, 2)]
        assert "toy/contiguous" in names
        ranked, why = plan.plan(p, plan.PRESETS["cpu-gloo"], 2)
        assert ranked[0].candidate.strategy == "toy", why
    assert "toy/contiguous" not in [c.name for c in plan.candidates(p, 2)]


def _auto_runs_the_toy(rank: int, world: int) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64, 4, 16, dtype=torch.float64).float() for _ in range(3))
    want = reference_attention(q, k, v, causal=True)[0].float()
    plan.set_machine(plan.PRESETS["cpu-gloo"])
    _TOY_CALLS.clear()
    try:
        with _Registered():
            assert cpattn.ContextParallel(strategy="toy").layout == "contiguous"
            got = cpattn.context_attention(q, k, v, causal=True)
        assert _TOY_CALLS == ["toy"], _TOY_CALLS
        with pytest.raises(ValueError, match="strategy must be one of"):
            cpattn.ContextParallel(strategy="toy")
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        # ablation: without the entry "auto" never runs it
        _TOY_CALLS.clear()
        cpattn.context_attention(q, k, v, causal=True)
        assert _TOY_CALLS == []
    finally:
        plan.set_machine(None)


def test_auto_considers_and_runs_a_new_strategy():
    """Adding a strategy = its module (a Strategy) + its registry entry + its cost model:
    strategy="auto" then considers it and, where it is fastest, runs it (2 gloo ranks)."""
    run_ranks(2, _auto_runs_the_toy)
