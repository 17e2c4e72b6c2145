"""pytest options and reporting for the pytest-benchmark suite in bench/.

Options:
  --bench-threads N   torch.set_num_threads(N) for the whole session (default: torch's default)
  --bench-dtype NAME  float32 (default), bfloat16 or float16

After a timed run (not with --benchmark-disable) a GFLOP/s table of the medians is printed,
flash-attn FLOP convention (see bench/README.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cpattn.core.layout import DTYPES


@dataclass
class Record:
    """A finished benchmark: its group, implementation, counted FLOPs and fixture."""

    group: str
    impl: str
    flops: float
    fixture: Any  # pytest_benchmark's BenchmarkFixture; .stats is None when disabled


_records: list[Record] = []
_session_threads: list[int] = []  # the thread count the benchmarks ran with


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cpattn bench")
    group.addoption(
        "--bench-threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the benchmarks (default: torch's default)",
    )
    group.addoption(
        "--bench-dtype",
        choices=list(DTYPES),
        default="float32",
        help="dtype of q, k, v (default float32)",
    )


@pytest.fixture(scope="session", autouse=True)
def bench_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The torch thread count of the session, set from --bench-threads."""
    saved = torch.get_num_threads()
    wanted = request.config.getoption("--bench-threads")
    if wanted:
        torch.set_num_threads(wanted)
    _session_threads.append(torch.get_num_threads())
    yield _session_threads[-1]
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def bench_dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return DTYPES[request.config.getoption("--bench-dtype")]


@pytest.fixture
def record_flops() -> Any:
    """record_flops(benchmark, impl, flops): remember a benchmark for the GFLOP/s summary."""

    def record(fixture: Any, impl: str, flops: float) -> None:
        _records.append(Record(fixture.group, impl, flops, fixture))

    return record


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """Adds torch, cpattn and thread settings to pytest-benchmark's saved machine info."""
    import cpattn

    machine_info["torch_version"] = torch.__version__
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["cpattn_isa"] = cpattn.build_info()["cpu_isa"]


@pytest.hookimpl(trylast=True)  # after pytest-benchmark's own tables
def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """GFLOP/s (from the median time) of every timed benchmark, cpattn and SDPA side by side."""
    rows: dict[str, dict[str, float]] = {}
    for r in _records:
        stats = getattr(r.fixture, "stats", None)
        if stats is None:
            continue
        rows.setdefault(r.group, {})[r.impl] = r.flops / stats.stats.median / 1e9
    if not rows:
        return
    tr = terminalreporter
    threads = _session_threads[-1] if _session_threads else torch.get_num_threads()
    tr.section(f"GFLOP/s from the median, flash-attn FLOP convention (torch threads {threads})")
    tr.write_line("| group | cpattn | sdpa | ratio |")
    tr.write_line("|---|--:|--:|--:|")
    for group, rates in rows.items():
        ours, theirs = rates.get("cpattn"), rates.get("sdpa")
        ratio = f"{ours / theirs:.2f}" if ours and theirs else "-"
        tr.write_line(f"| {group} | {_cell(ours)} | {_cell(theirs)} | {ratio} |")


def _cell(rate: float | None) -> str:
    return f"{rate:.1f}" if rate else "-"
