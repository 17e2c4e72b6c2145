"""Argument validation for the public functions, each rule written once.

Every message names the function, the argument, the value and the rule:
    "cpattn.ring_attention: softmax_scale=0.0: must be finite and > 0 in float32".
The distributed functions run these checks before any message, on values every rank agrees on
(after or independent of the agreement check), so a bad input raises on every rank and leaves
the process group usable.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

# The limits are defined once, in C++, and read here: MAX_HEAD_DIM the CPU kernels' head dim
# limit (kMaxHeadDim in csrc/ops/checks.h); MAX_POSITION (kUnbounded in cpattn/mask.h, 2^61 - 1):
# window sizes at or beyond it reach past any sequence cpattn can index, "unbounded" (-1), and
# positions stay below it, so that position +- window never overflows int64.
from cpattn._C import MAX_HEAD_DIM
from cpattn._C import UNBOUNDED_POSITION as MAX_POSITION

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The devices the public functions take. tests/test_hot_path.py adds "meta" as a stand-in for a
# GPU whose values the host cannot read (any read of them raises).
DEVICE_TYPES = ("cpu", "cuda")


def error(what: str, arg: str, value, rule: str) -> ValueError:
    """The ValueError for `arg` = `value` of function `what` breaking `rule`."""
    return ValueError(f"{what}: {arg}={_show(value)}: {rule}")


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    return repr(value)


def check_int(what: str, arg: str, value, minimum: int | None = None) -> int:
    """An int (not a bool, not a float, even an integral one), optionally >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(what, arg, value, "must be an int")
    if minimum is not None and value < minimum:
        raise error(what, arg, value, f"must be >= {minimum}")
    return int(value)


def check_bool(what: str, arg: str, value) -> bool:
    if not isinstance(value, bool):
        raise error(what, arg, value, "must be True or False")
    return value


def check_choice(what: str, arg: str, value, choices: Sequence) -> None:
    if value not in choices:
        raise error(what, arg, value, f"must be one of {', '.join(map(repr, choices))}")


def check_window(window, what: str = "cpattn") -> tuple[int, int]:
    """(left, right): ints, each >= 0, or -1 for unbounded. A side at or beyond MAX_POSITION
    reaches past any sequence, so it is returned as -1 (e.g. (-1, 2**63 - 1) == (-1, -1))."""
    try:
        left, right = window
    except (TypeError, ValueError):
        raise error(what, "window", window, "must be a pair (left, right) of ints") from None
    sides = []
    for name, side in (("window[0] (left)", left), ("window[1] (right)", right)):
        side = check_int(what, name, side, minimum=-1)
        sides.append(-1 if side >= MAX_POSITION else side)
    return sides[0], sides[1]


def check_scale(what: str, softmax_scale, head_dim: int) -> float:
    """The softmax scale (default 1 / sqrt(head_dim)): a real number, finite and > 0 as the
    float32 the kernels use."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise error(what, "softmax_scale", softmax_scale, "must be a real number")
    as_f32 = float(torch.tensor(float(softmax_scale), dtype=torch.float32))
    if not (math.isfinite(as_f32) and as_f32 > 0):
        raise error(what, "softmax_scale", softmax_scale, "must be finite and > 0 in float32")
    return float(softmax_scale)


# Torch's own default process group timeout (seconds): for a group whose timeout cannot be read.
FALLBACK_TIMEOUT = 600.0


def check_timeout(what: str, timeout, *groups) -> float:
    """Seconds to wait for a peer: `timeout`, else $CPATTN_COMM_TIMEOUT, else the shortest
    timeout of `groups` (each process group's own, as set by init_process_group / new_group; None
    is the world); finite and > 0. Waiting as long as the group does means a slow peer (compile
    skew, a checkpoint written by rank 0 only) fails cpattn no sooner than the group itself."""
    source = "timeout"
    if timeout is None and env_comm_timeout() is not None:
        timeout, source = env_comm_timeout(), "$CPATTN_COMM_TIMEOUT"
        try:
            timeout = float(timeout)
        except ValueError:
            raise error(what, source, timeout, "must be a number of seconds") from None
    if timeout is None:
        seconds = [group_timeout(g) for g in groups or (None,)]
        return min(seconds)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise error(what, source, timeout, "must be a number of seconds")
    if not (math.isfinite(timeout) and timeout > 0):
        raise error(what, source, timeout, "must be finite and > 0 (seconds)")
    return float(timeout)


def group_timeout(group) -> float:
    """The timeout (seconds) of process group `group` (None: the world): the shortest of its
    backends' (gloo, NCCL), FALLBACK_TIMEOUT where none can be read."""
    import torch.distributed as dist

    if group is None:
        group = dist.group.WORLD
    return _group_timeout(group.group_name)


@torch._dynamo.assume_constant_result
def _group_timeout(group_name: str) -> float:
    """group_timeout by group name, read in C++ (cpattn::group_timeout): no Python object of a
    backend or its options is ever made, so none can outlive destroy_process_group and keep
    gloo's threads alive. torch.compile runs it while tracing and keeps the constant."""
    seconds = torch.ops.cpattn.group_timeout(group_name)
    return seconds if seconds > 0 else FALLBACK_TIMEOUT


def check_tensor(what: str, arg: str, t, dims: Sequence[str], may_be_empty: Sequence[str] = ()
                 ) -> None:
    """A float32 / bfloat16 / float16 tensor of len(dims) dims, each >= 1 (those named in
    `may_be_empty` >= 0), on CPU or CUDA, contiguous in its last dim (what the kernels read)."""
    if not isinstance(t, torch.Tensor):
        raise error(what, arg, t, "must be a torch.Tensor")
    if t.dim() != len(dims):
        raise error(what, f"{arg}.shape", tuple(t.shape), f"must be ({', '.join(dims)})")
    if t.dtype not in FLOAT_DTYPES:
        raise error(what, f"{arg}.dtype", t.dtype, "must be float32, bfloat16 or float16")
    if t.device.type not in DEVICE_TYPES:
        raise error(what, f"{arg}.device", t.device, "must be a CPU or CUDA device")
    for name, size in zip(dims, t.shape):
        if size < (0 if name in may_be_empty else 1):
            raise error(what, f"{arg}.shape", tuple(t.shape), f"{name} must be >= 1")
    if t.stride(-1) != 1:
        raise error(what, f"{arg}.stride()", t.stride(), "the last dim (head_dim) must be "
                    "contiguous (stride 1)")


def check_qkv(what: str, q, k, v, *, varlen: bool = False, same_length: bool = True,
              v_head_dim_free: bool = False, empty_tokens: bool = False) -> None:
    """q (batch, seqlen, heads, head_dim), k and v (batch, seqlen_k, kv_heads, head_dim), or
    without the batch dim for varlen (tokens, heads, head_dim): one float dtype for all three
    (no promotion, as cpattn.attention), one device, heads % kv_heads == 0, head_dim <= 256;
    `same_length`: the shards of q and k/v have the same length (ring / Ulysses);
    `v_head_dim_free`: v may have its own head dim (where the strategy supports it);
    `empty_tokens`: varlen shards may hold no token (a rank of a cpattn.DocumentPlan)."""
    dims = ("tokens", "heads", "head_dim") if varlen else ("batch", "seqlen", "heads", "head_dim")
    for arg, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(what, arg, t, dims, ("tokens",) if empty_tokens else ())
    if not q.dtype == k.dtype == v.dtype:
        raise error(what, "(q.dtype, k.dtype, v.dtype)", (q.dtype, k.dtype, v.dtype),
                    "must be the same dtype (no promotion)")
    if not q.device == k.device == v.device:
        raise error(what, "(q.device, k.device, v.device)", (q.device, k.device, v.device),
                    "must be the same device")
    if k.shape[:-1] != v.shape[:-1] or (k.shape != v.shape and not v_head_dim_free):
        rule = ("must be equal but for the head dim" if v_head_dim_free else
                "must be equal (a head dim of v different from q/k's is supported by "
                "cpattn.attention and the context-parallel strategies)")
        raise error(what, "(k.shape, v.shape)", (tuple(k.shape), tuple(v.shape)), rule)
    if not varlen and q.shape[0] != k.shape[0]:
        raise error(what, "(q batch, k batch)", (q.shape[0], k.shape[0]), "must be equal")
    if q.shape[-1] != k.shape[-1]:
        raise error(what, "(q head_dim, k head_dim)", (q.shape[-1], k.shape[-1]), "must be equal")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise error(what, "head_dim", q.shape[-1], f"must be between 1 and {MAX_HEAD_DIM}")
    if v.shape[-1] > MAX_HEAD_DIM:
        raise error(what, "v head_dim", v.shape[-1], f"must be between 1 and {MAX_HEAD_DIM}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise error(what, "(heads, kv_heads)", (q.shape[-2], k.shape[-2]),
                    "heads must be a multiple of kv_heads")
    seq = 0 if varlen else 1
    if same_length and q.shape[seq] != k.shape[seq]:
        raise error(what, "(q length, k length)", (q.shape[seq], k.shape[seq]),
                    "the q and k/v shards must have the same length")


def check_cu_seqlens(what: str, cu_seqlens) -> torch.Tensor:
    """Document boundaries: integers (a float tensor or float entries are rejected, never
    truncated), 1-D, at least [0, n], starting at 0, non-decreasing. Returns them as int64 on
    the CPU."""
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or (
            cu_seqlens.dtype == torch.bool
        ):
            raise error(what, "cu_seqlens.dtype", cu_seqlens.dtype, "must be an integer dtype")
        cu = cu_seqlens.detach().to("cpu", torch.int64)
    else:
        try:
            values = list(cu_seqlens)
        except TypeError:
            raise error(what, "cu_seqlens", cu_seqlens, "must be a 1-D sequence of ints") from None
        for x in values:
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise error(what, "cu_seqlens", cu_seqlens, "must hold ints only")
        cu = torch.tensor(values, dtype=torch.int64)
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise error(what, "cu_seqlens", cu.tolist() if cu.numel() <= 16 else cu,
                    "must be 1-D, start at 0, hold at least one document and be non-decreasing")
    return cu


def document_lengths(what: str, cu_seqlens) -> tuple[torch.Tensor, int, bytes]:
    """The documents' lengths (int64, (D,)) from checked cu_seqlens, their total and their exact
    bytes for the agreement check. Under torch.compile they are read while the graph is traced,
    so they shape the graph: cu_seqlens must then be a list or tuple of ints (dynamo guards on
    their values: other boundaries trace again and are checked again); a tensor's values are
    unknown while tracing, so a tensor raises (a graph break or an error under fullgraph
    otherwise)."""
    if not torch.compiler.is_compiling():
        docs = check_cu_seqlens(what, cu_seqlens).diff()
        return docs, int(docs.sum()), docs.numpy().tobytes()
    if isinstance(cu_seqlens, torch.Tensor):
        raise error(what, "cu_seqlens", "<tensor>", "must be a list or tuple of ints under "
                    "torch.compile (its values are read while tracing; a tensor's are not "
                    "known then): pass cu_seqlens.tolist() outside the compiled function")
    if not isinstance(cu_seqlens, (list, tuple)):
        raise error(what, "cu_seqlens", "<" + type(cu_seqlens).__name__ + ">", "must be a list "
                    "or tuple of ints under torch.compile")
    # operator.index: an int that dynamo made symbolic (it changed between calls) becomes a
    # constant again, guarded (other values trace again). Other entries are refused below.
    cu = tuple(operator.index(x) if isinstance(x, int) and not isinstance(x, bool) else x
               for x in cu_seqlens)
    lengths, raw, message = _lengths_while_tracing(what, cu)
    if message:
        raise ValueError(message)  # raised in the traced code: the agreement check sees it
    return torch.tensor(lengths, dtype=torch.int64), sum(lengths), raw


@torch._dynamo.assume_constant_result
def _lengths_while_tracing(what: str, cu_seqlens: tuple) -> tuple[tuple[int, ...], bytes, str]:
    """document_lengths' check, run in Python while dynamo traces (a compile-time constant):
    (lengths, their bytes, "") or ((), b"", the error message)."""
    try:
        docs = check_cu_seqlens(what, cu_seqlens).diff()
    except ValueError as e:
        return (), b"", str(e)
    return tuple(docs.tolist()), docs.numpy().tobytes(), ""


def check_prefix_per_document(what: str, prefix_len, doc_lengths: torch.Tensor,
                              unit: str = "document of cu_seqlens") -> torch.Tensor:
    """One prefix-LM length per document (or sequence of a batch: `unit`): an int64 tensor (D,)
    for D documents, each entry 0 <= P_d <= the document's length (0: no prefix). Returns it
    as int64 on the CPU."""
    if prefix_len.dtype != torch.int64:
        raise error(what, "prefix_len.dtype", prefix_len.dtype,
                    f"a prefix per {unit.split()[0]} must be an int64 tensor")
    if tuple(prefix_len.shape) != (doc_lengths.numel(),):
        raise error(what, "prefix_len.shape", tuple(prefix_len.shape),
                    f"must be ({doc_lengths.numel()},): one prefix per {unit}")
    prefix = prefix_len.detach().cpu()
    bad = (prefix < 0) | (prefix > doc_lengths)
    if bool(bad.any()):
        d = int(bad.nonzero()[0])
        raise error(what, f"prefix_len[{d}]", int(prefix[d]),
                    f"must be between 0 and the {unit.split()[0]}'s length {int(doc_lengths[d])}")
    return prefix


def group_info(group) -> tuple:
    """(group, this rank in it, its size); the default group for None. Raises when
    torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "cpattn: context parallelism needs torch.distributed to be initialised "
            "(dist.init_process_group), or use "
            "cpattn.testing.emulation.ring_attention_emulated for one process"
        )
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


# Every environment variable the Python side reads, in one place (docs/environment.md lists them;
# the C++ side's are in csrc/include/cpattn/env.h). Read when called, never cached here.


def env_comm_timeout() -> Optional[str]:
    """$CPATTN_COMM_TIMEOUT: seconds to wait for a peer when a call gives no timeout."""
    return os.environ.get("CPATTN_COMM_TIMEOUT")


def env_rank_check() -> Optional[str]:
    """$CPATTN_RANK_CHECK: the agreement check's mode (cpattn.set_rank_check)."""
    return os.environ.get("CPATTN_RANK_CHECK")


def env_plan_cache() -> Optional[str]:
    """$CPATTN_PLAN_CACHE: the folder of the planner's calibration cache."""
    return os.environ.get("CPATTN_PLAN_CACHE")


def env_plan_machine() -> Optional[str]:
    """$CPATTN_PLAN_MACHINE: the planner's machine (a preset name or a JSON file)."""
    return os.environ.get("CPATTN_PLAN_MACHINE")


def env_mixer_scan() -> Optional[str]:
    """$CPATTN_MIXER_SCAN: the mixers' state scan: "allgather", "tree" or "auto"."""
    return os.environ.get("CPATTN_MIXER_SCAN")


def env_invariant() -> Optional[str]:
    """$CPATTN_INVARIANT: "1" makes invariant=True the default of the attention functions."""
    return os.environ.get("CPATTN_INVARIANT")
