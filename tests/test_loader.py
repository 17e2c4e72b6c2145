"""The loader refuses a compiled module built for another torch, with a helpful message."""

from __future__ import annotations

import sys

import pytest
import torch

import cpattn
from cpattn import _build_info
from cpattn.core import loader as _loader


def test_loads_under_matching_torch() -> None:
    """With the torch it was built for, load_extension returns the compiled module."""
    assert _build_info.TORCH_VERSION == torch.__version__
    module = _loader.load_extension()
    assert module is cpattn._C
    assert module.cpu_isa() in ("generic", "avx2", "avx512", "avx512bf16")
    assert cpattn.build_info()["torch_version"] == torch.__version__


def test_version_mismatch_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """A different build version: ImportError naming both versions and how to rebuild."""
    fake = "1.0.0+other"
    monkeypatch.setattr(_build_info, "TORCH_VERSION", fake)
    with pytest.raises(ImportError) as info:
        _loader.load_extension()
    message = str(info.value)
    assert fake in message
    assert torch.__version__ in message
    assert "--no-build-isolation" in message


def test_installed_torch_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same check seen from the other side: the running torch reports another version."""
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    with pytest.raises(ImportError, match=r"9\.9\.9") as info:
        _loader.load_extension()
    assert _build_info.TORCH_VERSION in str(info.value)


def test_missing_build_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the generated _build_info module: ImportError saying how to install."""
    monkeypatch.setitem(sys.modules, "cpattn._build_info", None)  # makes the import fail
    monkeypatch.delattr(cpattn, "_build_info", raising=False)
    with pytest.raises(ImportError, match=r"compiled module is missing"):
        _loader.load_extension()
