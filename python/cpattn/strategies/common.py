"""What every strategy shares: the checks of a call's tensors and options (one list of fields
the ranks agree on) and what a call returns. Head groups and passes: cpattn._autograd."""

from typing import Optional, Union

import torch

from cpattn._agreement import Fields, tensor_fields
from cpattn._layout import LAYOUTS
from cpattn._validation import check_choice, check_qkv
from cpattn.options import AttentionOptions


def checked_call(what: str, q, k, v, options: Union[dict, AttentionOptions],
                 layout: str = "contiguous", varlen: bool = False, fixed: Optional[dict] = None,
                 only: Optional[tuple] = None, empty_tokens: bool = False,
                 prefix_per_row: bool = False) -> tuple[AttentionOptions, Fields]:
    """The tensors and options of a call of `what` checked: its AttentionOptions, and the
    fields every rank must agree on (shapes, dtypes, layout, options). `options`: the keyword
    arguments of a public call, checked here (`fixed` / `only` / `prefix_per_row`: as
    AttentionOptions.checked), or the AttentionOptions of an inner call, checked already at
    the public boundary (the hybrid's ring). empty_tokens: as check_qkv's."""
    check_qkv(what, q, k, v, varlen=varlen, v_head_dim_free=True,  # v: its own head dim Dv
              empty_tokens=empty_tokens)
    check_choice(what, "layout", layout, tuple(LAYOUTS))
    opts = options if isinstance(options, AttentionOptions) else AttentionOptions.checked(
        what, q.shape[-1], fixed, only=only, prefix_per_row=prefix_per_row, **options)
    dims = ("tokens", "heads", "head_dim") if varlen else ("batch", "seqlen", "heads", "head_dim")
    fields = [*tensor_fields("q", q, dims), *tensor_fields("k", k, dims),
              *tensor_fields("v", v, dims), ("layout", layout), *opts.agreement_fields()]
    return opts, fields


def returned(out: torch.Tensor, lse, max_logits: list):
    """What an attention function returns: out, then the LSE (when asked: not None), then the
    max logits (when asked: a list of one): out alone, or a tuple."""
    extra = ([] if lse is None else [lse]) + max_logits
    return (out, *extra) if extra else out
