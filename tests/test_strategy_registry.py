"""The strategy registry (cpattn.strategies.registry): one entry per strategy, which every list of
strategy names and every choice by name outside the strategies asks."""

import pytest

import cpattn
from cpattn import plan
from cpattn.parallel import PLAN_STRATEGIES, STRATEGIES
from cpattn.plan.memory import MEMORY_MODELS
from cpattn.plan.predict import TIME_MODELS
from cpattn.strategies import registry
from cpattn.strategies.ring import RING_ATTENTION_STRATEGIES


def test_names_come_from_the_registry():
    assert tuple(registry.STRATEGIES) == STRATEGIES == ("ring", "allgather", "ulysses", "hybrid")
    assert registry.PLAN_STRATEGIES == PLAN_STRATEGIES == ("ring", "allgather")
    assert RING_ATTENTION_STRATEGIES == ("ring", "allgather", "auto")
    assert all(s.name == name for name, s in registry.STRATEGIES.items())


def test_every_strategy_has_its_cost_model():
    """The planner's models (below the strategies) know every registered strategy; the hybrid's
    memory is part of its time model."""
    for name, s in registry.STRATEGIES.items():
        assert s.time_model is TIME_MODELS[name]
        assert s.memory_model is MEMORY_MODELS.get(name)
        assert (s.memory_model is None) == (name == "hybrid")
    p = plan.Problem(4096, 8, 2, 64, causal=True)
    assert (registry.STRATEGIES["ring"].memory_model(p, 2, "zigzag", None, False)
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
