"""The test harness's kept ranks (cpattn.testing.distributed): a call reuses the ranks of the
previous one with the same settings, a task cannot change the next task's environment, a failed
call reports every failed rank and ends its ranks, and the next call starts fresh ones."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpattn.testing import distributed as harness


@pytest.fixture
def kept():
    """Kept ranks for the test, whatever the suite's setting; ended after."""
    before = harness._keep
    harness.keep_ranks(True)
    yield
    harness.keep_ranks(False)
    harness.keep_ranks(before)


def _identity(rank, world, tag):
    torch.manual_seed(rank)
    x = torch.full((1,), float(rank + 1))
    dist.all_reduce(x)  # the group works
    return os.getpid(), tag, x.item()


def _change_settings(rank, world):
    os.environ["CPATTN_RUN_RANKS_PROBE"] = "set"
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    return os.getpid()


def _settings(rank, world):
    return (os.getpid(), os.environ.get("CPATTN_RUN_RANKS_PROBE"), torch.get_num_threads(),
            torch.is_grad_enabled())


def _fail_on_last(rank, world):
    if rank == world - 1:
        raise RuntimeError(f"planned failure on rank {rank}")
    return os.getpid()


def test_kept_ranks_are_reused_and_restored(kept):
    first = harness.run_ranks(2, _identity, "a")
    second = harness.run_ranks(2, _identity, "b")
    assert [r[1:] for r in first] == [("a", 3.0), ("a", 3.0)]
    assert [r[1:] for r in second] == [("b", 3.0), ("b", 3.0)]
    assert [r[0] for r in first] == [r[0] for r in second], "the same processes serve both calls"
    assert len({r[0] for r in first}) == 2 and os.getpid() not in {r[0] for r in first}

    changed = harness.run_ranks(2, _change_settings)
    after = harness.run_ranks(2, _settings)
    assert [a[0] for a in after] == changed, "still the same processes"
    assert all(a[1:] == (None, 1, True) for a in after), after  # environment, threads, grad

    fresh = harness.run_ranks(2, _identity, "c", fresh=True)
    assert not {r[0] for r in fresh} & {r[0] for r in second}, "fresh=True spawns new ranks"


def test_a_failed_call_reports_and_ends_its_ranks(kept):
    before = harness.run_ranks(2, _identity, "a")
    with pytest.raises(mp.ProcessRaisedException, match="(?s)rank 1 of 2 failed.*planned failure"):
        harness.run_ranks(2, _fail_on_last)
    after = harness.run_ranks(2, _identity, "b")
    assert [r[1:] for r in after] == [("b", 3.0)] * 2
    assert not {r[0] for r in before} & {r[0] for r in after}, "new ranks after a failure"


def test_other_settings_get_other_ranks(kept):
    two = harness.run_ranks(2, _identity, "a")
    one = harness.run_ranks(1, _identity, "a")
    unpoisoned = harness.run_ranks(2, _identity, "a", poison=False)
    assert one[0][2] == 1.0
    assert not {r[0] for r in two} & {r[0] for r in unpoisoned}
