"""The attention options are one object: every attention op's schema ends with the same option
arguments (csrc/ops/options.h), AttentionOptions passes exactly those, every public function
refuses an option it does not know or take (never drops it), and a score option's code lives in
few files (scripts/option_files.py)."""

import pathlib
import subprocess
import sys

import pytest
import torch

import cpattn
from cpattn.core.options import NAMES, OP_OPTION_NAMES, AttentionOptions
from cpattn.testing.emulation import ring_attention_emulated

ROOT = pathlib.Path(__file__).resolve().parent.parent
ATTENTION_OPS = ("attention_fwd", "attention_bwd", "attention_bwd_in_dout", "ring_fwd",
                 "ring_bwd", "gathered_fwd", "gathered_bwd", "attention_varlen_fwd",
                 "attention_varlen_bwd", "cache_attention_fwd", "prefill_fwd")


def _schema_names(op) -> list[str]:
    return [a.name for a in op.default._schema.arguments]


@pytest.mark.parametrize("name", ATTENTION_OPS)
def test_every_attention_op_ends_with_the_options(name):
    names = _schema_names(getattr(torch.ops.cpattn, name))
    assert tuple(names[-len(OP_OPTION_NAMES):]) == OP_OPTION_NAMES
    assert not set(names[:-len(OP_OPTION_NAMES)]) & set(OP_OPTION_NAMES)


def test_op_kwargs_are_the_schema_suffix():
    opts = AttentionOptions.checked("test", 8, causal=True, softcap=1.0, prefix_len=3,
                                    window=(4, 0), alibi_slopes=torch.ones(2))
    kwargs = opts.op_kwargs()
    assert tuple(kwargs) == OP_OPTION_NAMES
    assert kwargs["softmax_scale"] == pytest.approx(8 ** -0.5)
    assert (kwargs["causal"], kwargs["window_left"], kwargs["window_right"], kwargs["softcap"],
            kwargs["prefix_len"]) == (True, 4, 0, 1.0, 3)
    # invariant only when on: the callee's default ($CPATTN_INVARIANT) holds otherwise
    assert tuple(opts.as_keywords()) == tuple(n for n in NAMES if n != "invariant")
    assert tuple(opts.replace(invariant=True).as_keywords()) == NAMES


def test_an_op_without_a_scale_raises():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="no default scale"):
        torch.ops.cpattn.attention_fwd(q, q, q)


def _local_calls(q):
    docs = torch.tensor([0, q.shape[1]])
    return {
        "cpattn.attention": lambda **o: cpattn.attention(q, q, q, **o),
        "cpattn.attention_varlen": lambda **o: cpattn.attention_varlen(q[0], q[0], q[0], docs,
                                                                       **o),
        "cpattn.ring_attention_emulated": lambda **o: ring_attention_emulated([q], [q], [q],
                                                                              **o),
    }


@pytest.mark.parametrize("what", ["cpattn.attention", "cpattn.attention_varlen",
                                  "cpattn.ring_attention_emulated"])
def test_an_unknown_option_raises(what):
    call = _local_calls(torch.randn(1, 8, 2, 8))[what]
    with pytest.raises(TypeError, match=f"{what}: unexpected keyword argument 'temperature'"):
        call(temperature=2.0)


def test_an_option_not_taken_raises_unless_default():
    calls = _local_calls(torch.randn(1, 8, 2, 8))
    calls["cpattn.attention_varlen"](prefix_len=0)  # its fixed value: accepted
    with pytest.raises(TypeError, match="takes no prefix_len"):
        calls["cpattn.attention_varlen"](prefix_len=2)
    calls["cpattn.ring_attention_emulated"](softcap=0.0)  # the default: accepted
    with pytest.raises(TypeError, match="takes no softcap"):
        calls["cpattn.ring_attention_emulated"](softcap=1.0)


def test_a_score_option_lives_in_few_library_files():
    """softcap (a score option) is named by the code of at most 8 library files: the kernels'
    rule, the op layer's options, the Python options object, the reference and the transformers
    keyword map (scripts/option_files.py; docs/design.md "Adding a score option")."""
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "option_files.py"), "softcap",
                          "--count"], capture_output=True, text=True, check=True).stdout
    assert 1 <= int(out) <= 8
