"""Runs a function on W real ranks: spawned processes joined by a gloo process group.

The one spawn harness of the tests, the benchmarks and the demos. By default every call spawns
its ranks afresh. `keep_ranks(True)` (the test suite's conftest) keeps them instead: a call
reuses the ranks of the previous call with the same world size, thread count, poisoning,
environment and calling module, so a test file starts its interpreters (torch, cpattn, maybe
transformers) once rather than once per test. Kept ranks restore their environment after every
call, and a failed call ends them (its peers may be stuck in a collective).
"""

import atexit
import faulthandler
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A call whose ranks are not all back after this long fails (and ends its ranks), instead of
# holding a test run until an outer timeout.
CALL_TIMEOUT_S = 1800.0
# After one rank failed: how long its peers get to report their own errors before they are ended.
PEER_GRACE_S = 5.0


@dataclass
class _RankFailed:
    trace: str


def _start_rank(rank: int, world: int, init_file: str, threads: int, poison: bool) -> None:
    faulthandler.enable()  # a native crash prints every thread's Python stack
    if poison:
        os.environ.setdefault("CPATTN_POISON", "1")  # unwritten outputs fail the checks
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
    )


def _leave(code: int) -> None:
    # A rank leaves without interpreter finalisation: with transformers imported, about 1 exit
    # in 15 aborted there ("terminate called without an active exception", no Python frame
    # left), after every check had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _entry(rank: int, world: int, init_file: str, fn: Callable, args: tuple, threads: int,
           poison: bool, results) -> None:
    _start_rank(rank, world, init_file, threads, poison)
    try:
        results.put((rank, fn(rank, world, *args)))
    except BaseException:
        # Every failed rank's own error reaches the caller, not only the first one mp.spawn
        # reports (often a peer's "connection reset" that hides the cause).
        results.put((rank, _RankFailed(traceback.format_exc())))
        raise
    finally:
        dist.destroy_process_group()
    _leave(0)


def _serve(rank: int, world: int, init_file: str, threads: int, poison: bool, conn,
           parent: int) -> None:
    """A kept rank: runs (fn, args) tasks from conn until told to stop (None), its parent is
    gone, or a task fails."""
    _start_rank(rank, world, init_file, threads, poison)
    environment = dict(os.environ)
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:
                _leave(0)
            continue
        try:
            task = conn.recv()
            if task is None:
                break
            fn, args = task
            conn.send(fn(rank, world, *args))
        except BaseException:
            conn.send(_RankFailed(traceback.format_exc()))
            _leave(1)  # no destroy: a peer may be stuck in a collective with this rank
        finally:  # what a task changed in the process's settings does not reach the next one
            os.environ.clear()
            os.environ.update(environment)
            torch.set_num_threads(threads)
            torch.set_grad_enabled(True)
    dist.destroy_process_group()
    _leave(0)


def _failure_message(world: int, failed: dict[int, str]) -> str:
    return "".join(f"\n\n-- rank {r} of {world} failed:\n{trace}" for r, trace in sorted(
        failed.items()))


class _KeptRanks:
    """`world` serving ranks and a pipe to each."""

    def __init__(self, world: int, threads: int, poison: bool) -> None:
        context = mp.get_context("spawn")
        self.world = world
        self._folder = tempfile.TemporaryDirectory()
        init_file = os.path.join(self._folder.name, "rendezvous")
        self._conns, self._procs = [], []
        for rank in range(world):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_serve, args=(rank, world, init_file, threads, poison,
                                                        theirs, os.getpid()))
            proc.start()
            theirs.close()
            self._conns.append(mine)
            self._procs.append(proc)

    def run(self, fn: Callable, args: tuple) -> list[Any]:
        for conn in self._conns:
            conn.send((fn, args))
        received: dict[int, Any] = {}
        failed: dict[int, str] = {}
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while len(received) + len(failed) < self.world:
            waiting = [r for r in range(self.world) if r not in received and r not in failed]
            left = deadline - time.monotonic()
            if left <= 0:
                for r in waiting:
                    failed[r] = f"no answer within {CALL_TIMEOUT_S:.0f} s"
                break
            watched = {}
            for r in waiting:
                watched[self._conns[r]] = r
                watched[self._procs[r].sentinel] = r
            for ready in wait(list(watched), timeout=min(left, 1.0)):
                r = watched[ready]
                if r in received or r in failed:
                    continue
                try:
                    value = self._conns[r].recv()
                except (EOFError, OSError):
                    self._procs[r].join(1.0)
                    value = _RankFailed(f"the process ended (exit code {self._procs[r].exitcode})"
                                        " without an answer")
                if isinstance(value, _RankFailed):
                    failed[r] = value.trace
                    deadline = min(deadline, time.monotonic() + PEER_GRACE_S)
                else:
                    received[r] = value
        if failed:
            self.close()
            raise mp.ProcessRaisedException(_failure_message(self.world, failed), min(failed),
                                            0)
        return [received[r] for r in range(self.world)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send(None)
                except OSError:
                    pass
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._folder.cleanup()


_keep = False
_kept: dict[tuple, _KeptRanks] = {}


def keep_ranks(keep: bool = True) -> None:
    """Whether run_ranks keeps its ranks for the next call with the same settings (see the
    module's docstring); False ends the kept ones."""
    global _keep
    _keep = keep
    if not keep:
        _end_kept()


def _end_kept(module: str | None = None) -> None:
    for key in [k for k in _kept if module is None or k[0] != module]:
        _kept.pop(key).close()


atexit.register(_end_kept)


def run_ranks(world: int, fn: Callable, *args, threads: int = 1, poison: bool = True,
              fresh: bool = False) -> list[Any]:
    """Calls fn(rank, world, *args) on `world` processes and returns what each returned
    (picklable), in rank order; an exception in any rank fails the call.

    threads: torch threads per rank (the ranks share the machine's cores).
    poison: CPATTN_POISON=1 in the ranks (unless set): outputs a kernel leaves unwritten are NaN,
        so a test's comparison fails; benchmarks pass False.
    fresh: spawn new ranks for this call even where ranks are kept (a test of what a process
        does once, or of its exit).
    """
    if _keep and not fresh:
        module = getattr(fn, "__module__", "")
        _end_kept(module)  # a test file's ranks end when the next file starts
        environment = tuple(sorted((k, v) for k, v in os.environ.items()
                                   if k != "PYTEST_CURRENT_TEST"))
        key = (module, world, threads, poison, environment)
        ranks = _kept.get(key)
        if ranks is None or not ranks.alive():
            if ranks is not None:
                ranks.close()
            ranks = _kept[key] = _KeptRanks(world, threads, poison)
        try:
            return ranks.run(fn, args)
        finally:
            if key in _kept and not _kept[key].alive():
                _kept.pop(key).close()
    return _spawn(world, fn, args, threads, poison)


def _spawn(world: int, fn: Callable, args: tuple, threads: int, poison: bool) -> list[Any]:
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
            failed = {r: v.trace for r, v in received.items() if isinstance(v, _RankFailed)}
            raise mp.ProcessRaisedException(_failure_message(world, failed) or str(error),
                                            error.error_index, error.error_pid) from error
        drain()
    return [received[r] for r in range(world)]
