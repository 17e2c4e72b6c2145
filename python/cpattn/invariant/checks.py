"""What invariant=True needs of a call beyond its options (the op layer checks the rest:
csrc/ops/invariant.cpp check_invariant_args)."""

import torch

from cpattn.core.validation import error


def check_invariant_call(what: str, q: torch.Tensor) -> None:
    """What invariant=True needs beyond the options: CPU tensors."""
    if q.device.type != "cpu":
        raise error(what, "invariant", True, "runs on CPU tensors only in this version (on CUDA "
                    "it has not run on a GPU yet: the kernels' fixed order is checked in "
                    f"emulation only), got q on {q.device}")
