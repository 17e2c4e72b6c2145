"""Runs a function on W real ranks: spawned processes joined by a gloo process group."""

import faulthandler
import os
import sys
import tempfile
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple) -> None:
    faulthandler.enable()  # a native crash prints every thread's Python stack
    os.environ.setdefault("CPATTN_POISON", "1")
    torch.set_num_threads(1)  # W ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    # A rank whose work succeeded leaves without interpreter finalisation: with transformers
    # imported, about 1 exit in 15 aborted there ("terminate called without an active
    # exception", no Python frame left), after every check had passed. Errors above still
    # propagate through mp.spawn as before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn: Callable, *args) -> None:
    """Calls fn(rank, world, *args) on `world` processes; an exception in any rank fails the call."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(world, os.path.join(tmp, "rendezvous"), fn, args), nprocs=world,
                 join=True)
