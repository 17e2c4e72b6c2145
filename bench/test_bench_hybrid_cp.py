"""Smoke run of bench/bench_hybrid_cp.py (small layers, packed documents of 512 tokens, W = 2,
one timed step, real gloo ranks): every figure of the row comes out, the check passes on cpattn's
mixers and fails on the ablation (each rank's pieces alone: the check can fail)."""

import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import bench_hybrid_cp as bench  # noqa: E402


def test_hybrid_cp_smoke():
    case = bench.Case("gdn", "packed", "fp32", 512, reps=1, small=True)
    reference = bench.measure(case, 1)
    row = bench.summarise(case, 2, reference, bench.measure(case, 2))
    assert "error" not in row, row
    assert row["documents"] > 1 and row["split"] >= 1, row  # (a document over both ranks)
    assert row["steps"] == 1 and row["t1"] > 0 and row["efficiency_cpu"] > 0, row
    assert all(v > 0 for v in row["cpu"] + row["peak"]), row
    assert all(s is None or s > 0 for s in row["sent"]), row  # (None: no `ss` here)
    assert row["checked"], row
    ablated = bench.measure(dataclasses.replace(case, ablate=True), 2)
    row = bench.summarise(case, 2, reference, ablated)
    assert not row["checked"], row
    assert row["grad_diff"] > 10 * bench.CHECK_BOUND["fp32"], row
