"""Runs a function on W real ranks: spawned processes joined by a gloo process group.

The one spawn harness of the tests, the benchmarks and the demos.
"""

import faulthandler
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass
class _RankFailed:
    trace: str


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
    except BaseException:
        # Every failed rank's own error reaches the caller, not only the first one mp.spawn
        # reports (often a peer's "connection reset" that hides the cause).
        results.put((rank, _RankFailed(traceback.format_exc())))
        raise
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
        try:
            while not ranks.join(timeout=0.05):
                drain()
        except mp.ProcessRaisedException as error:
            drain()
            failed = sorted((r, v.trace) for r, v in received.items() if isinstance(v, _RankFailed))
            message = "".join(f"\n\n-- rank {r} of {world} failed:\n{trace}" for r, trace in failed)
            raise mp.ProcessRaisedException(message or str(error), error.error_index,
                                            error.error_pid) from error
        drain()
    return [received[r] for r in range(world)]
