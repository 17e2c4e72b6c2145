"""The attention options, one object: what every public attention function takes besides its
tensors and its process groups, keyword-only (`**options`), validated once here, agreed on by the
ranks, passed to the ops (which check them again in C++). Here too what every attention function
shares at its boundary: the check of a call (`checked_call`: tensors, layout, options, the fields
the ranks agree on) and what it returns (`returned`).

The C++ twin is csrc/ops/options.h (AttentionOptions, and the schema suffix every attention op
ends with). Adding an option: docs/design.md, "Adding a score option".
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Union

import torch

from cpattn.core import agreement as _agreement
from cpattn.core.layout import LAYOUTS
from cpattn.core.signature import Fields, tensor_fields
from cpattn.core.validation import (
    check_bool,
    check_choice,
    check_int,
    check_qkv,
    check_scale,
    check_window,
    env_invariant,
    error,
)

# The functions that honour invariant=True (results bitwise independent of the number of ranks,
# the layout and the strategy: docs/invariance.md); any other raises rather than drop it.
INVARIANT_FUNCTIONS = ("cpattn.attention", "cpattn.attention_varlen", "cpattn.ring_attention",
                       "cpattn.ring_attention_varlen", "cpattn.ulysses_attention",
                       "cpattn.hybrid_attention", "cpattn.prefill_attention",
                       "cpattn.decode_attention")

# The ops' option arguments, in their schema order (csrc/ops/options.h kOptionsSchema).
OP_OPTION_NAMES = ("softmax_scale", "causal", "window_left", "window_right", "softcap",
                   "alibi_slopes", "prefix_len")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """softmax_scale, causal, window (left, right; -1 unbounded), softcap (0: off), alibi_slopes
    ((heads,), fixed), sinks ((heads,) logits, differentiable), prefix_len (prefix-LM; 0: off),
    invariant (results bitwise independent of the number of ranks; default $CPATTN_INVARIANT).
    Build one with AttentionOptions.checked; the strategies pass it down whole."""

    softmax_scale: float
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    alibi_slopes: Optional[torch.Tensor] = None
    sinks: Optional[torch.Tensor] = None
    prefix_len: int = 0
    invariant: bool = False

    @classmethod
    def checked(cls, what: str, head_dim: int, fixed: Optional[dict] = None, *,
                only: Optional[tuple] = None, prefix_per_row: bool = False,
                **options) -> AttentionOptions:
        """The options (keyword arguments of NAMES) of a call of `what` on heads of head_dim,
        each checked (the shapes, dtypes and devices of the per-head tensors are checked in
        C++, against q). `fixed`: options `what` does not let the caller choose, with their one
        value (e.g. {"causal": True}: given otherwise, TypeError). `only`: the options `what`
        takes; any other given a value but its default raises TypeError (so that an option added
        later is refused there, not dropped). prefix_per_row: prefix_len is a tensor of one
        prefix per sequence or document, which the caller checks and applies; the object holds
        0."""
        fixed = fixed or {}
        for name, value in options.items():
            if name not in NAMES:
                raise TypeError(f"{what}: unexpected keyword argument {name!r}; the attention "
                                f"options are {', '.join(NAMES)}")
            if name in fixed and not _same(value, fixed[name]):
                raise TypeError(f"{what}: takes no {name} but {fixed[name]!r}, got {value!r}")
            if only is not None and name not in only and not _same(value, _DEFAULTS[name]):
                raise TypeError(f"{what}: takes no {name} (its attention options are "
                                f"{', '.join(only)}), got {value!r}")
        given = {**options, **fixed}
        if prefix_per_row:
            given["prefix_len"] = 0
        return cls._checked(what, head_dim, **given)

    @classmethod
    def _checked(cls, what: str, head_dim: int, *, causal=False, softmax_scale=None,
                 window=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
                 prefix_len=0, invariant=None) -> AttentionOptions:
        if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
            raise error(what, "softcap", softcap, "must be a number >= 0 (0: off)")
        if not (math.isfinite(softcap) and softcap >= 0):
            raise error(what, "softcap", softcap, "must be finite and >= 0 (0: off)")
        if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.requires_grad:
            raise error(what, "alibi_slopes", alibi_slopes, "are fixed and get no gradient: "
                        "pass a tensor that does not require grad (e.g. alibi_slopes.detach())")
        return cls(softmax_scale=check_scale(what, softmax_scale, max(head_dim, 1)),
                   causal=check_bool(what, "causal", causal), window=check_window(window, what),
                   softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks,
                   prefix_len=check_int(what, "prefix_len", prefix_len, minimum=0),
                   invariant=_checked_invariant(what, invariant))

    def agreement_fields(self) -> list:
        """What every rank must agree on: the per-head tensors as _agreement.tensor_values
        gives them (by exact value on the CPU)."""
        values = _agreement.tensor_values

        return [("causal", self.causal), ("window_left", self.window[0]),
                ("window_right", self.window[1]), ("softmax_scale", self.softmax_scale),
                ("softcap", self.softcap), ("prefix_len", self.prefix_len),
                ("alibi_slopes", values(self.alibi_slopes)), ("sinks", values(self.sinks)),
                ("invariant", self.invariant)]

    def op_kwargs(self) -> dict:
        """The options every attention op ends with (options.h kOptionsSchema), by name.
        The sinks are not among them: a differentiable input, the ops that apply them take them
        as an argument of their own. Nor is invariant: it selects the ops (invariant_fwd /
        invariant_bwd), which always run in invariant mode."""
        return {"softmax_scale": self.softmax_scale, "causal": self.causal,
                "window_left": self.window[0], "window_right": self.window[1],
                "softcap": self.softcap, "alibi_slopes": self.alibi_slopes,
                "prefix_len": self.prefix_len}

    def as_keywords(self) -> dict:
        """The options as the keyword arguments of the public attention functions; invariant
        only when True (else the callee's own default, $CPATTN_INVARIANT, holds: options built
        by an integration never turn the environment's invariant mode off)."""
        return {name: getattr(self, name) for name in NAMES
                if name != "invariant" or self.invariant}

    def for_heads(self, heads: slice) -> AttentionOptions:
        """The options of a slice of the query heads (the per-head tensors sliced)."""
        if self.alibi_slopes is None and self.sinks is None:
            return self
        return dataclasses.replace(
            self, alibi_slopes=None if self.alibi_slopes is None else self.alibi_slopes[heads],
            sinks=None if self.sinks is None else self.sinks[heads])

    def replace(self, **changes) -> AttentionOptions:
        return dataclasses.replace(self, **changes)


# The options, as the public attention functions take them (by keyword): the fields.
NAMES = tuple(f.name for f in dataclasses.fields(AttentionOptions))
# The value of each when not given (softmax_scale None: 1 / sqrt(head_dim)).
_DEFAULTS = {f.name: None if f.default is dataclasses.MISSING else f.default
             for f in dataclasses.fields(AttentionOptions)}


def _checked_invariant(what: str, invariant) -> bool:
    """invariant=, else $CPATTN_INVARIANT ("1" / "0"), else False; True only where `what`
    honours it (INVARIANT_FUNCTIONS), else ValueError."""
    source = "invariant"
    if invariant is None:
        value = env_invariant()
        if value not in (None, "", "0", "1"):
            raise error(what, "$CPATTN_INVARIANT", value, 'must be "1" (on) or "0" (off)')
        invariant, source = value == "1", "$CPATTN_INVARIANT"
    invariant = check_bool(what, source, invariant)
    if invariant and what not in INVARIANT_FUNCTIONS:
        raise error(what, source, True, "is not supported here yet: results bitwise independent "
                    f"of the number of ranks are given by {', '.join(INVARIANT_FUNCTIONS)} "
                    "(docs/invariance.md)")
    return invariant


def _same(value, expected) -> bool:
    """Whether an option's value is `expected` (the fixed value or the default)."""
    if expected is None or isinstance(value, torch.Tensor):
        return value is expected
    if isinstance(value, bool) != isinstance(expected, bool):
        return False
    if isinstance(expected, tuple):
        try:
            return tuple(value) == expected
        except TypeError:
            return False
    return value == expected


# What every attention function shares: the check of a call (its tensors and options, one list
# of fields the ranks agree on) and what it returns.


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
