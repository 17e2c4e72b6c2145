"""A rank that caught cpattn errors and destroyed its group leaves no gloo thread behind, and its
process exits 0 through the normal interpreter shutdown, every time (an error's traceback once
kept the group alive through a reference cycle; gloo's threads then aborted the exit)."""

import os
import socket
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

SCRIPT = os.path.join(os.path.dirname(__file__), "rank_exit.py")
LAUNCHES = int(os.environ.get("CPATTN_EXIT_LAUNCHES", "50"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch() -> list[subprocess.CompletedProcess]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, SCRIPT], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    return [(p.wait(timeout=300), p.stdout.read()) for p in ranks]


def test_w2_step_exits_cleanly_every_time():
    failures = []
    for i in range(LAUNCHES):
        for rank, (code, output) in enumerate(_launch()):
            if code != 0:
                failures.append(f"launch {i} rank {rank}: exit {code}\n{output[-2000:]}")
    assert not failures, f"{len(failures)} of {2 * LAUNCHES} ranks failed:\n" + failures[0]
