"""The CPU kernels' ways of running their matrix products (csrc/cpu/kernels.h, the table of kernel
paths): oneDNN's brgemm (AMX tiles where the CPU has them, AVX512-BF16 dot products or FMAs
otherwise) and the hand-written micro-kernels. Each path is reported (cpattn.build_info()
["cpu_gemm"]), forced by CPATTN_CPU_GEMM (read once per process), counted per call
(torch.ops.cpattn_testing.cpu_kernel_calls), and every kernel test file runs again, in a
subprocess, on the path this process does not take: the same checks against the float64
reference, the same tolerances, outputs poisoned (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpattn

TESTS_DIR = Path(__file__).resolve().parent
KERNEL_TEST_FILES = [
    "test_attention.py",  # shapes, masks, dtypes, head dims, scales, query-block groups
    "test_score_options.py",  # sinks, softcap, ALiBi, prefix, d_v != d_qk, KV-head groups
    "test_attention_raw_ops.py",  # global offsets, empty rows, output and gradient dtypes
    "test_accumulate.py",  # the ring's backward adding into gradients, split dQ sums
    "test_attention_grad_modes.py",  # strided inputs, determinism over runs and thread counts
    "test_backward_sizes.py",  # the backward's groups against the bytes it allocates
]


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = cpu_flags()
ISA = cpattn.build_info()["cpu_isa"]
# Where the brgemm path is built (AVX2 and up) and runs its bf16 products (oneDNN: AMX or
# AVX512-BF16; the bf16 operands need the avx512bf16 kernels).
BRGEMM_BUILT = ISA != "generic"
BF16_BRGEMM = ISA == "avx512bf16" and bool({"amx_bf16", "avx512_bf16"} & FLAGS)

# Runs in a fresh interpreter: the suite's conftest first (CPATTN_POISON=1, the testing ops), then
# a forward and backward per dtype against the float64 reference, in invariant mode too, and
# with mkldnn switched off; prints what ran (kernel calls per path, operands and pass).
SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import conftest as c
import torch
import cpattn

calls = torch.ops.cpattn_testing.cpu_kernel_calls
ROWS = ("brgemm", "micro")

def ran(before):
    after = calls()
    out = {}
    for r, row in enumerate(ROWS):
        for o, operands in enumerate(("fp32", "bf16")):
            for p, name in enumerate(("fwd", "bwd")):
                i = (r * 2 + o) * 2 + p
                if after[i] > before[i]:
                    out[f"{row} {operands} {name}"] = after[i] - before[i]
    return out

def check(dtype, **kw):
    gen = torch.Generator().manual_seed(7)
    q, k, v = c.make_qkv(gen, 1, 150, 200, 4, 2, 72, dtype=dtype, requires_grad=True)
    dout = c.randn(q.shape, gen, dtype)
    out, lse = cpattn.attention(q, k, v, causal=True, window=(90, -1), return_lse=True, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = c.reference_with_grads(q, k, v, dout, causal=True, window=(90, -1))
    c.assert_close_fp32(lse, ref[1], "lse")
    if dtype == torch.float32:
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
            c.assert_close_fp32(got, want, name)
    else:
        base = c.reference_with_grads(q, k, v, dout, compute_dtype=dtype, causal=True,
                                      window=(90, -1))
        c.assert_close_low_out(out, ref[0], base[0], dtype)
        for name, got, want, low in zip(("dq", "dk", "dv"), grads, ref[2:], base[2:]):
            c.assert_close_baseline(got, want, low, name)

report = {"gemm": cpattn.build_info()["cpu_gemm"], "amx": cpattn.build_info()["cpu_amx"]}
amx = torch.ops.cpattn_testing.cpu_amx_tasks()
for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
    before = calls()
    check(dtype)
    report[name] = ran(before)
    before = calls()
    check(dtype, invariant=True)
    report[name + " invariant"] = ran(before)
    before = calls()
    with torch.backends.mkldnn.flags(enabled=False):
        check(dtype)
    report[name + " mkldnn off"] = ran(before)
report["amx tasks"] = torch.ops.cpattn_testing.cpu_amx_tasks() - amx
print(json.dumps(report))
"""


def run_script(tmp_path: Path, **env: str) -> dict:
    """SCRIPT in a fresh process with these environment variables; its JSON report."""
    script = tmp_path / "gemm_paths.py"
    script.write_text(SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), str(TESTS_DIR)],
        env=dict(os.environ, **env), capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def runs_on(report: dict, dtype: str, path: str) -> None:
    """The calls of dtype's check went to `path` (a row of the table), forward and backward."""
    operands = "bf16" if dtype == "bfloat16" and ISA == "avx512bf16" else "fp32"
    assert set(report[dtype]) == {f"{path} {operands} fwd", f"{path} {operands} bwd"}, report
    assert report[dtype + " invariant"].keys() == {f"micro {operands} fwd",
                                                   f"micro {operands} bwd"}, report
    assert set(report[dtype + " mkldnn off"]) == {f"micro {operands} fwd",
                                                  f"micro {operands} bwd"}, report


def test_build_info_reports_the_paths() -> None:
    info = cpattn.build_info()
    assert set(info["cpu_gemm"]) == {"float32", "float16", "bfloat16"}
    allowed = {f"micro-{ISA}", "brgemm", "brgemm-amx", "brgemm-avx512bf16"}
    assert set(info["cpu_gemm"].values()) <= allowed, info["cpu_gemm"]
    assert info["cpu_gemm"]["float16"] == info["cpu_gemm"]["float32"]  # fp16 runs as fp32
    amx = info["cpu_amx"]
    assert set(amx) == {"cpu", "usable"} and all(isinstance(x, bool) for x in amx.values())
    assert amx["cpu"] == ("amx_bf16" in FLAGS)
    assert not amx["usable"] or amx["cpu"]
    # the default: fp32 on brgemm wherever it runs (unless CPATTN_CPU_ISA lowered the kernels),
    # bf16 on AMX tiles where oneDNN can use them, else the micro-kernels
    if os.environ.get("CPATTN_CPU_GEMM", "auto") == "auto" and "CPATTN_CPU_ISA" not in os.environ:
        fp32 = "brgemm" if BRGEMM_BUILT else f"micro-{ISA}"
        bf16 = "brgemm-amx" if amx["usable"] and ISA == "avx512bf16" else f"micro-{ISA}"
        assert info["cpu_gemm"] == {"float32": fp32, "float16": fp32,
                                    "bfloat16": bf16 if ISA == "avx512bf16" else fp32}


def asked(forced: str, dtype: str) -> str:
    """The path CPATTN_CPU_GEMM=forced names for dtype's operands (docs/environment.md)."""
    if ":" not in forced:
        return forced
    operands = "bfloat16" if dtype == "bfloat16" and ISA == "avx512bf16" else "float32"
    return dict(item.split(":") for item in forced.split(",")).get(operands, "auto")


@pytest.mark.parametrize("forced", ["brgemm", "micro", "float32:micro,bfloat16:brgemm"])
def test_forced_path_runs_and_is_counted(forced: str, tmp_path: Path) -> None:
    """CPATTN_CPU_GEMM takes the path where it runs (brgemm: AVX2 and up; its bf16 products
    where oneDNN has AMX or AVX512-BF16 kernels), for all operands or per operand type;
    invariant mode and mkldnn switched off take the micro-kernels; results match the reference
    either way."""
    report = run_script(tmp_path, CPATTN_CPU_GEMM=forced)
    bf16_runs = BF16_BRGEMM or ISA in ("avx2", "avx512")  # (fp32 operands below avx512bf16)
    fp32 = "brgemm" if asked(forced, "float32") == "brgemm" and BRGEMM_BUILT else "micro"
    bf16 = "brgemm" if asked(forced, "bfloat16") == "brgemm" and bf16_runs else "micro"
    runs_on(report, "float32", fp32)
    runs_on(report, "bfloat16", bf16)
    names = {"micro": f"micro-{ISA}", "brgemm": "brgemm"}
    assert report["gemm"]["float32"] == names[fp32]
    if bf16 == "brgemm" and ISA == "avx512bf16":
        amx = report["amx"]["usable"]
        assert report["gemm"]["bfloat16"] == ("brgemm-amx" if amx else "brgemm-avx512bf16")
        assert (report["amx tasks"] > 0) == amx  # the tiles were in use in the path's tasks
    else:
        assert report["gemm"]["bfloat16"] == names[bf16]
        assert report["amx tasks"] == 0


@pytest.mark.skipif("amx_bf16" not in FLAGS, reason="no AMX on this CPU (cpuinfo flag amx_bf16): "
                    "the AMX path cannot run here; test_forced_path_runs_and_is_counted covers "
                    "brgemm on its other instruction sets")
def test_amx_path_is_taken_on_an_amx_cpu(tmp_path: Path) -> None:
    """On a CPU with AMX, bf16 takes oneDNN's AMX kernels by default and the tiles are used."""
    report = run_script(tmp_path, CPATTN_CPU_GEMM="auto")
    assert report["amx"] == {"cpu": True, "usable": True}, report["amx"]
    assert report["gemm"]["bfloat16"] == "brgemm-amx"
    runs_on(report, "bfloat16", "brgemm")
    assert report["amx tasks"] > 0


@pytest.mark.skipif(ISA != "avx512bf16", reason="bf16 operands need the avx512bf16 kernels")
@pytest.mark.parametrize("env", [{"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
                                 {"CPATTN_CPU_ISA": "generic"}], ids=["onednn_avx512", "generic"])
def test_fallback_where_brgemm_cannot_run(env: dict, tmp_path: Path) -> None:
    """A CPU with neither AMX nor AVX512-BF16, as oneDNN sees it (its ISA capped: the bf16 probe
    throws and is caught), keeps the bf16 micro-kernels while fp32 takes brgemm; below AVX2 the
    path is not built and everything takes the micro-kernels."""
    report = run_script(tmp_path, CPATTN_CPU_GEMM="brgemm", **env)
    if "CPATTN_CPU_ISA" in env:
        assert report["gemm"] == {d: "micro-generic" for d in ("float32", "float16", "bfloat16")}
        assert set(report["float32"]) == {"micro fp32 fwd", "micro fp32 bwd"}
        assert set(report["bfloat16"]) == {"micro fp32 fwd", "micro fp32 bwd"}
    else:
        assert report["gemm"]["bfloat16"] == "micro-avx512bf16"
        assert report["gemm"]["float32"] == "brgemm"
        runs_on(report, "bfloat16", "micro")
        runs_on(report, "float32", "brgemm")


@pytest.mark.slow  # a sweep: the kernel test files again, on the other GEMM paths
def test_kernel_tests_on_the_other_path() -> None:
    """The kernel test files again with each operand type on the path this process does not
    take (CPATTN_CPU_GEMM per operand type), where that path runs here: with the rest of the
    suite on the default paths, every path that runs here is tested."""
    current = cpattn.build_info()["cpu_gemm"]
    runs = {"float32": BRGEMM_BUILT, "bfloat16": BF16_BRGEMM}  # where brgemm could run
    other = {d: "micro" if current[d].startswith("brgemm") else "brgemm" for d in runs}
    changed = [d for d in runs if other[d] == "micro" or runs[d]]
    if not changed:
        pytest.skip(f"no other path runs here: {current} (ISA {ISA})")
    forced = ",".join(f"{d}:{other[d]}" for d in runs)
    files = [str(TESTS_DIR / f) for f in KERNEL_TEST_FILES]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider",
         "-k", "not every_isa"],
        env=dict(os.environ, CPATTN_CPU_GEMM=forced), capture_output=True, text=True,
        timeout=1800, check=False,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout
