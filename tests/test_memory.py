"""Memory per rank: the bytes a forward + backward call allocates, counted by the allocator hook
(cpattn.memory.counting), on the rank that allocates most within 10 % of the model
(cpattn.plan.memory), per strategy, on W = 2 real ranks; and the ring's cached buffers (reuse
never touches a tensor handed out, release)."""

import torch
import torch.distributed as dist

import cpattn
from cpattn import plan as P
from cpattn.testing.emulation import load_ops

from distributed import run_ranks

S, H, D = 1024, 4, 64  # global sequence; per rank 512 tokens
CASES = [  # (strategy, layout, kv heads, dtype, chunk: ring_chunk / allgather_chunk)
    ("ring", "zigzag", 4, torch.float32, None),
    ("ring", "zigzag", 2, torch.bfloat16, None),
    ("ring", "contiguous", 4, torch.bfloat16, None),
    ("ring", "zigzag", 4, torch.float32, 1),
    ("ring", "zigzag", 4, torch.bfloat16, 3),
    ("allgather", "zigzag", 4, torch.float32, None),
    ("allgather", "zigzag", 2, torch.bfloat16, None),
    ("ulysses", "contiguous", 4, torch.float32, None),
    ("ulysses", "contiguous", 2, torch.bfloat16, None),
]
# The same with the CPU backward in one kernel call per KV head (its byte budget lowered, which
# the model reads back through torch.ops.cpattn.cpu_backward_sizes): each call packs and sums
# only its group's heads.
GROUPED = [
    ("ulysses", "contiguous", 4, torch.bfloat16, None),
    ("ring", "contiguous", 4, torch.bfloat16, None),
]


def _call(strategy, layout, chunk, q, k, v):
    if strategy == "ulysses":
        return cpattn.ulysses_attention(q, k, v, causal=True)
    name = "ring_chunk" if strategy == "ring" else "allgather_chunk"
    return cpattn.ring_attention(q, k, v, causal=True, layout=layout, strategy=strategy,
                                 **{name: chunk})


def _measured_vs_model(rank: int, world: int) -> list[tuple[str, list[int], tuple[int, int]]]:
    """(case, peaks measured on this rank, (model, gloo_late)) per case."""
    load_ops()  # torch.ops.cpattn_testing (set_cpu_backward_group_bytes), in this spawned rank
    rows = []  # returned, not raised: a rank that raised would leave its peer in a collective
    for strategy, layout, hkv, dtype, chunk, group_bytes in (
            [c + (None,) for c in CASES] + [c + (1,) for c in GROUPED]):
        if group_bytes:
            default = torch.ops.cpattn_testing.set_cpu_backward_group_bytes(group_bytes)
        L = S // world
        torch.manual_seed(rank)
        q, k, v = (torch.randn(1, L, h, D, dtype=dtype, requires_grad=True) for h in (H, hkv, hkv))
        g = torch.randn(1, L, H, D, dtype=dtype)
        _call(strategy, layout, chunk, q, k, v).backward(g)  # warm-up: lazy initialisation
        peaks = []
        # The least of 5: gloo frees its collectives' copies on its own thread, at times in the
        # next phase (plan.memory), which can only raise a measured peak.
        for _ in range(5):
            q.grad = k.grad = v.grad = None
            cpattn.release_buffers()  # the model counts the ring's buffers
            dist.barrier()
            with cpattn.memory.counting() as c:
                _call(strategy, layout, chunk, q, k, v).backward(g)
            peaks.append(c.peak)
        p = P.Problem(S, H, hkv, D, dtype=str(dtype).split(".")[1], causal=True)
        m = P.memory(p, strategy, world, layout, chunk, gloo=True)
        model = (m["peak"], m["gloo_late"])
        if group_bytes:
            torch.ops.cpattn_testing.set_cpu_backward_group_bytes(default)
        rows.append((f"{strategy}/{layout} kv heads {hkv} {dtype} chunk {chunk} group bytes "
                     f"{group_bytes}", peaks, model))
    return rows


def test_memory_matches_model():
    """The model is the peak of the rank that allocates most (with a causal contiguous layout
    rank 0 sees no keys after its own shard, and computes and allocates less). Gloo frees its
    collectives' copies on its own thread: one of them may still be alive in the next phase
    (the model's gloo_late), and on a loaded machine in all five calls."""
    by_rank = run_ranks(2, _measured_vs_model)
    failures = []
    for cases in zip(*by_rank):
        name, _, (model, late) = cases[0]
        peak = max(min(peaks) for _, peaks, _ in cases)
        if peak < 0.9 * model or peak > 1.1 * model + late:
            failures.append(f"{name}: measured {[peaks for _, peaks, _ in cases]} (by rank), "
                            f"model {model}")
    assert not failures, "\n".join(failures)


def _cached_buffers(rank: int, world: int) -> None:
    def grads(seed):
        torch.manual_seed(seed)
        q, k, v = (torch.randn(1, 64, 2, 16, requires_grad=True) for _ in range(3))
        cpattn.ring_attention(q, k, v, causal=True).backward(torch.randn(1, 64, 2, 16))
        return q.grad, k.grad, v.grad

    first = grads(rank)
    kept = [g.clone() for g in first]
    assert cpattn.release_buffers() > 0  # the receive buffers and accumulators it kept
    assert cpattn.release_buffers() == 0
    grads(rank)
    second = grads(10 + rank)  # reuses the cached buffers: never those handed out before
    for a, b in zip(first, kept):
        assert torch.equal(a, b)
    assert not any(torch.equal(a, b) for a, b in zip(first, second))
    dist.barrier()


def test_cached_buffers_reused_safely_and_released():
    run_ranks(2, _cached_buffers)
