"""What the ranks of a call compare (cpattn.core.agreement): the fields of its signature, their
exact typed bytes for the signature's digest, and their one-word form for the detail round
that names the fields that differ."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import torch

FieldValue = bool | int | float | str | bytes | torch.dtype | None
Fields = list[tuple[str, FieldValue]]
DIGEST_WORDS = 4  # 256-bit signature digest


def digest_ints(values) -> bytes:
    """The exact bytes of an integer sequence (e.g. cu_seqlens), as an agree() field value."""
    return torch.as_tensor(values).to(torch.int64).cpu().contiguous().numpy().tobytes()


def tensor_fields(
    name: str, t, dims: Sequence[str] = ("batch", "seqlen", "heads", "head_dim")
) -> list[tuple[str, FieldValue]]:
    """The fields of a tensor argument that every rank must agree on: its sizes (named by `dims`
    when it has that many, e.g. "q.head_dim"), dtype and device type (not the device index:
    ranks use different GPUs). Anything else than a tensor gives one field: its repr."""
    if not isinstance(t, torch.Tensor):
        return [(name, repr(t))]
    names = dims if len(dims) == t.dim() else [f"size{i}" for i in range(t.dim())]
    return [(f"{name}.dims", t.dim()), *((f"{name}.{d}", s) for d, s in zip(names, t.shape)),
            (f"{name}.dtype", t.dtype), (f"{name}.device", t.device.type)]


# Type codes of field values: the detail round sends (name hash, type code, word) per field.
_NONE, _BOOL, _INT, _FLOAT, _STR, _BYTES, _DTYPE, _OTHER = range(8)
_DTYPES = tuple(v for v in vars(torch).values() if isinstance(v, torch.dtype))


def type_code_of(value) -> int:
    if value is None:
        return _NONE
    for code, types in ((_BOOL, bool), (_INT, int), (_FLOAT, float), (_STR, str),
                        (_BYTES, bytes), (_DTYPE, torch.dtype)):
        if isinstance(value, types):
            return code
    return _OTHER


def encode(value) -> bytes:
    """Exact, typed bytes of a field value (for the digest)."""
    code = type_code_of(value)
    if code == _FLOAT:
        raw = struct.pack("<d", value)
    elif code == _BYTES:
        raw = value
    elif code == _INT:
        raw = str(int(value)).encode()  # also ints beyond int64
    else:
        raw = repr(value).encode()
    return bytes([code]) + raw


def hash63(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def field_word(value) -> int:
    """One int64 for the detail round: the value itself where it fits, else a hash."""
    code = type_code_of(value)
    if code in (_BOOL, _INT) and -(2**63) <= value < 2**63:
        return int(value)
    if code == _FLOAT:
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return hash63(encode(value))


def show(code: int, word: int, local) -> str:
    """A rank's value, from its (code, word), as an error message shows it."""
    if code == _NONE:
        return "None"
    if code == _BOOL:
        return str(bool(word))
    if code == _FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", word))[0])
    if code == _INT:
        return str(word)  # (an int beyond int64 shows its hash)
    if code == _DTYPE:
        return next((str(d) for d in _DTYPES if field_word(d) == word), f"<dtype {word:#x}>")
    if type_code_of(local) == code and field_word(local) == word and code != _BYTES:
        return repr(local)
    return f"<digest {word:#x}>"


def signature_digest(function_name: str, fields: Sequence[tuple[str, FieldValue]]) -> bytes:
    h = hashlib.blake2b(digest_size=8 * DIGEST_WORDS)
    h.update(function_name.encode() + b"\0")
    for name, value in fields:
        raw = encode(value)
        # Lengths first, so that no two different signatures serialise to the same bytes.
        h.update(struct.pack("<qq", len(name), len(raw)) + name.encode() + raw)
    return h.digest()
