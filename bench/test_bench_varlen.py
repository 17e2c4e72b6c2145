"""Smoke run of bench/bench_varlen.py: two ranks, a small batch; the table and the last line
come out, and the document plan sends fewer bytes than per-document zigzag (as counted on the
loopback interface, not only as modelled)."""

import pathlib
import re
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).with_name("bench_varlen.py")


@pytest.mark.parametrize("mix", ["short", "one-long"])
def test_bench_varlen_smoke(mix):
    run = subprocess.run([sys.executable, str(BENCH), "--world", "2", "--mix", mix,
                          "--seqlen", "4096", "--iters", "1"], capture_output=True, text=True,
                         timeout=600, check=True)
    lines = run.stdout.strip().splitlines()
    last = re.fullmatch(r"efficiency (\S+) bytes_ratio (\S+) balance (\S+)", lines[-1])
    assert last, run.stdout
    assert float(last.group(2)) < 1.0 and float(last.group(3)) <= 1.05
    counted = re.search(r"counted bytes ratio (\S+)", run.stdout)
    assert counted and float(counted.group(1)) < 1.0, run.stdout
