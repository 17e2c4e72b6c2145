"""Loads the compiled module after checking it matches the torch it will run under.

A torch extension is tied to the exact torch build it was compiled against (C++ ABI, dispatcher
internals); loading it under another one fails with undefined symbols or worse. We refuse early,
with a message that says what to do.
"""

import importlib

import torch


def load_extension():
    try:  # (by name: the module is generated at build time, beside _C)
        _build_info = importlib.import_module("cpattn._build_info")
    except ImportError as e:
        raise ImportError(
            "cpattn: the compiled module is missing (cpattn/_build_info.py not found). Install the "
            "package with `pip install --no-build-isolation .` from the source tree."
        ) from e
    if torch.__version__ != _build_info.TORCH_VERSION:
        raise ImportError(
            f"cpattn was built for torch {_build_info.TORCH_VERSION} but torch {torch.__version__} "
            "is installed. Rebuild cpattn against this torch: "
            "`pip install --no-build-isolation --force-reinstall .`"
        )
    return importlib.import_module("cpattn._C")
