"""The planner's model of the mixers' state scan (cpattn.plan.mixer_scan): its traffic is the
scan's, its memory what the scan allocates (one process, the ranks' routes stood in for), bytes
and memory grow with W for the all-gather and with log W for the tree, the choice, and
`python -m cpattn plan --mixer`. On gloo ranks: bench/bench_scan.py (bench/RESULTS.md)."""

from __future__ import annotations

import math

import pytest
import torch

from cpattn.__main__ import main
from cpattn.memory import counting
from cpattn.mixers import build_piece_map, state_scan
from cpattn.mixers.tree_scan import scan_traffic, with_scan
from cpattn.plan.mixer_scan import (
    LAYERS,
    MixerLayer,
    predict_allgather,
    predict_scan,
    predict_tree,
    sequence_chains,
    tree_steps,
    tree_traffic,
)
from cpattn.plan.model import machine

from mixer_reference import sharded_problem

SHAPES = {"matrix": MixerLayer("GDN-like", "matrix", 4, 64, 64),
          "scalar": MixerLayer("Mamba-2-like", "scalar", 8, 64, 64)}


@pytest.mark.parametrize("world", [2, 3, 5, 8])
def test_chains_traffic_is_the_piece_maps(world):
    """sequence_chains' analytic traffic equals the traffic of the real zigzag / contiguous
    piece maps."""
    for layout in ("zigzag", "contiguous"):
        piece_map = sharded_problem("sequence", world, (4 * world,), layout)[0]
        assert tree_traffic(sequence_chains(layout, world), world) == scan_traffic(piece_map)


class _StandIn:
    """One rank's exchange with the other ranks stood in for: gathers copies of x, routes return
    zeros of the size received (in the graph, as a received buffer is)."""

    def __init__(self, world: int):
        self.world = world

    def __call__(self, x):
        return torch.stack([x] * self.world)

    def route(self, x, edges, rank, tag):
        return torch.zeros(sum(n for _, dst, n in edges if dst == rank)) + 0 * x.sum()


@pytest.mark.parametrize("world", [2, 4, 7])
def test_memory_model_against_the_allocations(world):
    """Bytes each rank's forward leaves allocated (cpattn.memory.counting: output and what
    autograd keeps) equal the model's `kept` (up to the small index tensors); its peak is
    within 15 % of the model's (the most of any rank, both methods, matrix and scalar
    transitions)."""
    piece_map = sharded_problem("sequence", world, (8 * world,), "zigzag")[0]
    traffic = scan_traffic(piece_map)
    gloo = machine("cpu-gloo")
    for kind, layer in SHAPES.items():
        h, k, v = layer.heads, layer.key_dim, layer.value_dim
        m_shape = (h, k, k) if kind == "matrix" else (h,)
        for method, model in (("allgather", predict_allgather), ("tree", predict_tree)):
            kept, peak = 0, 0
            for rank in range(world):
                n = len(piece_map.pieces[rank])
                m = (torch.rand(1, n, *m_shape) * 0.1).requires_grad_(True)
                s = torch.randn(1, n, h, k, v).requires_grad_(True)
                with counting() as c:
                    entry = state_scan(m, s, piece_map, rank, kind,
                                       with_scan(_StandIn(world), method))
                kept, peak = max(kept, c.current), max(peak, c.peak)
                del entry  # (and the graph it holds)
            pred = model(layer, traffic, gloo)
            assert abs(kept - pred.kept) <= 4096, (kind, method, kept, pred.kept)  # (+ indices)
            assert abs(peak - pred.peak) <= 0.15 * peak, (kind, method, peak, pred.peak)


def test_growth_with_w():
    """Per rank, the all-gather's bytes and memory grow with W, the tree's with log W; the
    tree's steps are 1 + ceil(log2(2W - 2)) on a zigzag sequence."""
    layer, h100 = LAYERS["qwen3.5-27b"], machine("h100-ib")
    preds = {}
    for world in (8, 64, 1024):
        traffic = tree_traffic(sequence_chains("zigzag", world), world)
        preds[world] = (predict_allgather(layer, traffic, h100), predict_tree(layer, traffic, h100))
        assert preds[world][1].detail["steps"] == 1 + math.ceil(math.log2(2 * world - 2))
    for i in (0, 1):
        ratio = preds[1024][i].bytes_sent / preds[8][i].bytes_sent
        if i == 0:
            assert ratio > 100  # (W - 1): 1023 / 7
        else:
            assert ratio < 3  # steps 12 / 5 at most
    assert preds[1024][1].kept < preds[8][1].kept * 3 < preds[1024][0].kept


def test_choice():
    """Few ranks on a fast link: the all-gather (one step); Qwen3.5-27B at W = 256: the tree
    (the all-gather's 48 layers do not fit in 80 GB); with no room for either, the smaller."""
    layer = MixerLayer("small", "scalar", 8, 64, 64)
    traffic = tree_traffic(sequence_chains("zigzag", 2), 2)
    assert predict_scan(layer, traffic, machine("h100-ib"))[0].method == "allgather"
    big, h100 = LAYERS["qwen3.5-27b"], machine("h100-ib")
    preds = predict_scan(big, tree_traffic(sequence_chains("zigzag", 256), 256), h100)
    assert preds[0].method == "tree" and not preds[1].fits
    huge = MixerLayer("huge", "matrix", 48, 128, 128, layers=100000)
    preds = predict_scan(huge, tree_traffic(sequence_chains("zigzag", 64), 64), h100)
    assert preds[0].method == "tree" and not preds[0].fits
    assert tree_steps(1) == 0 and tree_steps(2) == 1 and tree_steps(3) == 2
    with pytest.raises(ValueError, match=r"MixerLayer: kind='dense': must be one of"):
        MixerLayer("x", "dense", 1, 1, 1)
    with pytest.raises(ValueError, match=r"sequence_chains: layout='striped'"):
        sequence_chains("striped", 4)


def test_plan_command_prints_the_scan(capsys):
    assert main(["plan", "--seqlen", "64K", "--world", "256", "--mixer", "qwen3.5-27b"]) == 0
    out = capsys.readouterr().out
    assert "state scan of Qwen3.5-27B gated delta rule on 256 ranks: tree" in out
    assert main(["plan", "--seqlen", "8K", "--world", "2", "--mixer", "scalar:8:64:64:4",
                 "--mixer-layout", "zigzag"]) == 0
    assert "on 2 ranks: allgather" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--mixer 'gdn': must be one of"):
        main(["plan", "--seqlen", "8K", "--mixer", "gdn"])


def test_piece_map_traffic_of_documents():
    """A document plan: whole documents take no part; the traffic counts the split ones only."""
    piece_map = build_piece_map([torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 6])],
                                (0, 2, 7))  # [0, 2) whole on rank 0, [2, 7) over both
    traffic = scan_traffic(piece_map)
    assert traffic.linked == (1, 1) and traffic.slots == 1 and len(traffic.tree) == 1
    assert traffic.tree[0][0][:4] == (0, 1, 0, 0) and traffic.tree[0][1][:4] == (0, 0, 0, 1)
