"""The cross-rank agreement check that every distributed cpattn function runs first.

Before its first message, a distributed call checks that every rank of the group makes the same
call: the same function with the same shapes, dtypes and options (the "signature"). A mismatch
would otherwise hang, abort gloo on a size mismatch, or silently compute garbage.

Protocol (identical on every rank, so it never deadlocks on its own), in one or two rounds (an
all-gather of int64 words each, `gather_words`):
1. The header round: a fixed-size header is all-gathered: the function's name and a 256-bit
   blake2b digest of the full signature (every field name and value, byte strings such as
   cu_seqlens in full). Its size never depends on the function or the arguments, so different
   functions on different ranks meet in the same collective.
2. Only if the headers differ, the detail round: (name hash, type code, value) per field and,
   from a rank whose arguments failed validation, its error text (at most 1 KiB), from which
   every rank builds the same ValueError: the function on each rank and the fields that
   differ, or the ranks whose arguments are invalid and why.

Modes (cpattn.set_rank_check, or $CPATTN_RANK_CHECK when never set): "always" checks every call;
"once" checks each distinct (function, group, signature) once and then trusts it (later identical
calls send nothing; a rank that starts a new signature while the others repeat a checked one is
then not caught); "never" skips the check. "auto" (default): "always" where the header travels on
the host (a group with a CPU backend: gloo, or "cpu:gloo,cuda:nccl"), "once" where it would have
to go through a device (an NCCL-only group): there a round costs a host sync (copy to the
GPU, wait, copy back), which the hot path must not pay at every call.

Tensors whose values are options (sinks, ALiBi slopes) are compared by value when they are on
the CPU, or in mode "always"; on a device in the other modes by shape and dtype only (their
values would need a copy to the host, a sync, at every call; they are model parameters, which
the training framework keeps identical on every rank).

Under torch.compile (modes "always" and "once"), the check runs while dynamo traces the call, not
in the compiled graph: every rank traces the same calls in the same order, so every rank checks
(and a mismatch raises on every rank, wrapped by dynamo), and a graph is traced again whenever
its guards (shapes, dtypes, options) fail, so each compiled signature is checked once, like
"once", with the same blind spot (a rank that retraces while the others reuse their graph). The
compiled graph itself holds no collective and no graph break. A dimension compiled as dynamic
(symbolic) is compared as "<dynamic>", not by value: ranks must make the same dynamic-shape
decisions, which they do when they see the same shapes. Tensors whose values are options (sinks,
ALiBi slopes) are compared by presence only while tracing (their values are not known then);
varlen's cu_seqlens must be a list of ints under compile, read while tracing (see
core.validation.document_lengths), so they are compared exactly, once per compiled signature.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from cpattn.core.signature import (
    DIGEST_WORDS,
    Fields,
    FieldValue,
    field_word,
    hash63,
    show,
    signature_digest,
    type_code_of,
)
from cpattn.core.validation import env_rank_check

MODES = ("auto", "always", "once", "never")
T = TypeVar("T")

_MAGIC = 0x63706174746E  # "cpattn": tells an agreement header apart from other traffic
_VERSION = 1
_NAME_WORDS = 6  # function name: 48 bytes in the header (the digest covers the full name)
_DETAIL_FIELDS = 64  # fields reported in detail on a mismatch (the digest covers all of them)
_REASON_WORDS = 256  # the failing ranks' errors travel in the detail round: 2 KiB at most
_ONCE_CACHE_LIMIT = 4096  # signatures remembered in "once" mode (bounded: cu_seqlens vary)

_INVALID = "invalid_arguments"  # agree_on's one field when a rank's arguments fail validation
_mode: str | None = None
header_rounds = 0  # header rounds made by this process (tests count the check's collectives)
_checked: set = set()  # signatures checked (mode "once" trusts them; so does a CUDA graph capture)


def set_rank_check(mode: str) -> None:
    """Sets how distributed cpattn calls check that the ranks agree (see the module docstring):
    "auto" (default), "always", "once" or "never". Overrides $CPATTN_RANK_CHECK."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"cpattn.set_rank_check: mode must be one of {MODES}, got {mode!r}")
    _mode = mode


def get_rank_check() -> str:
    """The current mode: set_rank_check's, else $CPATTN_RANK_CHECK, else "auto"."""
    if _mode is not None:
        return _mode
    mode = env_rank_check() or "auto"
    if mode not in MODES:
        raise ValueError(f"cpattn: $CPATTN_RANK_CHECK must be one of {MODES}, got {mode!r}")
    return mode


def reads_on_host(t: torch.Tensor) -> bool:
    """Whether the checks read the values of `t` on the host: on the CPU, or in mode "always".
    Otherwise (a device tensor) reading them would sync the host, and the checks that need its
    values run on the device (the transformers integration's) or compare its shape only."""
    return t.device.type == "cpu" or get_rank_check() == "always"


def tensor_values(t: torch.Tensor | None) -> FieldValue:
    """The agree() field of a tensor whose values are an option (sinks, ALiBi slopes): its exact
    values on the CPU or in mode "always"; on a device otherwise its shape and dtype only (see
    the module docstring); while torch.compile traces, its presence only."""
    if t is None:
        return None
    if torch.compiler.is_compiling():
        return "<tensor>"
    if not reads_on_host(t):
        return f"<{t.device.type} tensor {tuple(t.shape)} {t.dtype}>"
    return t.detach().to("cpu", torch.float64).contiguous().numpy().tobytes()


def _words_device(group) -> torch.device:
    """Where the group's all-gather of words runs: on the CPU unless its only backend is NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_words(mine: torch.Tensor, group, timeout: float, what: str,
                 step: str = "the cross-rank agreement check") -> torch.Tensor:
    """All-gathers a fixed-size int64 vector `mine` (n,) over `group` (None: the world): (W, n)
    on the CPU, in rank order, waiting at most `timeout` seconds; a peer that does not answer
    (or left the group) raises RuntimeError naming `what` and `step`. Runs on the CPU unless the
    group's only backend is NCCL (then through this rank's GPU: a host sync)."""
    group = group if group is not None else dist.group.WORLD
    device = _words_device(group)
    gathered = [torch.empty_like(mine, device=device) for _ in range(dist.get_world_size(group))]
    try:
        work = dist.all_gather(gathered, mine.to(device), group=group, async_op=True)
        done = work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise RuntimeError(
            f"{what}: {step} failed after at most {timeout} s: a peer did not make the call in "
            f"time or left the group ({e})"
        ) from e
    if done is False:
        raise RuntimeError(f"{what}: peers did not answer {step} within {timeout} s")
    return torch.stack([g.cpu() for g in gathered])


def _header(function_name: str, digest: bytes) -> torch.Tensor:
    name = function_name.encode()[: 8 * _NAME_WORDS].ljust(8 * _NAME_WORDS, b"\0")
    words = struct.unpack(f"<{_NAME_WORDS}q", name) + struct.unpack(f"<{DIGEST_WORDS}q", digest)
    return torch.tensor([_MAGIC, _VERSION, *words], dtype=torch.int64)


def _name_of(header: torch.Tensor) -> str:
    raw = struct.pack(f"<{_NAME_WORDS}q", *header[2 : 2 + _NAME_WORDS].tolist())
    return raw.rstrip(b"\0").decode(errors="replace")


class InvalidOnSomeRanks(ValueError):
    """Raised on every rank when the arguments failed validation on some ranks only (or on every
    rank, differently). `errors` maps each failing global rank to its error's text; every rank
    raises the same text. Raised inside a later agreement's check (hybrid's second stage), its
    map travels on, so that the ranks of every group end up naming the same errors."""

    def __init__(self, function_name: str, errors: dict[int, str]):
        self.errors = dict(sorted(errors.items()))
        by_error: dict[str, list[int]] = {}
        for rank, error in self.errors.items():
            by_error.setdefault(error, []).append(rank)
        detail = "; ".join(f"rank(s) {_ranks(ranks)}: {error}"
                           for error, ranks in by_error.items())
        super().__init__(f"{function_name}: the arguments are invalid on rank(s) "
                         f"{_ranks(list(self.errors))} (every rank must pass the same shapes and "
                         f"options). {detail}")


def _ranks(ranks: Sequence[int]) -> str:
    """Ranks as runs: "0-3, 6"."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


_RECORD, _UNIT = "\x1e", "\x1f"  # separators of the errors' encoding (stripped from the texts)
_SENDER = -1  # the rank of "this rank's own error": the same bytes on every rank that has it, so
#               that one bad input everywhere agrees (and raises itself); the receiver fills it in


def _encode_errors(errors: dict[int, str]) -> str:
    """A rank -> error map as text: "rank<US>error" records separated by <RS>, within the
    detail round's bound: each error cut to under half of it (so two always travel), and the records
    that would pass the bound left out."""
    budget = 8 * _REASON_WORDS
    limit = budget // 2 - 16
    records: list[str] = []
    for rank, error in sorted(errors.items()):
        error = error.replace(_RECORD, " ").replace(_UNIT, " ")
        if len(error.encode()) > limit:
            error = error.encode()[: limit - 3].decode(errors="ignore") + "..."
        record = f"{'*' if rank == _SENDER else rank}{_UNIT}{error}"
        if len(_RECORD.join([*records, record]).encode()) > budget:
            break
        records.append(record)
    return _RECORD.join(records)


def _decode_errors(text: str, sender: int) -> dict[int, str]:
    errors = {}
    for record in filter(None, text.split(_RECORD)):
        rank, _, error = record.partition(_UNIT)
        if rank == "*":
            errors[sender] = error
        elif rank.isdigit():
            errors[int(rank)] = error
    return errors


def _errors_words(fields: Fields) -> list[int]:
    """This rank's failing-ranks map (agree_on's one field when its check raised: its own error,
    or the map of an earlier stage), as a length and UTF-8 bytes in _REASON_WORDS int64 words;
    empty when its check passed."""
    raw = str(next((v for n, v in fields if n == _INVALID), "")).encode()  # (within the bound)
    padded = raw.ljust(8 * _REASON_WORDS, b"\0")
    return [len(raw), *struct.unpack(f"<{_REASON_WORDS}q", padded)]


def _errors_of(words: list[int], sender: int) -> dict[int, str]:
    """The failing-ranks map that global rank `sender` sent (its own error named by its rank)."""
    raw = struct.pack(f"<{_REASON_WORDS}q", *words[1:])[: words[0]]
    return _decode_errors(raw.decode(errors="replace"), sender)


def _mismatch_message(
    function_name: str,
    fields: Sequence[tuple[str, FieldValue]],
    headers: torch.Tensor,
    details: torch.Tensor,
    global_ranks: Sequence[int],
) -> ValueError:
    names = [_name_of(h) for h in headers]
    if len(set(names)) > 1:
        calls = ", ".join(f"rank {g} called {n}" for g, n in zip(global_ranks, names))
        # (no function named first: the same text on every rank)
        return ValueError(f"cpattn: ranks called different cpattn functions ({calls}); every "
                          "rank of the group must make the same cpattn calls in the same order")
    # details[r] = [count, (name hash, type code, word) per field, errors' length, errors' bytes]
    per_rank, errors = [], {}
    for row, sender in zip(details.tolist(), global_ranks):
        n = row[0]
        hashes, codes, words = (row[i : i + 3 * n : 3] for i in (1, 2, 3))
        per_rank.append({h: (code, word) for h, code, word in zip(hashes, codes, words)})
        errors.update(_errors_of(row[1 + 3 * _DETAIL_FIELDS :], sender))
    if errors:  # some ranks failed validation: their errors, not every field
        return InvalidOnSomeRanks(function_name, errors)
    shown = []
    for name, value in fields[:_DETAIL_FIELDS]:
        key = hash63(name.encode())
        values = [d.get(key) for d in per_rank]
        if len(set(values)) > 1:
            text = ", ".join(f"rank {g}=" + ("absent" if v is None else show(*v, value))
                             for g, v in zip(global_ranks, values))
            shown.append((name, text))
    if not shown:
        return ValueError(f"{function_name}: ranks disagree on the call's shapes or options "
                          "(signature digests differ beyond the fields reported in detail)")
    return ValueError(f"{function_name}: ranks disagree on {', '.join(n for n, _ in shown)} ("
                      + "; ".join(f"{n}: {t}" for n, t in shown)
                      + "); every rank must pass the same shapes and options")


def agree(
    function_name: str,
    group,
    fields: Sequence[tuple[str, FieldValue]],
    timeout: float,
    every_call: bool = False,
) -> None:
    """Raises ValueError on every rank unless every rank of `group` calls `function_name` with the
    same `fields`; RuntimeError if a peer does not join within `timeout` seconds.

    Args:
        function_name: the public name, e.g. "cpattn.ring_attention"; it names the call in errors.
        group: a torch.distributed process group (None: the world).
        fields: (name, value) pairs that must agree across the ranks, compared exactly: None,
            bool, int, float, str, torch.dtype, or bytes (e.g. digest_ints(cu_seqlens)); see
            tensor_fields for tensors. Built from the raw arguments, before validating them, so
            that a bad input on one rank only is a disagreement, not a one-sided error.
        timeout: seconds to wait for the peers.
        every_call: check in mode "once" too (for fields that are the same at every call while
            valid, so that "once" would not see a rank whose values went wrong).

    Must be called identically on every rank before the call's first message. Costs one
    all-gather of 12 int64 per call in "always" mode (a second one only on a mismatch).
    """
    mode = get_rank_check()
    fields = list(fields)
    if mode == "never":
        return
    if torch.compiler.is_compiling():
        group = group if group is not None else dist.group.WORLD
        _agree_while_tracing(function_name, group.group_name, _traced_fields(fields), timeout)
        return
    _agree_now(function_name, group, fields, timeout, "always" if every_call else mode)


def _agree_now(function_name: str, group, fields: Fields, timeout: float, mode: str) -> None:
    """agree() in Python, now, in mode "auto", "always" or "once"."""
    global header_rounds
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return
    if mode == "auto":
        mode = "always" if _words_device(group).type == "cpu" else "once"
    digest = signature_digest(function_name, fields)
    key = (function_name, group.group_name, digest)
    if capturing():
        if key in _checked:
            return  # checked when this call ran before the capture (the usual warm-up)
        raise RuntimeError(
            f"{function_name}: first called with these shapes and options while a CUDA graph is "
            "being captured: its cross-rank agreement check cannot run inside a capture. Run "
            "the call once before capturing (the usual warm-up), or set_rank_check('never')")
    if mode == "once" and key in _checked:
        return
    header_rounds += 1
    headers = gather_words(_header(function_name, digest), group, timeout, function_name)
    if (headers != headers[0]).any():
        # Every rank saw the same headers, so every rank takes this branch: the detail round.
        shown = fields[:_DETAIL_FIELDS]
        triples = [w for name, value in shown
                   for w in (hash63(name.encode()), type_code_of(value), field_word(value))]
        triples += [0] * (3 * (_DETAIL_FIELDS - len(shown)))
        detail = torch.tensor([len(shown), *triples, *_errors_words(fields)], dtype=torch.int64)
        details = gather_words(detail, group, timeout, function_name)
        global_ranks = dist.get_process_group_ranks(group)
        raise _mismatch_message(function_name, fields, headers, details, global_ranks)
    if len(_checked) >= _ONCE_CACHE_LIMIT:
        _checked.clear()  # every rank clears at the same call: the caches stay identical
    _checked.add(key)


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _traced_fields(fields: Fields) -> tuple:
    """The fields as compile-time constants. A dimension the graph keeps symbolic (dynamic
    shapes) has no value while tracing: it is compared as "<dynamic>" (see the module docstring)."""
    return tuple((name, "<dynamic>" if isinstance(value, torch.SymInt) else value)
                 for name, value in fields)


@torch._dynamo.assume_constant_result
def _agree_while_tracing(function_name: str, group_name: str, fields: tuple,
                         timeout: float) -> bool:
    """agree() for a call that torch.compile is tracing. Dynamo runs a function marked
    assume_constant_result in Python at trace time and keeps only its (constant) result, so the
    check happens now, with the values the graph is specialised to, and the compiled graph holds
    no collective and no graph break. The group travels by name: dynamo hands process groups to
    traced code as opaque objects."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    _agree_now(function_name, _resolve_process_group(group_name), list(fields), timeout,
               "always")
    return True


def agree_on(
    function_name: str, group, timeout: float, check: Callable[[], tuple[T, Fields]],
    every_call: bool = False,
) -> T:
    """Validates a call's arguments and agrees on them across the ranks, in that order.

    check() validates this rank's arguments and returns (the checked arguments, the signature
    fields). If it raises ValueError, TypeError or RuntimeError (a C++ check), the ranks agree on
    that error instead: when
    every rank has it (the same bad input everywhere) every rank raises it; when only some do,
    every rank raises the same ValueError naming the failing ranks and carrying their errors'
    text (chained to the local error where there is one). Either way no rank is left
    waiting in the call's first message. Returns check()'s checked arguments. every_call: as
    agree's.
    """
    try:
        checked, fields = check()
        error = None
    except (ValueError, TypeError, RuntimeError) as e:
        # (not an f-string: dynamo keeps a formatted exception non-constant while tracing)
        # This rank's own error, or the failing ranks of an earlier stage (hybrid)
        errors = e.errors if isinstance(e, InvalidOnSomeRanks) else {
            _SENDER: type(e).__name__ + ": " + str(e)}
        checked, fields, error = None, [(_INVALID, _encode_errors(errors))], e
    try:
        agree(function_name, group, fields, timeout, every_call)
        if error is not None:
            raise error
    except ValueError as mismatch:
        if error is None or mismatch is error:
            raise
        raise mismatch from error  # the same text as on every other rank: it carries our error
    finally:
        # The error raised holds this frame in its traceback: a local referring back to it would
        # be a cycle that keeps every frame of the call (and the process group they hold) alive
        # until the garbage collector runs, past dist.destroy_process_group().
        del error
    return checked
