"""A rank that caught cpattn errors and destroyed its group leaves no gloo thread behind, and its
process exits 0 through the normal interpreter shutdown, every time (an error's traceback once
kept the group alive through a reference cycle; gloo's threads then aborted the exit)."""

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "rank_exit.py")
LAUNCHES = int(os.environ.get("CPATTN_EXIT_LAUNCHES", "50"))


def _launch(tmp) -> list[tuple[int, str]]:
    """Both ranks of one job: (exit code, output) each; a rank still running after 120 s is
    killed (code None) and its output kept."""
    rendezvous = tempfile.mkdtemp(dir=tmp)
    env = {**os.environ, "RENDEZVOUS_DIR": rendezvous, "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    logs = [pathlib.Path(rendezvous) / f"rank{r}.log" for r in range(2)]
    outputs = [log.open("w") for log in logs]
    ranks = [subprocess.Popen([sys.executable, SCRIPT], env={**env, "RANK": str(r)},
                              stdout=out, stderr=subprocess.STDOUT)
             for r, out in enumerate(outputs)]
    codes = []
    for p in ranks:
        try:
            codes.append(p.wait(timeout=120))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    for out in outputs:
        out.close()
    return [(code, log.read_text()) for code, log in zip(codes, logs)]


def test_w2_step_exits_cleanly_every_time(tmp_path):
    failures = []
    for i in range(LAUNCHES):
        for rank, (code, output) in enumerate(_launch(tmp_path)):
            if code != 0:
                failures.append(f"launch {i} rank {rank}: exit {code}\n{output[-2000:]}")
    assert not failures, f"{len(failures)} of {2 * LAUNCHES} ranks failed:\n" + failures[0]
