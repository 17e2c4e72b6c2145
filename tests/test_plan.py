"""The cost model (cpattn.plan) on its own: limits, monotonicity, candidates, errors, the CLI.
The distributed checks (bytes really sent, strategy="auto" vs the reference) are in
test_plan_distributed.py."""

import dataclasses
import itertools
import json

import pytest
import torch

import cpattn
from cpattn import plan as P

PROBLEMS = [
    P.Problem(8192, 8, 8, 64, dtype="float32", causal=True),
    P.Problem(4096, 8, 2, 64, dtype="float32", causal=False, mode="forward"),
    P.Problem(16384, 32, 1, 128, dtype="bfloat16", causal=True, window=(1024, 0)),
    P.Problem(0, 8, 4, 64, documents=(1000, 3000, 96), causal=True),
    P.Problem(1 << 20, 64, 8, 128, causal=True),
]
# a calibrated-like CPU machine: its collectives measured, slower than its point-to-point link
MEASURED_CPU = dataclasses.replace(
    P.PRESETS["cpu-gloo"], name="cpu-gloo-measured",
    collectives={"all_gather": P.Link(0.6e9, 3e-4), "reduce_scatter": P.Link(0.4e9, 5e-4),
                 "all_to_all": P.Link(0.5e9, 4e-4)})
MACHINES = [P.PRESETS[n] for n in ("cpu-gloo", "h100-ib", "a100-ib")] + [MEASURED_CPU]


def _fp32_machine(m: P.Machine) -> P.Machine:
    # the GPU presets list bf16 / fp16 only; the model is the same for every dtype
    rates = lambda t: {**t, "float32": t.get("float32", next(iter(t.values())))}  # noqa: E731
    return dataclasses.replace(m, fwd_flops=rates(m.fwd_flops), bwd_flops=rates(m.bwd_flops))


def _scaled(m: P.Machine, bw=1.0, lat=1.0, flops=1.0) -> P.Machine:
    link = lambda k: P.Link(k.bandwidth * bw, k.latency * lat)  # noqa: E731
    return dataclasses.replace(
        m, intra=link(m.intra), inter=link(m.inter),
        collectives={name: link(k) for name, k in m.collectives.items()},
        fwd_flops={d: f * flops for d, f in m.fwd_flops.items()},
        bwd_flops={d: f * flops for d, f in m.bwd_flops.items()})


@pytest.mark.parametrize("p", PROBLEMS, ids=lambda p: f"S{p.seqlen}-H{p.heads}-{p.kv_heads}")
@pytest.mark.parametrize("world", [2, 3, 8, 16])
def test_more_bandwidth_lower_latency_more_flops_never_predict_slower(p, world):
    for m in MACHINES:
        m = _fp32_machine(dataclasses.replace(m, ranks_per_node=4))
        base = P.predict(p, m, world)
        for faster in (_scaled(m, bw=4), _scaled(m, lat=0.25), _scaled(m, flops=2)):
            for a, b in zip(base, P.predict(p, faster, world)):
                assert a.candidate == b.candidate
                assert b.time <= a.time * (1 + 1e-12), (m.name, a.name, a.time, b.time)
                assert b.bytes_sent == a.bytes_sent


def test_w1_is_the_local_kernel():
    m = P.PRESETS["cpu-gloo"]
    for p in PROBLEMS[:3]:
        (pred,) = P.predict(p, _fp32_machine(m), 1)
        assert pred.candidate.strategy == "none" and pred.bytes_sent == 0
        assert pred.exposed_comm == 0
        w = torch.ops.cpattn.schedule_work(p.seqlen, 1, 0, p.causal, *p.window, *m.block)
        tiles, calls = w[0, 0, 1].item(), w[0, 0, 2].item()
        d = p.head_dim * p.batch * p.heads
        kernel = tiles * 4 * d / m.flops(p.dtype, False) + calls * m.call_overhead
        if p.mode == "train":
            kernel += tiles * 10 * d / m.flops(p.dtype, True) + calls * m.call_overhead
        assert kernel <= pred.compute <= kernel * 1.05  # plus the elementwise work


def test_schedule_work_counts_every_visible_pair_once():
    for layout, world, causal, window in itertools.product(
            (0, 1, 2), (1, 2, 3, 4), (False, True), ((-1, -1), (100, 0), (30, 50))):
        S = 2 * world * 96
        w = torch.ops.cpattn.schedule_work(S, world, layout, causal, *window, 64, 128)
        i = torch.arange(S)[:, None]
        j = torch.arange(S)[None, :]
        vis = torch.ones(S, S, dtype=torch.bool)
        if causal:
            vis &= j <= i
        if window[0] >= 0:
            vis &= j >= i - window[0]
        if window[1] >= 0:
            vis &= j <= i + window[1]
        assert w[..., 0].sum().item() == vis.sum().item()
        assert (w[..., 1] >= w[..., 0]).all()


def test_bytes_follow_the_strategies_messages():
    p = P.Problem(4096, 8, 2, 64, dtype="float32", causal=True)
    m = P.PRESETS["cpu-gloo"]
    kv = 2 * (4096 // 4) * 2 * 64 * 4  # one rank's K/V shard, bytes
    got = {r.name: r.bytes_sent for r in P.predict(p, m, 4)}
    assert got["ring/zigzag"] == 2 * 3 * kv + 4 * kv  # K/V twice round, fp32 dK/dV W hops
    assert got["allgather/zigzag"] == 2 * 3 * kv + 3 * kv * m.reduce_scatter_factor
    q = 4096 // 4 * 8 * 64 * 4
    assert got["ulysses"] == pytest.approx(3 / 4 * 2 * (2 * q + 2 * q // 8 * 4))


def test_zigzag_balances_causal_and_memory_falls_with_world():
    p = P.Problem(32768, 8, 8, 64, dtype="float32", causal=True)
    m = P.PRESETS["cpu-gloo"]
    by = {r.name: r for r in P.predict(p, m, 4)}
    assert by["ring/zigzag"].compute < 0.7 * by["ring/contiguous"].compute
    peaks = [next(r for r in P.predict(p, m, w) if r.name == "ring/zigzag").peak_memory
             for w in (2, 4, 8)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_short_sequences_stay_local_long_ones_are_split():
    m = P.PRESETS["h100-ib"]
    short = P.Problem(512, 32, 8, 128, causal=True, mode="forward")
    long = P.Problem(131072, 32, 8, 128, causal=True, mode="forward")
    assert P.plan(short, m, 16)[0][0].candidate.strategy == "none"
    assert P.plan(long, m, 16)[0][0].candidate.strategy != "none"


def test_candidates_cover_every_factorisation_and_skip_invalid_ones():
    p = P.Problem(8192, 8, 2, 64)
    names = {c.name for c in P.candidates(p, 8)}
    assert {"none", "ring/zigzag", "allgather/striped", "ulysses", "hybrid 2x4/zigzag",
            "hybrid 4x2/zigzag"} <= names
    names = {c.name for c in P.candidates(P.Problem(8192, 6, 2, 64), 4)}
    assert "ulysses" not in names and "hybrid 2x2/zigzag" in names  # 6 heads: U = 2 only
    varlen = {c.strategy for c in P.candidates(P.Problem(0, 8, 2, 64, documents=(5, 70)), 4)}
    assert varlen == {"none", "ring", "allgather"}
    assert {c.name for c in P.candidates(P.Problem(4096, 8, 2, 64, mode="decode"), 4)} == {
        "none", "sharded-cache"}


def test_decode_splits_a_long_cache():
    m = P.PRESETS["h200-ib"]
    p = P.Problem(1 << 20, 64, 8, 128, mode="decode")
    ranked, why = P.plan(p, m, 8)
    assert ranked[0].candidate.strategy == "sharded-cache" and "sharded-cache" in why


def test_memory_that_does_not_fit_ranks_last():
    m = dataclasses.replace(P.PRESETS["h100-ib"], memory=2e9)
    ranked, why = P.plan(P.Problem(1 << 20, 64, 8, 128, causal=True), m, 8)
    assert all(r.fits for r in ranked[:1]) or "nothing fits" in why
    assert [r.fits for r in ranked] == sorted((r.fits for r in ranked), reverse=True)


def test_short_of_memory_the_ring_runs_in_passes():
    p = P.Problem(1 << 18, 32, 8, 128, causal=True, dtype="bfloat16")
    cands = [P.Candidate("ring", "zigzag"), P.Candidate("allgather", "zigzag", chunk=2)]
    roomy = dataclasses.replace(P.PRESETS["h100-ib"], memory=80e9)
    ranked, _ = P.plan(p, roomy, 8, cands)
    assert [r.name for r in ranked] == ["ring/zigzag", "allgather/zigzag"]  # nothing added
    one_pass = ranked[0].peak_memory
    short = dataclasses.replace(roomy, memory=0.8 * one_pass)
    ranked, why = P.plan(p, short, 8, cands)
    best = ranked[0]
    assert best.candidate.strategy == "ring" and 0 < best.candidate.chunk < 8 and best.fits
    assert why.startswith(best.name) and best.name == f"ring/zigzag/{best.candidate.chunk}kv"
    passes = {r.candidate.chunk: r for r in ranked if r.candidate.strategy == "ring"}
    assert sorted(passes) == [0, 1, 2, 4]
    # fewer KV heads per pass: less memory, more (smaller) messages, never faster
    for more, fewer in ((0, 4), (4, 2), (2, 1)):
        assert passes[fewer].peak_memory < passes[more].peak_memory
        assert passes[fewer].time >= passes[more].time


def test_problem_and_machine_errors_name_the_argument():
    with pytest.raises(ValueError, match="heads/kv_heads"):
        P.Problem(1024, 6, 4, 64)
    with pytest.raises(ValueError, match="mode"):
        P.Problem(1024, 8, 4, 64, mode="inference")
    with pytest.raises(ValueError, match="h100-ib"):
        P.machine("h300")
    with pytest.raises(ValueError, match="no float32 throughput"):
        P.predict(P.Problem(1024, 8, 4, 64, dtype="float32"), P.PRESETS["h100-ib"], 2)


def test_measured_collectives_price_the_strategies_that_call_them():
    p = P.Problem(8192, 8, 8, 64, dtype="float32", causal=True, mode="train")
    slow_a2a = dataclasses.replace(MEASURED_CPU, collectives={
        **MEASURED_CPU.collectives, "all_to_all": P.Link(0.05e9, 4e-4)})
    base = {r.name: r.time for r in P.predict(p, MEASURED_CPU, 4)}
    slow = {r.name: r.time for r in P.predict(p, slow_a2a, 4)}
    assert slow["ulysses"] > base["ulysses"] and slow["hybrid 2x2/zigzag"] > base[
        "hybrid 2x2/zigzag"]
    assert slow["ring/zigzag"] == base["ring/zigzag"]
    assert slow["allgather/zigzag"] == base["allgather/zigzag"]
    # and the unmeasured machine prices them from its link
    plain = {r.name: r.time for r in P.predict(p, P.PRESETS["cpu-gloo"], 4)}
    assert plain["ulysses"] != base["ulysses"] and plain["ring/zigzag"] == base["ring/zigzag"]


def test_machine_json_round_trip(tmp_path):
    m = P.PRESETS["a100-ib"]
    assert P.Machine.from_json(m.to_json()) == m
    assert P.Machine.from_json(MEASURED_CPU.to_json()) == MEASURED_CPU
    path = tmp_path / "m.json"
    path.write_text(m.to_json())
    assert P.machine(str(path)) == m
    assert json.loads(m.to_json())["source"].startswith("published/nominal")


def test_cli_prints_the_ranked_table(capsys, tmp_path):
    from cpattn.__main__ import main

    assert main(["plan", "--seqlen", "1M", "--heads", "64", "--kv-heads", "8", "--head-dim",
                 "128", "--world", "64", "--ranks-per-node", "8", "--machine", "h200-ib",
                 "--causal"]) == 0
    out = capsys.readouterr().out
    assert "| 1 |" in out and "hybrid" in out and "published/nominal" in out


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from cpattn.__main__ import main

    png = tmp_path / "plan.png"
    assert main(["plan", "--seqlen", "64K", "--heads", "16", "--kv-heads", "4", "--world", "8",
                 "--machine", "h100-ib", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_package_exports():
    assert cpattn.plan is P and callable(cpattn.context_attention)
