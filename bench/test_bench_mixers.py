"""Smoke run of bench/bench_mixers.py (--quick: small layers, 128 tokens per rank, W = 2): every
layer's row comes out, and cpattn's bytes per layer are below the all-to-all's and gathering's."""

import pathlib
import re
import subprocess
import sys

BENCH = pathlib.Path(__file__).with_name("bench_mixers.py")


def test_bench_mixers_smoke():
    run = subprocess.run([sys.executable, str(BENCH), "--quick"], capture_output=True, text=True,
                         timeout=600, check=True)
    rows = [line for line in run.stdout.splitlines()
            if re.match(r"\| (gdn|mamba2|conv|lightning) \| 2 \| 128 ", line)]
    assert len(rows) == 8, run.stdout  # (each row printed as it comes, then in the table)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        ours, a2a, gather = (float(c.split()[0]) for c in cells[10:13])
        assert ours < a2a and ours < gather, row
