"""`python -m cpattn demo`: memory per rank falls with W (the table parsed), every W passes the
check against one device and float64, and a result that differs exits nonzero."""

import subprocess
import sys

from cpattn.__main__ import main
from cpattn.cli import demo as _demo


def _rows(text: str) -> dict[int, dict[str, str]]:
    """The table's rows by W, keyed by the header's column names."""
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        row = dict(zip(names, (c.strip() for c in line.strip("|").split("|"))))
        rows[int(row["W"])] = row
    return rows


def test_demo_memory_per_rank_falls_with_world():
    proc = subprocess.run([sys.executable, "-m", "cpattn", "demo", "--seqlen", "1024", "--iters",
                           "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _rows(proc.stdout)
    assert sorted(rows) == [1, 2, 4], proc.stdout
    mib = [float(rows[w]["peak memory per rank (MiB)"]) for w in (1, 2, 4)]
    assert mib[0] > mib[1] > mib[2] > 0, proc.stdout
    for w, row in rows.items():
        assert int(row["tokens per rank"]) == 1024 // w
        assert row["check"] == "ok", proc.stdout
        assert float(row["max error vs float64"]) < _demo.TOLERANCE["float64 rows"]
        assert float(row["max diff vs one device"]) < _demo.TOLERANCE["one device"]
    assert proc.stdout.strip().splitlines()[-1].startswith("OK: every W matches"), proc.stdout


def test_demo_exits_nonzero_when_a_result_differs(monkeypatch, capfd):
    one_device = _demo._single_device

    def wrong_reference(args):  # the ranks' dq now differs from the reference by 1e-2
        inputs, results, seconds, peak = one_device(args)
        results[1] = results[1] + 1e-2
        return inputs, results, seconds, peak

    monkeypatch.setattr(_demo, "_single_device", wrong_reference)
    assert main(["demo", "--world", "1", "--seqlen", "256", "--heads", "2", "--iters", "1"]) == 1
    out = capfd.readouterr().out
    assert _rows(out)[1]["check"] == "FAILED"
    assert out.strip().splitlines()[-1].startswith("FAILED: W=1 differs")


def test_world_flag_forms(monkeypatch):
    seen = []
    monkeypatch.setattr(_demo, "ring_demo", lambda args: seen.append(args.world) or 0)
    for argv in ([], ["--world", "2"], ["--world", "1,2,4"], ["--worlds", "1", "2,4"]):
        assert main(["demo", *argv]) == 0
    assert seen == [[1, 2, 4], [2], [1, 2, 4], [1, 2, 4]]


def test_verdict_says_when_memory_does_not_fall():
    row = _demo.Row(world=1, step=0.1, peak=3 << 20, comm_wait=0.0, err_exact=0.0,
                    err_single=0.0)
    flat = [_demo.Row(**{**row.__dict__, "world": w}) for w in (1, 2)]
    assert "does not fall" in _demo._verdict(flat)
    assert _demo._verdict(flat).startswith("OK")
