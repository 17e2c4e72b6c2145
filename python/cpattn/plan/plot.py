"""Plots of the cost model (python -m cpattn plan --plot) and of measured tables (bench/).
Needs matplotlib; nothing else in cpattn does (cpattn.plan does not import this module)."""

import dataclasses
from typing import Sequence

# a Figure of its own, not pyplot's: no backend or global state touched, written to a file
from matplotlib.figure import Figure

from cpattn.plan.model import COST_MODELS, Machine, Problem
from cpattn.plan.predict import predict


def _best_per_strategy(preds) -> dict:
    """The fastest candidate of each cost model (one line per strategy in the plots)."""
    best = {}
    for r in preds:
        f = r.candidate.strategy
        if f not in best or r.time < best[f].time:
            best[f] = r
    return best


def plot_plan(problem: Problem, machine: Machine, worlds: Sequence[int],
              seqlens: Sequence[int], world: int, path: str) -> None:
    """Time and peak memory per rank against W, and time against sequence length at `world`
    ranks, for each strategy (hybrid: its best U x R at each point)."""
    fig = Figure(figsize=(16, 4.8))
    axes = fig.subplots(1, 3)
    series_w = {f: ([], [], []) for f in COST_MODELS}
    for w in worlds:
        for f, r in _best_per_strategy(predict(problem, machine, w)).items():
            series_w[f][0].append(w)
            series_w[f][1].append(r.time * 1e3)
            series_w[f][2].append(r.peak_memory / 2**30)
    series_s = {f: ([], []) for f in COST_MODELS}
    for s in seqlens:
        p = dataclasses.replace(problem, seqlen=s, documents=None)
        for f, r in _best_per_strategy(predict(p, machine, world)).items():
            series_s[f][0].append(s)
            series_s[f][1].append(r.time * 1e3)
    for f in COST_MODELS:
        if series_w[f][0]:
            axes[0].plot(series_w[f][0], series_w[f][1], marker="o", label=f)
            axes[1].plot(series_w[f][0], series_w[f][2], marker="o", label=f)
        if series_s[f][0]:
            axes[2].plot(series_s[f][0], series_s[f][1], marker="o", label=f)
    axes[0].set(xscale="log", yscale="log", xlabel="ranks W", ylabel="time per call (ms)",
                title=f"S = {problem.seqlen}")
    axes[1].set(xscale="log", yscale="log", xlabel="ranks W", ylabel="peak memory per rank (GiB)")
    axes[1].axhline(machine.memory / 2**30, color="grey", linestyle="--", label="rank memory")
    axes[2].set(xscale="log", yscale="log", xlabel="sequence length",
                ylabel="time per call (ms)", title=f"W = {world}")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"cpattn plan: H {problem.heads}, Hkv {problem.kv_heads}, D "
                 f"{problem.head_dim}, {problem.dtype}, {'causal' if problem.causal else 'full'},"
                 f" {problem.mode}; machine {machine.name} ({machine.source[:60]}...)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_rows(rows: Sequence[dict], x: str, ys: Sequence[str], group: str, path: str,
              title: str = "", logx: bool = True) -> None:
    """A measured table as lines: one panel per column in `ys`, one line per value of `group`,
    against column `x`. rows: dicts of column -> value."""
    fig = Figure(figsize=(5.5 * len(ys), 4.2))
    axes = fig.subplots(1, len(ys), squeeze=False)
    keys = list(dict.fromkeys(r[group] for r in rows))
    for ax, y in zip(axes[0], ys):
        for key in keys:
            pts = sorted((r[x], r[y]) for r in rows if r[group] == key)
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=str(key))
        ax.set(xlabel=x, ylabel=y)
        if logx:
            ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
