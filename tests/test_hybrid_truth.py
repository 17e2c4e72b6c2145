"""Hybrid models under context parallelism against a float64 truth (one process, the model in
float64, transformers' own mixers), on real gloo ranks at W = 2: every family of
tests/hybrid_models.py on zigzag sequences and on packed documents under a document plan (one
split over the ranks, the short ones whole), in fp32 and under torch.autocast("cpu", bfloat16).

The rule (hybrid_models.distances: relative distances, gradients under 1 % of the largest one
measured against 1 % of it; hybrid_models.assert_near_truth): in fp32 the loss and every
parameter's gradient under CP are no farther from the truth than 4x one process's own fp32 run
(for that parameter, or for its median one), or 1e-4; under bf16 autocast no farther than 2x one
process's own bf16 autocast run, or BF16_FLOOR. Mixtures of experts route
every token to all experts there (a top-k choice is a step function: bf16 rounding flips it for
some token, in one process as under CP). Ablation: the mixers on their rank's pieces alone are
far outside the rule."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import hybrid_models as H  # noqa: E402

import cpattn  # noqa: E402

from distributed import run_ranks  # noqa: E402

PLAN_LENGTHS = [30, 5, 4, 9]
FP32 = (4.0, 1e-4)  # (factor, floor)
BF16_FLOOR = 2.0**-8  # bf16's unit roundoff: the distance of rounding the truth itself
BF16 = (2.0, BF16_FLOOR)
BATCHES = (("sequences", H.sequences, None), ("plan", lambda: H.packed(PLAN_LENGTHS),
                                               PLAN_LENGTHS))


def _family(kind: str, cp) -> None:
    for name, batch_of, lengths in BATCHES:
        batch, what = batch_of(), f"{kind} {name}"
        cfg = H.config(kind)
        truth = H.reference(cfg, batch, lengths, dtype=torch.float64)
        H.assert_near_truth(H.reference(cfg, batch, lengths), H.cp_step(cfg, batch, cp), truth,
                            f"{what} fp32", *FP32)
        cfg = H.config(kind, all_experts=True)
        truth = H.reference(cfg, batch, lengths, dtype=torch.float64)
        H.assert_near_truth(H.reference(cfg, batch, lengths, autocast=True),
                            H.cp_step(cfg, batch, cp, autocast=True), truth,
                            f"{what} bf16 autocast", *BF16)


def _all(rank: int, world: int, kinds) -> None:
    cp = cpattn.ContextParallel(strategy="ring", layout="zigzag")
    for kind in kinds:
        _family(kind, cp)


KINDS = tuple(H.FAMILIES)


@pytest.mark.parametrize("part", [KINDS[:6], KINDS[6:12], KINDS[12:]],
                         ids=lambda k: f"{k[0]}..{k[-1]}")
def test_families_near_the_float64_truth(part):
    run_ranks(2, _all, part)


def _ablation(rank: int, world: int) -> None:
    cp = cpattn.ContextParallel(strategy="ring", layout="zigzag")
    for kind in ("bamba", "qwen3_5", "mamba", "kimi_linear"):
        cfg = H.config(kind, all_experts=True)
        batch = H.sequences()
        truth = H.reference(cfg, batch, None, dtype=torch.float64)
        one = H.reference(cfg, batch, None, autocast=True)
        with H.mixers_alone():
            alone = H.cp_step(cfg, batch, cp, autocast=True)
        with pytest.raises(AssertionError, match="farther from the float64 truth"):
            H.assert_near_truth(one, alone, truth, kind, *BF16)


def test_the_rule_can_fail():
    run_ranks(2, _ablation)
