"""The algebra of the state scan's summaries: a recurrence affine in its state runs a piece as
S_out = M S_in + S, so a piece is summarised by (M, S), and two pieces in sequence by their
composition. Both scans (the all-gather's fold in cpattn.mixers.primitives and the tree in
cpattn.mixers.tree_scan) use these two functions.

Shapes per kind of transition M: "scalar" (..., H), one number per head broadcast over its state;
"diagonal" like the state (elementwise); "matrix" (..., H, K, K) applied as M @ S to a state
(..., H, K, V).
"""

from __future__ import annotations

import torch


def apply_transition(kind: str, m: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """M S for a transition of `kind`: "scalar" m (..., H) times s (..., H, K, V); "diagonal" m
    like s (elementwise); "matrix" m (..., H, K, K) @ s (..., H, K, V)."""
    if kind == "matrix":
        return m @ s
    if kind == "scalar":
        return m.reshape(*m.shape, *([1] * (s.dim() - m.dim()))) * s
    return m * s


def compose(kind: str, second: tuple, first: tuple) -> tuple:
    """(M2, B2) after (M1, B1): (M2 M1, M2 B1 + B2), the summary of two pieces in sequence."""
    (m2, b2), (m1, b1) = second, first
    if kind == "matrix":
        m = m2 @ m1
    else:
        m = m2 * m1
    return m, apply_transition(kind, m2, b1) + b2
