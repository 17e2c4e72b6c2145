"""Every environment variable the Python side reads, in one place (docs/environment.md lists
them; the C++ side's are in csrc/include/cpattn/env.h). Read when called, never cached here."""

import os
from typing import Optional


def comm_timeout() -> Optional[str]:
    """$CPATTN_COMM_TIMEOUT: seconds to wait for a peer when a call gives no timeout."""
    return os.environ.get("CPATTN_COMM_TIMEOUT")


def rank_check() -> Optional[str]:
    """$CPATTN_RANK_CHECK: the agreement check's mode (cpattn.set_rank_check)."""
    return os.environ.get("CPATTN_RANK_CHECK")


def plan_cache() -> Optional[str]:
    """$CPATTN_PLAN_CACHE: the folder of the planner's calibration cache."""
    return os.environ.get("CPATTN_PLAN_CACHE")


def plan_machine() -> Optional[str]:
    """$CPATTN_PLAN_MACHINE: the planner's machine (a preset name or a JSON file)."""
    return os.environ.get("CPATTN_PLAN_MACHINE")


def invariant() -> Optional[str]:
    """$CPATTN_INVARIANT: "1" makes invariant=True the default of the attention functions."""
    return os.environ.get("CPATTN_INVARIANT")
