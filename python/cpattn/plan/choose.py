"""strategy="auto": the machine each process group plans with (set_machine, machine_for) and the
decisions made for it, once per distinct (group, problem, candidate set)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch.distributed as dist

from cpattn.core.validation import env_plan_machine
from cpattn.plan.calibrate import calibrate
from cpattn.plan.model import Candidate, Machine, Prediction, Problem, machine
from cpattn.plan.predict import plan

log = logging.getLogger("cpattn.plan")

_MACHINES: dict = {}
_DECISIONS: dict = {}


def set_machine(m: Optional[Machine], group=None) -> None:
    """The machine strategy="auto" plans with for `group` (None: forget it, calibrate again)."""
    key = _group_key(group)
    if m is None:
        _MACHINES.pop(key, None)
    else:
        _MACHINES[key] = m
    for k in [k for k in _DECISIONS if k[0] == key]:
        del _DECISIONS[k]


def _group_key(group):
    group = group if group is not None else dist.group.WORLD
    return group.group_name


def machine_for(group=None) -> Machine:
    """The machine for `group`: set_machine's, else $CPATTN_PLAN_MACHINE (a preset name or a
    calibration file), else calibrate(group) (collective, cached). The same on every rank."""
    key = _group_key(group)
    if key not in _MACHINES:
        env = env_plan_machine()
        _MACHINES[key] = machine(env) if env else calibrate(group)
    return _MACHINES[key]


def known_machine(group=None) -> Optional[Machine]:
    """The machine for `group` (or its name) where one is known without measuring: set_machine's,
    else $CPATTN_PLAN_MACHINE's; None otherwise (machine_for would calibrate)."""
    key = group if isinstance(group, str) else _group_key(group)
    if key in _MACHINES:
        return _MACHINES[key]
    env = env_plan_machine()
    return machine(env) if env else None


def choose(p: Problem, world: int, cands: Sequence[Candidate], group=None,
           what: str = "cpattn") -> Prediction:
    """The fastest of `cands` for problem p on the ranks of `group`, decided once per distinct
    (group, problem, candidate set) and logged at debug level. Every input must be agreed by all
    ranks (shapes and options validated, machine identical), so the choice is too."""
    key = (_group_key(group), p, tuple(cands))
    if key not in _DECISIONS:
        m = machine_for(group)
        ranked, why = plan(p, m, world, cands)
        _DECISIONS[key] = ranked[0]
        log.debug("%s strategy='auto' on %d ranks (%s): %s", what, world, m.name, why)
    return _DECISIONS[key]
