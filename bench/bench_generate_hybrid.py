"""Generation of a Qwen3.5-shaped hybrid model through ContextParallelCache on CPU ranks (gloo):
the prefill of one long prompt and the decode steps after it, at W = 2 against one process.

    python bench/bench_generate_hybrid.py [--lengths 8192 16384 32768] [--steps 16] [--out FILE]

The model (random weights, fp32, batch 1): Qwen3.5's layer pattern, three gated-delta-rule layers
then one full-attention layer, hidden 256, GDN 8 value heads / 4 key heads of 32, attention 4
heads / 2 KV heads of 64, MLP 512, vocab 1024. Rows:

- "one process": transformers 5.24's own forward and DynamicCache (its torch paths), 1 and 2
  threads (the 2 cores the W = 2 ranks share);
- "cpattn W = 1": ContextParallelCache over a group of one rank (the adapters, no exchange);
- "cpattn W = 2": ContextParallelCache over 2 ranks, 1 thread each (parallelize(model, cp)).

Prefill: one model call over the prompt with the cache (`logits_to_keep=1`, as generate), wall
seconds and the process's CPU seconds (every thread; the machine may be shared), the most of any
rank, median of `--reps`. Decode: `--steps` one-token steps after it, tokens / s
(median step). Bytes: what this rank wrote to its gloo sockets during the call (the /proc/self/io
wchar delta, max over ranks: the ring's K/V, the mixers' halo, summaries, outputs, hand-off and
every agreement check), per prefill and per decode step. "logits vs one": the largest relative
difference of the prefill's last logits from the one-process ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpattn.testing.distributed import run_ranks  # noqa: E402


def _config():
    import transformers as T

    return T.Qwen3_5TextConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, max_position_embeddings=65536,
        tie_word_embeddings=False, pad_token_id=0, use_cache=True)


def _model(attn: str):
    from transformers import AutoModelForCausalLM

    # Seed 2: with seeds 0 and 1, parallelize's probe refuses some gated delta rule layers of
    # this shape (the A_log gradient 1.05e-4 to 1.45e-4 of its largest from the module's own, over
    # the fp32 tolerance of 1e-4; seeds 2 to 5 pass): a known limit of the probe's tolerance.
    torch.manual_seed(2)
    return AutoModelForCausalLM.from_config(_config(), attn_implementation=attn).eval()


def _wchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _measured(fn, group) -> tuple[float, float, int, object]:
    """(wall seconds, process CPU seconds, bytes written, result) of fn(), between barriers."""
    if group is not None:
        dist.barrier(group=group)
    written, start, cpu = _wchar(), time.perf_counter(), time.process_time()
    out = fn()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return seconds, cpu, _wchar() - written, out


def _run(rank: int, world: int, mode: str, length: int, steps: int, reps: int) -> dict:
    """One configuration: prefill `reps` times (fresh caches), then `steps` decode steps."""
    import cpattn
    from cpattn.integrations.transformers import ContextParallelCache, parallelize

    prompt = torch.randint(5, 1024, (1, length), generator=torch.Generator().manual_seed(1))
    group = None
    if mode == "one":
        model = _model("sdpa")

        def new_cache():
            from transformers import DynamicCache

            return DynamicCache(config=model.config)
    else:
        group = dist.new_group(list(range(world)))
        cp = cpattn.ContextParallel(group)
        model = _model("eager")
        parallelize(model, cp)

        def new_cache():
            return ContextParallelCache(cp, model.config, capacity=length + steps + 1)

    prefills, prefill_cpu, written, logits = [], [], 0, None
    with torch.no_grad():
        warm = new_cache()  # (one-time costs out of the timings)
        model(input_ids=prompt[:, :64], cache=warm, use_cache=True, logits_to_keep=1)
        model(input_ids=prompt[:, 64:65], cache=warm, use_cache=True)
        for _ in range(reps):
            cache = new_cache()
            seconds, cpu, written, out = _measured(
                lambda: model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1),
                group)
            prefills.append(seconds)
            prefill_cpu.append(cpu)
            logits = out.logits[0, -1]
        token = logits.argmax().reshape(1, 1)
        decode, decode_bytes = [], []
        for _ in range(steps):
            seconds, _, sent, out = _measured(
                lambda: model(input_ids=token, cache=cache, use_cache=True), group)
            decode.append(seconds)
            decode_bytes.append(sent)
            token = out.logits[0, -1].argmax().reshape(1, 1)
    return {"prefill": statistics.median(prefills), "prefill_cpu": statistics.median(prefill_cpu),
            "prefill_bytes": written,
            "step": statistics.median(decode), "step_bytes": statistics.median(decode_bytes),
            "logits": logits.tolist()}


def _row(mode: str, world: int, threads: int, length: int, args) -> dict:
    ranks = run_ranks(world, _run, "one" if mode == "one" else "cpattn", length, args.steps,
                      args.reps, threads=threads, poison=False)
    return {"prefill": max(r["prefill"] for r in ranks),
            "prefill_cpu": max(r["prefill_cpu"] for r in ranks),
            "prefill_bytes": max(r["prefill_bytes"] for r in ranks),
            "step": max(r["step"] for r in ranks),
            "step_bytes": max(r["step_bytes"] for r in ranks),
            "logits": torch.tensor(ranks[0]["logits"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from cpattn.core.machine import cpu_model

    lines = [f"CPU: {cpu_model()}; torch {torch.__version__}; "
             f"steps {args.steps}, prefill reps {args.reps}", "",
             "| prompt | run | prefill s | vs one (1 thr) | vs one (2 thr) | prefill CPU s "
             "| prefill MiB sent | decode tok/s | decode KiB sent / step | logits vs one |",
             "|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for length in args.lengths:
        rows = {"one process, 1 thread": _row("one", 1, 1, length, args),
                "one process, 2 threads": _row("one", 1, 2, length, args),
                "cpattn W = 1": _row("cpattn", 1, 1, length, args),
                "cpattn W = 2 (1 thread each)": _row("cpattn", 2, 1, length, args)}
        one, two = rows["one process, 1 thread"], rows["one process, 2 threads"]
        for name, r in rows.items():
            diff = float((r["logits"] - one["logits"]).abs().max() / one["logits"].abs().max())
            lines.append(
                f"| {length} | {name} | {r['prefill']:.2f} | {one['prefill'] / r['prefill']:.2f}x "
                f"| {two['prefill'] / r['prefill']:.2f}x | {r['prefill_cpu']:.2f} "
                f"| {r['prefill_bytes'] / 2**20:.2f} "
                f"| {1 / r['step']:.1f} | {r['step_bytes'] / 2**10:.2f} | {diff:.1e} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
