"""Runs a function on W real ranks: spawned processes joined by a gloo process group.

The one spawn harness of the tests, the benchmarks and the demos.
"""

import faulthandler
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, threads: int,
           poison: bool, results) -> None:
    faulthandler.enable()  # a native crash prints every thread's Python stack
    if poison:
        os.environ.setdefault("CPATTN_POISON", "1")  # unwritten outputs fail the checks
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        results.put((rank, fn(rank, world, *args)))
    finally:
        dist.destroy_process_group()
    # A rank whose work succeeded leaves without interpreter finalisation: with transformers
    # imported, about 1 exit in 15 aborted there ("terminate called without an active
    # exception", no Python frame left), after every check had passed. Errors above still
    # propagate through mp.spawn as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn: Callable, *args, threads: int = 1, poison: bool = True
              ) -> list[Any]:
    """Calls fn(rank, world, *args) on `world` spawned processes and returns what each returned
    (picklable), in rank order; an exception in any rank fails the call.

    threads: torch threads per rank (the ranks share the machine's cores).
    poison: CPATTN_POISON=1 in the ranks (unless set): outputs a kernel leaves unwritten are NaN,
        so a test's comparison fails; benchmarks pass False.
    """
    results = mp.get_context("spawn").SimpleQueue()
    received: dict[int, Any] = {}

    def drain() -> None:  # while the ranks run: a large result must not block its rank's exit
        while not results.empty():
            rank, value = results.get()
            received[rank] = value

    with tempfile.TemporaryDirectory() as tmp:
        ranks = mp.spawn(_entry, args=(world, os.path.join(tmp, "rendezvous"), fn, args, threads,
                                       poison, results), nprocs=world, join=False)
        while not ranks.join(timeout=0.05):
            drain()
        drain()
    return [received[r] for r in range(world)]
