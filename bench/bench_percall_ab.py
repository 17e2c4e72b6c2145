"""Per-call time of the default ring_attention call (W = 2 gloo ranks, tiny shapes, so that the
Python layer and the messages dominate), for an A/B of two source trees of the same build:

    torchrun --standalone --nproc-per-node 2 bench/bench_percall_ab.py ROOT before|after [backward]

With "backward": each call is the forward and the backward (out.sum().backward()).
"after" imports the installed cpattn (its path must start with ROOT); "before" drops the
editable install's import redirect and imports ROOT/python instead (e.g. a `git worktree` of
the previous commit with the built _C module and _build_info.py copied into its python/cpattn).
Prints rank 0's median and min over 7 rounds of 200 calls, in microseconds per call."""
import sys
import time


def main(root: str, side: str, backward: bool = False) -> None:
    if side == "before":  # the old source tree, not the editable install's redirect
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
        sys.path.insert(0, root + "/python")
    import torch
    import torch.distributed as dist

    import cpattn

    assert cpattn.__file__.startswith(root), cpattn.__file__
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    q = torch.randn(1, 64, 4, 32, requires_grad=backward)

    def call() -> None:
        out = cpattn.ring_attention(q, q, q, causal=True)
        if backward:
            out.sum().backward()

    for _ in range(30):
        call()
    times = []
    for _ in range(7):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(200):
            call()
        times.append((time.perf_counter() - start) / 200 * 1e6)
    if dist.get_rank() == 0:
        print(f"{side} median us/call {sorted(times)[3]:.0f} min {min(times):.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["backward"])
