"""The CUDA checks of tests/cuda/checks.py under pytest; skipped without a GPU (or a CUDA build).

On a GPU machine without pytest, run `python tests/cuda/checks.py` instead (bench/gpu_check.sh
picks whichever works).
"""

import os
import sys

import pytest
import torch

import cpattn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda"))
import checks  # noqa: E402

needs_gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and cpattn.build_info()["with_cuda"]),
    reason="needs a CUDA device and a CUDA build of cpattn",
)


@needs_gpu
@pytest.mark.parametrize("name", [n for n, _ in checks.CHECKS])
def test_cuda(name: str) -> None:
    try:
        dict(checks.CHECKS)[name]()
    except checks.Skip as e:
        pytest.skip(str(e))
    torch.cuda.synchronize()


def test_cuda_ops_registered_in_cuda_builds() -> None:
    """In a CUDA build every tensor op has a CUDA kernel (runs on CPU-only machines too)."""
    if not cpattn.build_info()["with_cuda"]:
        pytest.skip("CPU build")
    for op in ("attention_fwd", "attention_bwd", "merge_state_", "ring_fwd", "ring_bwd",
               "gathered_fwd", "gathered_bwd", "attention_varlen_fwd", "attention_varlen_bwd",
               "merge_attention_states", "merge_attention_states_bwd", "cache_store_",
               "cache_attention_fwd", "prefill_fwd",
               "testing::ring_fwd_emulated", "testing::ring_bwd_emulated", "testing::ring_shift"):
        name = f"cpattn_{op}" if op.startswith("testing::") else f"cpattn::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), op


def test_generated_instantiations_up_to_date() -> None:
    """csrc/cuda/inst/ is what csrc/cuda/generate_instantiations.py writes (runs anywhere)."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "csrc", "cuda", "generate_instantiations.py")
    r = subprocess.run([sys.executable, script, "--check"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize(
    "name", ["fwd/out_dtype_fp32_raw_op_offsets", "bwd/dlse", "fwd_bwd/strided_views",
             "ring_emulated/W=2", "fwd_bwd/2x129x200x4x2x64/causal_left/bfloat16",
             "score_options/all_dv/bfloat16", "score_options/sinks_empty_rows/float16",
             "score_options/ring_decode_sinks_W=1", "decode/batched_split_kv"])
def test_checks_harness_on_cpu(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA checks' references, tolerances and sharding, exercised on the CPU kernels (which
    take bf16 inputs too), so a broken check shows up without a GPU."""
    monkeypatch.setattr(checks.harness, "DEV", "cpu")  # the device the checks run on
    dict(checks.CHECKS)[name]()
