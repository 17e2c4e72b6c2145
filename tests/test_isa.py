"""Every instruction-set path of the CPU kernels (CPATTN_CPU_ISA, read once per process) is
checked in its own subprocess against the float64 reference."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpattn

TESTS_DIR = Path(__file__).resolve().parent
# The instruction-set paths in order of preference, as the kernels rank them (dispatch.cpp).
ORDER = [path["name"] for path in cpattn.build_info()["cpu_isa_paths"]]

# Runs in a fresh interpreter: imports the suite's conftest (which sets CPATTN_POISON=1 before
# cpattn loads) and checks forward and backward over a few shapes and masks.
SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import conftest as c
import torch
import cpattn

if sys.argv[2] == "report":
    print(json.dumps({"cpu_isa": cpattn.build_info()["cpu_isa"], "cases": 0}))
    sys.exit(0)
gen = torch.Generator()
gen.manual_seed(1234)
cases = [
    # batch, sq, sk, heads, kv_heads, head_dim, causal, window, dtype
    (2, 70, 150, 4, 2, 64, True, (-1, -1), torch.float32),
    (1, 129, 65, 2, 1, 40, False, (20, 7), torch.float32),
    (1, 1, 33, 2, 2, 256, False, (-1, -1), torch.float32),
    (1, 90, 90, 2, 1, 72, True, (0, 0), torch.float32),
    (1, 64, 100, 2, 2, 96, True, (-1, -1), torch.bfloat16),
]
for b, sq, sk, h, hkv, d, causal, window, dtype in cases:
    q, k, v = c.make_qkv(gen, b, sq, sk, h, hkv, d, dtype=dtype, requires_grad=True)
    dout = c.randn(q.shape, gen, dtype)
    out, lse = cpattn.attention(q, k, v, causal=causal, window=window, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = c.reference_with_grads(q, k, v, dout, causal=causal, window=window)
    c.assert_close_fp32(lse, ref[1], "lse")
    if dtype == torch.float32:
        c.assert_close_fp32(out, ref[0], "out")
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref[2:]):
            c.assert_close_fp32(got, want, name)
    else:
        base = c.reference_with_grads(
            q, k, v, dout, compute_dtype=dtype, causal=causal, window=window
        )
        c.assert_close_low_out(out, ref[0], base[0], dtype)
        for name, got, want, low in zip(("dq", "dk", "dv"), grads, ref[2:], base[2:]):
            c.assert_close_baseline(got, want, low, name)
    # dq written over dout (Ulysses' backward): the same bits as the backward above
    mine = dout.clone()
    dk, dv = torch.ops.cpattn.attention_bwd_in_dout(
        mine, q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal,
        window_left=window[0], window_right=window[1])
    for name, got, want in zip(("dq", "dk", "dv"), (mine, dk, dv), grads):
        assert torch.equal(got, want), name + " over dout"
print(json.dumps({"cpu_isa": cpattn.build_info()["cpu_isa"], "cases": len(cases)}))
"""


def best_isa() -> str:
    """The best path this CPU supports, by the kernel's rule (from /proc/cpuinfo flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "generic"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512bf16" if "avx512_bf16" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "generic"


def expected_isa(asked: str | None) -> str:
    """CPATTN_CPU_ISA can only lower the choice (name a later path); other values are ignored."""
    best = best_isa()
    if asked in ORDER and ORDER.index(asked) > ORDER.index(best):
        return asked
    return best


def run_script(asked: str | None, mode: str, tmp_path: Path) -> dict:
    """Runs SCRIPT with CPATTN_CPU_ISA=asked (unset for None); returns its JSON report."""
    script = tmp_path / "isa_check.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    env.pop("CPATTN_CPU_ISA", None)
    if asked is not None:
        env["CPATTN_CPU_ISA"] = asked
    proc = subprocess.run(
        [sys.executable, str(script), str(TESTS_DIR), mode],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("asked", [None, "generic", "avx2", "avx512"])
def test_isa_path_correct(asked: str | None, tmp_path: Path) -> None:
    """The kernel runs the requested path, reports it, and its results match the reference."""
    report = run_script(asked, "check", tmp_path)
    assert report["cases"] == 5
    assert report["cpu_isa"] == expected_isa(asked)


@pytest.mark.parametrize("asked", ["avx512bf16", "bogus", ""])
def test_isa_request_cannot_raise_or_break(asked: str, tmp_path: Path) -> None:
    """Asking for more than the CPU has, or for an unknown path, keeps the best supported one."""
    report = run_script(asked, "report", tmp_path)
    assert report["cpu_isa"] == expected_isa(asked) == best_isa()
