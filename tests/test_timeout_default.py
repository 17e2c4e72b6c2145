"""The default timeout of a distributed call is the process group's own (torch's default: 10
minutes for NCCL, 30 for gloo, or what init_process_group / new_group were given), overridden by
$CPATTN_COMM_TIMEOUT and by the call's `timeout`; for hybrid the shorter of its two groups'."""

import datetime

import pytest
import torch
import torch.distributed as dist

import cpattn
from cpattn.core.validation import check_timeout, group_timeout

from distributed import run_ranks


def _timeouts(rank: int, world: int) -> None:
    world_seconds = group_timeout(None)  # run_ranks's group: torch's default for gloo
    assert world_seconds == dist.distributed_c10d.default_pg_timeout.total_seconds()
    short = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=42))
    longer = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=99))
    assert group_timeout(short) == 42.0 and group_timeout(longer) == 99.0
    assert check_timeout("f", None, short) == 42.0
    assert check_timeout("f", None, short, longer) == 42.0  # hybrid: the shorter one
    assert check_timeout("f", None) == world_seconds
    assert check_timeout("f", 7, short) == 7.0  # the call's own
    seen = []
    real = torch.ops.cpattn.ring_fwd

    class Recording:  # the ring op records the timeout it is given
        def __call__(self, *args, **kwargs):
            seen.append(args[5])
            return real(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(real, name)

    torch.ops.cpattn.ring_fwd = Recording()
    try:
        q = torch.randn(1, 8, 2, 8)
        cpattn.ring_attention(q, q, q, group=short)
        cpattn.ring_attention(q, q, q, group=longer, timeout=5)
    finally:
        torch.ops.cpattn.ring_fwd = real
    assert seen == [42.0, 5.0], seen


def test_default_timeout_is_the_groups():
    run_ranks(2, _timeouts)


def test_environment_overrides_the_group(monkeypatch):
    monkeypatch.setenv("CPATTN_COMM_TIMEOUT", "12.5")
    assert check_timeout("f", None, object()) == 12.5  # the group is not asked
    monkeypatch.setenv("CPATTN_COMM_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"\$CPATTN_COMM_TIMEOUT='soon': must be a number"):
        check_timeout("f", None)
    monkeypatch.delenv("CPATTN_COMM_TIMEOUT")
    with pytest.raises(ValueError, match="must be finite and > 0"):
        check_timeout("f", -1.0)

