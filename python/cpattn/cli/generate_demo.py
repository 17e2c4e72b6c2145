"""`python -m cpattn generate-demo`: greedy generation with a tiny decoder-only transformer (random
weights defined here, nothing downloaded) on W CPU ranks with a sharded KV cache, checked token for
token against single-process generation with a full cache.

Sharded path, per sequence: the prompt's leading multiple of the layout granularity is prefilled in
ring chunks (cpattn.prefill_attention, several chunks: chunked prefill); the remaining few tokens
and every generated token go through cpattn.decode_attention (K/V appended to the cache first).
The reference path is independent: plain torch attention over a full per-sequence cache.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cpattn.core.layout import granularity as layout_granularity
from cpattn.testing.distributed import run_ranks

DEFAULT_PROMPT_LENS = (29, 3, 50, 17)


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 128
    layers: int = 2
    heads: int = 12  # divisible by W = 1..4, for comm="reduce_scatter"
    kv_heads: int = 4  # GQA
    head_dim: int = 8
    mlp: int = 192
    max_len: int = 128  # KV cache capacity per sequence
    logit_scale: float = 8.0  # wide logit gaps: fp32 rounding cannot flip a greedy choice
    seed: int = 0

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim


# attend(layer, q, k, v) -> the attention block's output after the output projection, (B, S, dim)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class TinyDecoder:
    """Pre-norm decoder: RMSNorm, GQA attention with RoPE on global positions, GELU MLP."""

    def __init__(self, cfg: TinyConfig = TinyConfig()) -> None:
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)

        def w(*shape: int, fan_in: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / math.sqrt(fan_in)

        d, hd = cfg.dim, cfg.head_dim
        self.embed = torch.randn(cfg.vocab, d, generator=g)
        self.blocks = [
            {
                "wq": w(d, cfg.heads * hd, fan_in=d),
                "wk": w(d, cfg.kv_heads * hd, fan_in=d),
                "wv": w(d, cfg.kv_heads * hd, fan_in=d),
                "wo": w(cfg.heads * hd, d, fan_in=cfg.heads * hd),
                "w1": w(d, cfg.mlp, fan_in=d),
                "w2": w(cfg.mlp, d, fan_in=cfg.mlp),
            }
            for _ in range(cfg.layers)
        ]
        self.unembed = w(d, cfg.vocab, fan_in=d) * cfg.logit_scale

    @staticmethod
    def _norm(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x (B, S, heads, hd) rotated by angles of the global positions pos (B, S)."""
        half = self.cfg.head_dim // 2
        freq = 10000.0 ** (-torch.arange(half, dtype=torch.float32) / half)
        angle = pos[..., None].float() * freq  # (B, S, half)
        cos, sin = angle.cos()[:, :, None], angle.sin()[:, :, None]
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def project(self, layer: int, attn: torch.Tensor, heads: slice = slice(None)) -> torch.Tensor:
        """Output projection of attention outputs (B, S, n_heads, hd) for the given query heads
        (a slice: tensor parallelism over heads sums the slices' projections)."""
        hd = self.cfg.head_dim
        wo = self.blocks[layer]["wo"].view(self.cfg.heads, hd, -1)[heads]
        return attn.flatten(2) @ wo.flatten(0, 1)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, attend: Attend) -> torch.Tensor:
        """Hidden states (B, S, dim) after the last block; tokens and pos (B, S)."""
        cfg = self.cfg
        x = self.embed[tokens]
        for i, blk in enumerate(self.blocks):
            h = self._norm(x)
            b, s = tokens.shape
            q = self._rope((h @ blk["wq"]).view(b, s, cfg.heads, cfg.head_dim), pos)
            k = self._rope((h @ blk["wk"]).view(b, s, cfg.kv_heads, cfg.head_dim), pos)
            v = (h @ blk["wv"]).view(b, s, cfg.kv_heads, cfg.head_dim)
            x = x + attend(i, q.contiguous(), k.contiguous(), v.contiguous())
            x = x + torch.nn.functional.gelu(self._norm(x) @ blk["w1"]) @ blk["w2"]
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._norm(hidden) @ self.unembed


def make_prompts(lengths, vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ---------------------------------------------------------------------------------------------
# Single process, full cache (the reference)


def generate_reference(model: TinyDecoder, prompts: list[list[int]], steps: int):
    """Greedy generation one sequence at a time with a plain full KV cache. Returns the generated
    tokens and the smallest gap between the best and second-best logit over all choices."""
    cfg = model.cfg
    scale = 1.0 / math.sqrt(cfg.head_dim)
    results, min_gap = [], math.inf
    for prompt in prompts:
        cache_k: list[torch.Tensor] = [torch.empty(1, 0, cfg.kv_heads, cfg.head_dim)] * cfg.layers
        cache_v = list(cache_k)

        def attend(layer: int, q, k, v) -> torch.Tensor:
            cache_k[layer] = torch.cat([cache_k[layer], k], 1)
            cache_v[layer] = torch.cat([cache_v[layer], v], 1)
            keys = cache_k[layer].repeat_interleave(cfg.heads // cfg.kv_heads, 2)
            vals = cache_v[layer].repeat_interleave(cfg.heads // cfg.kv_heads, 2)
            s = torch.einsum("bqhd,bkhd->bhqk", q, keys) * scale
            n_new, n_all = q.shape[1], keys.shape[1]
            i = torch.arange(n_new)[:, None] + (n_all - n_new)
            s = s.masked_fill(torch.arange(n_all)[None, :] > i, -math.inf)
            return model.project(layer, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vals))

        tokens = torch.tensor([prompt])
        x = model.forward(tokens, torch.arange(len(prompt))[None], attend)
        generated = []
        for _ in range(steps):
            logits = model.logits(x[:, -1])[0]
            top = logits.topk(2).values
            min_gap = min(min_gap, (top[0] - top[1]).item())
            generated.append(int(logits.argmax()))
            pos = torch.tensor([[len(prompt) + len(generated) - 1]])
            x = model.forward(torch.tensor([[generated[-1]]]), pos, attend)
        results.append(generated)
    return results, min_gap


# ---------------------------------------------------------------------------------------------
# W ranks, sharded cache


def generate_sharded(
    model: TinyDecoder,
    prompts: list[list[int]],
    steps: int,
    *,
    interleave: int,
    layout: str = "zigzag",
    comm: str = "all_gather",
    chunk_blocks: int = 2,
    group=None,
) -> list[list[int]]:
    """Greedy generation on the ranks of `group`; every rank returns the same tokens.

    Prompts are prefilled one sequence at a time (through cache.sequences), in ring chunks of
    chunk_blocks * (layout granularity) tokens, then decoded together as one batch.
    """
    import cpattn

    cfg = model.cfg
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    caches = [
        cpattn.KVCacheShard(len(prompts), cfg.max_len, cfg.kv_heads, cfg.head_dim,
                            interleave=interleave, group=group)
        for _ in range(cfg.layers)
    ]
    heads = slice(rank * cfg.heads // world, (rank + 1) * cfg.heads // world)

    def replicated(layer_caches: list) -> Attend:
        def attend(layer: int, q, k, v) -> torch.Tensor:
            layer_caches[layer].append(k, v)
            out = cpattn.decode_attention(q, layer_caches[layer], group=group, comm=comm)
            if comm == "all_gather":
                return model.project(layer, out)
            part = model.project(layer, out, heads)  # tensor-parallel output projection
            dist.all_reduce(part, group=group)
            return part

        return attend

    def ring(layer_caches: list) -> Attend:
        def attend(layer: int, q, k, v) -> torch.Tensor:
            out = cpattn.prefill_attention(q, k, v, layer_caches[layer], group=group,
                                           layout=layout)
            return model.project(layer, out)

        return attend

    granularity = layout_granularity(layout, world)
    last = torch.empty(len(prompts), cfg.vocab)
    for b, prompt in enumerate(prompts):
        views = [c.sequences(b, b + 1) for c in caches]
        tokens = torch.tensor([prompt])
        main = len(prompt) // granularity * granularity
        done = 0
        while done < main:
            size = min(chunk_blocks * granularity, main - done)
            pos = cpattn.chunk_positions(views[0], size, layout=layout, group=group)
            local = cpattn.positions(size, layout=layout, group=group)
            x = model.forward(tokens[:, done:][:, local], pos, ring(views))
            done += size
            if done == len(prompt):
                full = cpattn.unshard(x, layout=layout, group=group)
                last[b] = model.logits(full[:, -1])[0]
        if done < len(prompt):  # the tail: replicated tokens, Sq = len(tail) > 1 is fine
            pos = views[0].lengths[:, None] + torch.arange(len(prompt) - done)
            x = model.forward(tokens[:, done:], pos, replicated(views))
            last[b] = model.logits(x[:, -1])[0]

    generated = [[] for _ in prompts]
    for _ in range(steps):
        nxt = last.argmax(-1)
        for b, t in enumerate(nxt.tolist()):
            generated[b].append(t)
        pos = caches[0].lengths[:, None].clone()
        x = model.forward(nxt[:, None], pos, replicated(caches))
        last = model.logits(x[:, -1])
    return generated


# ---------------------------------------------------------------------------------------------
# CLI


def _rank_main(rank: int, world: int, args) -> list:
    """Every (interleave, comm) run on this rank: (interleave, comm, tokens, seconds)."""
    model = TinyDecoder()
    prompts = make_prompts(args.prompt_lens, model.cfg.vocab)
    runs = []
    for interleave in args.interleave:
        for comm in args.comm:
            start = time.perf_counter()
            tokens = generate_sharded(model, prompts, args.new_tokens, interleave=interleave,
                                      layout=args.layout, comm=comm)
            runs.append((interleave, comm, tokens, time.perf_counter() - start))
    return runs


def generate_demo(args: argparse.Namespace) -> int:
    import cpattn

    model = TinyDecoder()
    cfg = model.cfg
    prompts = make_prompts(args.prompt_lens, cfg.vocab)
    print(f"cpattn {cpattn.__version__}: greedy generation, tiny decoder ({cfg.layers} layers, "
          f"{cfg.heads} heads / {cfg.kv_heads} kv heads, head_dim {cfg.head_dim}, vocab "
          f"{cfg.vocab}, random weights), batch of {len(prompts)} prompts of lengths "
          f"{list(args.prompt_lens)}, {args.new_tokens} new tokens each")
    reference, gap = generate_reference(model, prompts, args.new_tokens)
    print(f"single process, full cache: done (smallest top-1 / top-2 logit gap {gap:.3f})")
    ok = True
    for world in args.world:
        runs = run_ranks(world, _rank_main, args, poison=False)[0]
        for interleave, comm, tokens, seconds in runs:
            same = tokens == reference
            ok &= same
            print(f"W={world} interleave={interleave:<3} comm={comm:<14} layout={args.layout}: "
                  f"{'identical' if same else 'DIFFERENT'} tokens ({seconds:.2f} s)")
            if not same or args.verbose:
                for b, (got, want) in enumerate(zip(tokens, reference)):
                    print(f"  sequence {b}: sharded {got}\n  {'':11}reference {want}")
    print("OK: every run generated exactly the single-process tokens" if ok else "FAILED")
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world", type=int, nargs="+", default=[1, 2, 3, 4], help="ranks to spawn")
    p.add_argument("--interleave", type=int, nargs="+", default=[1, 16])
    p.add_argument("--comm", nargs="+", choices=["all_gather", "reduce_scatter"],
                   default=["all_gather", "reduce_scatter"])
    p.add_argument("--layout", choices=["zigzag", "contiguous", "striped"], default="zigzag")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=list(DEFAULT_PROMPT_LENS))
    p.add_argument("--new-tokens", type=int, default=12)
    p.add_argument("--verbose", action="store_true", help="print the tokens of every run")
