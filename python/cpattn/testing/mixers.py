"""W ranks of the mixer primitives in one process: each rank on a thread, the exchange a stack of
the ranks' tensors (its gradient is autograd's: each slice back to its rank, summed). The ranks'
outputs share one autograd graph, so one backward (or torch.autograd.gradcheck) covers all of
them, the adjoint exchange included."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from cpattn.mixers.exchange import Exchange


def emulate(world: int, fn: Callable[[int, Exchange], Any]) -> list[Any]:
    """[fn(rank, exchange) for every rank], run concurrently (each rank on its own thread, as
    the exchange waits for all of them). An exception on any rank is raised here."""
    barrier = threading.Barrier(world)
    deposited: list = [None] * world
    results: list = [None] * world
    errors: list = []
    grad = torch.is_grad_enabled()

    def exchange_of(rank: int) -> Exchange:
        def exchange(x: torch.Tensor) -> torch.Tensor:
            deposited[rank] = x
            barrier.wait()
            out = torch.stack(deposited)
            barrier.wait()  # every rank has read before the next exchange overwrites
            return out
        return exchange

    def run(rank: int) -> None:
        try:
            with torch.set_grad_enabled(grad):
                results[rank] = fn(rank, exchange_of(rank))
        except BaseException as e:  # noqa: BLE001 - re-raised by the caller
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                     errors[0])
        raise first
    return results
