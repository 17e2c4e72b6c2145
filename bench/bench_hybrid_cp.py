"""Hybrid models under context parallelism, measured as a user runs them (issue 54 item 6): a
training step (forward, loss, backward) of a small transformers model whose layers are token
mixers, on W real gloo ranks with cpattn against the model's own code in one process.

    python bench/bench_hybrid_cp.py --out /tmp/hybrid_cp.md             # the table (hours)
    python bench/bench_hybrid_cp.py --models gdn --batches packed --worlds 2 --seqlens 8192
    python bench/bench_hybrid_cp.py --quick                              # smoke run, a minute
    python bench/bench_hybrid_cp.py --quick --ablate                     # its check must fail

Models (transformers' own classes, fp32 parameters, 2 mixer layers, hidden 512, vocab 256):
  gdn     Qwen3.5 (qwen3_5_text): 2 gated delta rule layers (Qwen3_5GatedDeltaNet, 8 value /
          4 key heads of 64, conv 4) each followed by its MLP (intermediate 1024)
  mamba2  NemotronH (nemotron_h): 2 Mamba-2 blocks (NemotronHMamba2Mixer, 16 heads of 64,
          state 64, 4 groups, chunk 64, conv 4)
Batches of S tokens (random ids, the labels the ids):
  one     one sequence of S tokens
  packed  log-normal documents (median 128 tokens (S / 16 below S = 2048), sigma 1.5, at least
          8: many short, a few long; the last one cut to fill S; fixed seed) packed by
          transformers' DataCollatorWithFlattening
dtypes: fp32, and bf16 = the fp32 model under torch.autocast("cpu", torch.bfloat16).

One process (T1): the model's own forward, transformers' torch path (what a user without cpattn
runs), 1 thread; packed: one forward per document (transformers' CPU mixers cannot keep packed
documents apart), their logits joined for one loss. Under CP: W spawned gloo ranks, 1 thread
each; cpattn.shard_batch's defaults (strategy ring, zigzag; documents planned), the model's
forward, cpattn.cross_entropy, backward. Neither times the data preparation nor the gradient
all-reduce that data parallelism does anyway. The anchor "cpattn W=1": the same CP step on one
rank (cpattn's kernels, no exchange partner): T1 / (W TW) above 1 says cpattn's kernels beat
transformers' torch path, not that W ranks beat W cores; "cpattn scaling" = anchor / (W TW), in
CPU time, is the parallel efficiency of cpattn itself (--no-anchor skips it).

Per rank and step: wall time and process CPU time (median of --reps timed steps after one
warm-up step; W ranks start each step together after a barrier), bytes sent (the rank's TCP
sockets' bytes_sent counters from `ss`, read around each step: what gloo put on the wire,
headers included; '-' without ss), peak memory (cpattn.memory.counting in the warm-up step: the
peak of the CPU tensor bytes allocated during the step, gradients included). TW = the slowest
rank's wall time of a step (median over the steps); efficiency T1 / (W TW), and the same in CPU
time. W ranks on fewer cores than W oversubscribe them: their wall time shows no parallel
speed-up, their CPU time still does. The check: CP's loss and gradients (averaged over the ranks,
as data parallelism would) against the one-process step's, as relative differences (each
parameter's gradient against its largest entry, at least 1 % of the model's largest); --ablate
runs the mixers without the exchange (each rank's pieces alone), which the check must flag.
Each rank's address space is limited (--memory-limit / W + 1 GiB): a step that needs more fails
and is reported as such, rather than starve the shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import math
import os
import re
import resource
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from hybrid_cp_models import (
    MODELS,
    build,
    config,
    cp_model,
    cpu_line,
    make_batch,
    mixers_alone,
    sent_between,
    sockets,
)

BATCHES = ("one", "packed")
DTYPES = ("fp32", "bf16")
# The check's bounds on the relative differences to one process (the one-process step's own
# rounding is of the order of 1e-6 in fp32, 1e-2 in bf16; a rank missing its neighbours'
# states is off by far more, see --ablate).
CHECK_BOUND = {"fp32": 1e-3, "bf16": 5e-2}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    batch: str
    dtype: str
    seqlen: int
    reps: int = 3
    small: bool = False  # the --quick layers (hidden 64)
    ablate: bool = False
    step_limit: float = 600.0  # a warm-up step slower than this: no timed steps
    memory_limit: float = 12.0  # GiB of address space for all ranks together (+1 each)


def _autocast(case: Case):
    return torch.autocast("cpu", torch.bfloat16) if case.dtype == "bf16" \
        else contextlib.nullcontext()


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[0, :-1].float(), labels[0, 1:],
                                             ignore_index=-100)


def run_rank(rank: int, world: int, case: Case, under_cp: bool) -> dict:
    """One rank's measurement (under_cp False: the one-process baseline, world 1)."""
    from cpattn.memory import counting

    # (a step that would take more memory fails here rather than starve the shared machine)
    limit = int((case.memory_limit / world + 1) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    cfg = config(case.model, case.small)
    batch, lengths = make_batch(case.batch, case.seqlen)
    if under_cp:
        import cpattn

        cp = cpattn.ContextParallel(strategy="ring")
        model = cp_model(cfg, cp)
        local = cpattn.shard_batch(batch, cp)
        labels = local.pop("shift_labels")
        tokens = int(local["input_ids"].shape[1])
        documents = local.get("cpattn_documents")
        plan = getattr(documents, "plan", None)
        split = None if plan is None else len(plan.split)  # documents over several ranks

        def step():
            with _autocast(case):
                logits = model(**local).logits
                loss = cpattn.cross_entropy(logits.float(), labels, cp)
            loss.backward()
            return loss
    else:
        model = build(cfg)
        tokens, split = case.seqlen, None
        parts = [batch["input_ids"]] if lengths is None else batch["input_ids"].split(lengths, 1)

        def step():
            with _autocast(case):
                logits = torch.cat([model(input_ids=part).logits for part in parts], 1)
                loss = _loss(logits, batch["labels"])
            loss.backward()
            return loss

    with mixers_alone() if case.ablate else contextlib.nullcontext():
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        with counting() as memory:
            loss = step()
        warmup = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if under_cp:
            for g in grads.values():
                dist.all_reduce(g)
                g /= world
        dist.all_reduce(warmup, op=dist.ReduceOp.MAX)  # (every rank takes the same decision)
        reps = case.reps if float(warmup) <= case.step_limit else 0
        known = tuple(set().union(*(sockets() or {} for _ in range(3))))  # (gloo's, from init)
        steps = []
        for _ in range(reps):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            before = sockets(known)
            wall, cpu = time.perf_counter(), time.process_time()
            step()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            dist.barrier()  # (this rank's bytes are all on the wire)
            steps.append((wall, cpu, sent_between(before, sockets(known))))
    # (numpy: a tensor would travel back as shared memory, gone when the rank exits)
    return dict(rank=rank, tokens=tokens, loss=float(loss.detach()), peak=memory.peak,
                warmup=float(warmup), steps=steps,
                grads={n: g.numpy() for n, g in grads.items()} if rank == 0 else None,
                documents=None if lengths is None else len(lengths), split=split)


def measure(case: Case, world: int, under_cp: Optional[bool] = None) -> dict:
    """Every rank's figures of `case` on `world` ranks (under_cp: with cpattn, by default when
    world > 1; world 1 without: the one-process baseline), or {"error": ...} when the ranks
    raised (a refusal: its message)."""
    import torch.multiprocessing as mp

    from cpattn.testing.distributed import run_ranks

    under_cp = world > 1 if under_cp is None else under_cp
    try:
        return {"ranks": run_ranks(world, run_rank, case, under_cp, poison=False)}
    except mp.ProcessRaisedException as e:
        found = re.findall(r"^(\w+(?:Error|Exception)): (.*)$", str(e), re.M)
        error = ": ".join(found[-1]) if found else str(e).strip().splitlines()[-1]
        if "can't allocate memory" in error:
            error += f" (over --memory-limit: {case.memory_limit / world + 1:.0f} GiB per rank)"
        return {"error": f"{'cpattn' if under_cp else 'one process'}: {error}"}


def _median_slowest(ranks: list[dict], index: int) -> Optional[float]:
    """The median over the steps of the slowest rank's figure `index` (0 wall, 1 CPU)."""
    if not ranks[0]["steps"]:
        return None
    return statistics.median(max(r["steps"][i][index] for r in ranks)
                             for i in range(len(ranks[0]["steps"])))


def check(reference: dict, got: dict) -> tuple[float, float]:
    """(relative difference of the losses, largest relative difference of a parameter's
    gradient) of rank 0 of `got` against `reference`."""
    ref, mine = reference["ranks"][0], got["ranks"][0]
    loss = abs(mine["loss"] - ref["loss"]) / abs(ref["loss"])
    largest = max(float(abs(g).max()) for g in ref["grads"].values())
    grad = 0.0
    for name, g in ref["grads"].items():
        scale = max(float(abs(g).max()), 1e-2 * largest)
        other = mine["grads"].get(name)
        diff = math.inf if other is None else float(abs(other - g).max()) / scale
        grad = max(grad, diff)
    return loss, grad


def summarise(case: Case, world: int, reference: dict, got: dict,
              anchor: Optional[dict] = None) -> dict:
    """One row of the report (anchor: cpattn on one rank, measure(case, 1, True))."""
    row = dict(model=case.model, batch=case.batch, dtype=case.dtype, seqlen=case.seqlen,
               world=world, cores=os.cpu_count())
    if anchor is not None and "error" in anchor:
        row["a1_error"] = anchor["error"]
    if "error" in reference:
        return {**row, "error": reference["error"]}
    one = reference["ranks"][0]
    row.update(documents=one["documents"], t1=_median_slowest([one], 0),
               t1_cpu=_median_slowest([one], 1), t1_peak=one["peak"], t1_warmup=one["warmup"])
    if "error" in got:
        return {**row, "error": got["error"]}
    ranks = got["ranks"]
    tw, tw_cpu = _median_slowest(ranks, 0), _median_slowest(ranks, 1)
    loss_diff, grad_diff = check(reference, got)

    def per_rank(index):
        if not ranks[0]["steps"]:
            return [None] * len(ranks)
        values = [[s[index] for s in r["steps"] if s[index] is not None] for r in ranks]
        return [statistics.median(v) if v else None for v in values]  # (bytes: None unseen)

    row.update(tw=tw, tw_cpu=tw_cpu, warmup=max(r["warmup"] for r in ranks),
               split=ranks[0]["split"],
               tokens=[r["tokens"] for r in ranks], wall=per_rank(0), cpu=per_rank(1),
               sent=per_rank(2), peak=[r["peak"] for r in ranks], steps=len(ranks[0]["steps"]),
               loss_diff=loss_diff, grad_diff=grad_diff,
               checked=grad_diff <= CHECK_BOUND[case.dtype]
               and loss_diff <= CHECK_BOUND[case.dtype])
    if row["t1"] is not None and tw is not None:
        row["efficiency"] = row["t1"] / (world * tw)
        row["efficiency_cpu"] = row["t1_cpu"] / (world * tw_cpu)
    if anchor is not None and "error" not in anchor and anchor["ranks"][0]["steps"] and tw:
        row["a1"] = _median_slowest(anchor["ranks"], 0)
        row["a1_cpu"] = _median_slowest(anchor["ranks"], 1)
        row["scaling_cpu"] = row["a1_cpu"] / (world * tw_cpu)
    return row


def _ranks(values, scale: float = 1.0, form: str = ".2f") -> str:
    return " / ".join("-" if v is None else f"{v / scale:{form}}" for v in values)


def table(rows: list[dict]) -> str:
    head = ("| model | batch | dtype | S | W | T1 s (CPU s) | cpattn W=1 s (CPU s) | TW s | "
            "wall s per rank | CPU s per rank | eff. T1/(W TW) | eff. CPU | cpattn scaling CPU | "
            "MiB sent per rank | peak MiB per rank | one process peak / W | "
            "check: loss, grad rel. diff |")
    lines = [head, "|---|---|---|--:|--:|" + "--:|" * 11 + "---|"]
    for r in rows:
        batch = r["batch"]
        if r.get("documents"):
            split = f", {r['split']} split" if r.get("split") is not None else ""
            batch = f"packed ({r['documents']} docs{split})"
        first = f"| {r['model']} | {batch} | {r['dtype']} | {r['seqlen']} | {r['world']} | "
        if "t1" in r:
            t1 = "-" if r["t1"] is None else f"{r['t1']:.2f} ({r['t1_cpu']:.2f})"
        if "error" in r:
            lines.append(first + (f"{t1} | " if "t1" in r else "- | ")
                         + f"**refused / failed**: {r['error'][:300]} |" + " |" * 10)
            continue
        tw = f"{r['tw']:.2f}" if r["steps"] else f"- (warm-up {r['warmup']:.0f} s)"
        eff = (f"{r['efficiency']:.2f}", f"{r['efficiency_cpu']:.2f}") if "efficiency" in r \
            else ("-", "-")
        verdict = "ok" if r["checked"] else "**FAILS**"
        a1 = f"{r['a1']:.2f} ({r['a1_cpu']:.2f})" if "a1" in r else \
            ("failed: " + r["a1_error"][:120] if "a1_error" in r else "-")
        scaling = f"{r['scaling_cpu']:.2f}" if "scaling_cpu" in r else "-"
        lines.append(
            first + f"{t1} | {a1} | {tw} | {_ranks(r['wall'])} | {_ranks(r['cpu'])} | "
            f"{eff[0]} | {eff[1]} | {scaling} | {_ranks(r['sent'], 2**20, '.3g')} | "
            f"{_ranks(r['peak'], 2**20, '.0f')} | "
            f"{r['t1_peak'] / r['world'] / 2**20:.0f} | {verdict}: {r['loss_diff']:.1e}, "
            f"{r['grad_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--batches", nargs="+", default=list(BATCHES), choices=BATCHES)
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--worlds", nargs="+", type=int, help="default 2 4 (--quick: 2)")
    p.add_argument("--seqlens", nargs="+", type=int, help="default 8192 32768 (--quick: 512)")
    p.add_argument("--reps", type=int, default=3, help="timed steps after the warm-up")
    p.add_argument("--step-limit", type=float, default=600.0,
                   help="seconds: a warm-up step slower than this gets no timed steps")
    p.add_argument("--memory-limit", type=float, default=12.0,
                   help="GiB of address space for all ranks together (+1 GiB each)")
    p.add_argument("--quick", action="store_true", help="hidden 64, S 512, W 2, 1 step (smoke)")
    p.add_argument("--ablate", action="store_true", help="mixers without the exchange")
    p.add_argument("--no-anchor", action="store_true", help="skip cpattn on one rank")
    p.add_argument("--out", help="write the markdown report here too")
    p.add_argument("--json", help="write every row, per-rank figures included, here")
    args = p.parse_args(argv)
    args.worlds = args.worlds or ([2] if args.quick else [2, 4])
    args.seqlens = args.seqlens or ([512] if args.quick else [8192, 32768])
    if args.quick:
        args.reps = 1
    rows = []
    for seqlen, model, batch, dtype in itertools.product(args.seqlens, args.models,
                                                         args.batches, args.dtypes):
        case = Case(model, batch, dtype, seqlen, args.reps, args.quick, args.ablate,
                    args.step_limit, args.memory_limit)
        # cpattn on one rank first: what it refuses there (a ValueError) it refuses at every W
        anchor = None if args.no_anchor else measure(case, 1, under_cp=True)
        refused = anchor is not None and "ValueError" in anchor.get("error", "")
        reference = anchor if refused else measure(dataclasses.replace(case, ablate=False), 1)
        for world in args.worlds:
            got = measure(case, world) if "error" not in reference else reference
            rows.append(summarise(case, world, reference, got, anchor))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    load = os.getloadavg()
    report = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_line()}"
              f", load {load[0]:.1f} at the end, torch "
              f"{torch.__version__}, 1 thread per process"
              f"{', ABLATION: mixers without the exchange' if args.ablate else ''}\n\n"
              f"{table(rows)}\n")
    print(report)
    for path, text in ((args.out, report), (args.json, json.dumps(rows, indent=1))):
        if path:
            with open(path, "w") as f:
                f.write(text)
    return rows


if __name__ == "__main__":
    main()
