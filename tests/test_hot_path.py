"""The Python layer's hot path makes no host round trip on device tensors.

On a GPU a read of a tensor's values on the host (.item(), .tolist(), .cpu(), bool(t), a copy
to the CPU) or a host-to-device copy from pageable memory waits for the device: the CPU then
cannot run ahead, and the GPU idles between layers. Without a GPU, meta tensors stand in: their
values do not exist, so any host read of them raises, and a dispatch mode records every copy
between them and the CPU that would block the host (device-to-host, or host-to-device not marked
non_blocking). Their ops run the fake (meta) kernels; the agreement check goes over gloo, on the
host, as it does on a "cpu:gloo,cuda:nccl" group. Each public function runs forward and backward
on 2 real ranks, after one warm-up call (the first call of a signature may do more: on an
NCCL-only group the agreement check runs once per signature, through the device).
bench/gpu_check.sh's sync_free and run_ahead stages measure the same on a GPU
(torch.cuda.set_sync_debug_mode).
"""

import traceback

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import cpattn
from cpattn.core import agreement as _agreement
from cpattn.core import validation as _validation

from distributed import run_ranks

aten = torch.ops.aten


class HostRoundTrips(TorchDispatchMode):
    """Records the ops that would block the host on a GPU: reading a scalar, a copy from the
    device to the CPU, or a blocking copy from the CPU to the device."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default and not args[0].is_cpu:
            self.seen.append("a scalar read (.item() / bool() / int())")
        elif func is aten._to_copy.default and isinstance(args[0], torch.Tensor):
            src, dst = args[0].device, kwargs.get("device") or args[0].device
            self._copy(src, torch.device(dst), kwargs.get("non_blocking", False))
        elif func is aten.copy_.default:
            self._copy(args[1].device, args[0].device, args[2] if len(args) > 2 else
                       kwargs.get("non_blocking", False))
        return func(*args, **kwargs)

    def _copy(self, src: torch.device, dst: torch.device, non_blocking: bool) -> None:
        if src.type == "meta" and dst.type == "cpu":
            self.seen.append("a device-to-host copy")
        elif src.type == "cpu" and dst.type == "meta" and not non_blocking:
            self.seen.append("a blocking host-to-device copy at " + _caller())


def _caller() -> str:
    """The innermost cpattn frame of the current stack, "file:line"."""
    frames = [f for f in traceback.extract_stack() if "/cpattn/" in f.filename]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"


def _device_tensors(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="meta", dtype=dtype, requires_grad=True)


def _calls(rank: int, world: int):
    """(name, call) for each public distributed function; a call runs forward and backward."""
    b, s, h, hkv, d = 1, 32, 4, 2, 32
    q = _device_tensors(b, s, h, d)
    k, v = _device_tensors(b, s, hkv, d), _device_tensors(b, s, hkv, d)
    sinks = torch.randn(h, device="meta", requires_grad=True)
    rings = [dist.new_group([r]) for r in range(world)]  # hybrid: Ulysses over all, ring of 1

    def backward(out):
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    def ring(strategy):
        return lambda: backward(cpattn.ring_attention(q, k, v, causal=True, sinks=sinks,
                                                      strategy=strategy, return_lse=True))

    cu = [0, 20, 64]  # the global documents, on the host
    kv_cache = cpattn.KVCacheShard(batch=2, capacity=128, kv_heads=hkv, head_dim=d,
                                   dtype=torch.bfloat16, device="meta", world_size=world,
                                   rank=rank)
    prompt = [_device_tensors(2, 16, n, d).detach() for n in (h, hkv, hkv)]
    return [
        ("ring_attention(strategy='ring')", ring("ring")),
        ("ring_attention(strategy='allgather')", ring("allgather")),
        ("ulysses_attention", lambda: backward(cpattn.ulysses_attention(
            q, k, v, causal=True, window=(8, 0), sinks=sinks))),
        ("hybrid_attention", lambda: backward(cpattn.hybrid_attention(
            q, k, v, ulysses_group=dist.group.WORLD, ring_group=rings[rank], causal=True))),
        ("ring_attention_varlen", lambda: backward(cpattn.ring_attention_varlen(
            q[0], k[0], v[0], cu, causal=True))),
        ("ring_attention(return_max_logits=True)", lambda: backward(cpattn.ring_attention(
            q, k, v, causal=True, return_max_logits=True))),
        ("ulysses_attention_varlen", lambda: backward(cpattn.ulysses_attention_varlen(
            q[0], k[0], v[0], cu, causal=True))),
        ("prefill_attention + decode_attention", lambda: _prefill_decode(kv_cache, prompt)),
    ]


def _prefill_decode(cache, prompt) -> None:
    """Two prompt chunks (the second one over cached tokens too, padded: seqlen < the chunk),
    then a decode step, both ways of merging it."""
    cache.clear()
    cpattn.prefill_attention(*prompt, cache, causal=True)
    cpattn.prefill_attention(*prompt, cache, causal=True, seqlen=30)
    q1 = prompt[0][:, :1]
    cache.append(prompt[1][:, :1], prompt[2][:, :1])
    cpattn.decode_attention(q1, cache, causal=True)
    cpattn.decode_attention(q1, cache, causal=True, comm="reduce_scatter")


def _no_round_trips(rank: int, world: int) -> list:
    _validation.DEVICE_TYPES = (*_validation.DEVICE_TYPES, "meta")
    found = []
    for name, call in _calls(rank, world):
        call()  # warm-up: the first call of a signature
        mode = HostRoundTrips()
        try:
            with mode:
                call()
        except Exception as e:  # a host read of a meta tensor raises
            found.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
        found += [f"{name}: {what}" for what in mode.seen]
    return found


def test_no_host_round_trip_on_device_tensors():
    for rank, found in enumerate(run_ranks(2, _no_round_trips)):
        assert found == [], f"rank {rank}: " + "; ".join(found)


def test_the_detector_sees_a_host_read():
    """Negative control: the mode above and meta tensors do catch a host round trip."""
    t = torch.ones(3, device="meta")
    for read in (t.tolist, t.cpu, lambda: bool(t[0])):
        with pytest.raises((NotImplementedError, RuntimeError)):
            read()
    mode = HostRoundTrips()
    with mode:
        torch.arange(3).to("meta")  # a blocking host-to-device copy
        torch.arange(3).to("meta", non_blocking=True)  # this one is not
    assert len(mode.seen) == 1 and mode.seen[0].startswith("a blocking host-to-device copy")


def test_tensor_options_on_a_device_are_compared_without_their_values(monkeypatch):
    monkeypatch.setattr(_agreement, "_mode", None)
    on_device = torch.randn(4, device="meta")
    assert _agreement.tensor_values(on_device) == "<meta tensor (4,) torch.float32>"
    assert isinstance(_agreement.tensor_values(torch.randn(4)), bytes)  # CPU: exact values
    monkeypatch.setattr(_agreement, "_mode", "always")
    with pytest.raises(NotImplementedError):  # "always" reads them (meta has none)
        _agreement.tensor_values(on_device)


def _capture_guard(rank: int, world: int) -> None:
    q = torch.randn(1, 16, 2, 8)
    cpattn.ring_attention(q, q, q, causal=True)  # warm-up: this signature is checked
    real = _agreement.capturing
    _agreement.capturing = lambda: True  # as if the stream were capturing a CUDA graph
    sent = _agreement.header_rounds
    try:
        cpattn.ring_attention(q, q, q, causal=True)  # checked before: trusted, nothing sent
        assert _agreement.header_rounds == sent
        with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
            cpattn.ring_attention(q, q, q, causal=False)  # a new signature: refused
    finally:
        _agreement.capturing = real
    cpattn.ring_attention(q, q, q, causal=False)  # the group still works


def test_capture_trusts_only_signatures_checked_before_it():
    run_ranks(2, _capture_guard)


def _shifts(rank: int, world: int) -> None:
    from cpattn.testing.emulation import load_ops

    load_ops()
    name = dist.group.WORLD.group_name
    for dtype in (torch.float32, torch.bfloat16):
        mine = torch.full((3, 5), float(rank), dtype=dtype)
        got = torch.ops.cpattn_testing.ring_shift(mine, name, 30.0)
        assert torch.equal(got, torch.full_like(mine, float((rank - 1) % world)))
    post_us, wait_us = torch.ops.cpattn_testing.ring_post_timing(mine, name, 20, 30.0).tolist()
    assert post_us > 0 and wait_us >= 0


@pytest.mark.parametrize("world", [2, 3])
def test_process_group_transport_shifts_over_gloo(world):
    """The c10d transport (gloo here; NCCL with CPATTN_RING_TRANSPORT=c10d, coalesced) moves each
    rank's buffer to the next rank, W = 2 (one peer both ways) and 3."""
    run_ranks(world, _shifts)
