"""Smoke runs of bench/bench_invariant.py: two ranks, short shards (the table and the last line
come out with positive ratios) and a short decode."""

import pathlib
import re
import subprocess
import sys

BENCH = pathlib.Path(__file__).with_name("bench_invariant.py")


def test_bench_invariant_smoke():
    run = subprocess.run([sys.executable, str(BENCH), "--world", "2", "--local", "256",
                          "--iters", "1"], capture_output=True, text=True, timeout=600,
                         check=True)
    last = re.fullmatch(r"invariant time_ratio (\S+) peak_ratio (\S+)",
                        run.stdout.strip().splitlines()[-1])
    assert last and float(last.group(1)) > 0 and float(last.group(2)) > 0, run.stdout


def test_bench_invariant_decode_smoke():
    run = subprocess.run([sys.executable, str(BENCH), "--world", "2", "--decode", "1500",
                          "--iters", "1"], capture_output=True, text=True, timeout=600,
                         check=True)
    assert re.search(r"invariant \S+ ms, ratio \S+$", run.stdout.strip()), run.stdout
