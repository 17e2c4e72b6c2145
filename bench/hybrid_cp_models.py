"""What bench/bench_hybrid_cp.py measures (and bench/gpu_hybrid.py reuses): the models, the
batches, how a user makes a model context-parallel, the bytes a rank's sockets send, the
ablation, the CPU's name. See bench_hybrid_cp.py's docstring for the method."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import subprocess
import time
from typing import Optional

import torch
import torch.distributed as dist

MODELS = ("gdn", "mamba2")


def config(model: str, small: bool = False):
    """The transformers config of `model` (bench_hybrid_cp.py's docstring; small: hidden 64)."""
    import transformers as T

    hidden = 64 if small else 512
    common = dict(vocab_size=256, hidden_size=hidden, num_hidden_layers=2, use_cache=False,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  num_attention_heads=8, num_key_value_heads=2)
    if model == "gdn":
        heads, dim = (4, 16) if small else (8, 64)
        return T.Qwen3_5TextConfig(**common, intermediate_size=2 * hidden, head_dim=dim,
                                   layer_types=["linear_attention"] * 2,
                                   linear_num_value_heads=heads, linear_num_key_heads=heads // 2,
                                   linear_key_head_dim=dim, linear_value_head_dim=dim)
    if model == "mamba2":
        heads, dim, state, groups = (8, 16, 16, 2) if small else (16, 64, 64, 4)
        return T.NemotronHConfig(**common, layers_block_type=["mamba"] * 2, head_dim=dim,
                                 mamba_num_heads=heads, mamba_head_dim=dim, n_groups=groups,
                                 ssm_state_size=state, chunk_size=64, expand=2)
    raise ValueError(f"bench_hybrid_cp.config: model must be one of {MODELS}, got {model!r}")


def build(cfg, attn_implementation: str = "eager") -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation,
                                             dtype=torch.float32)
    return model.train()


def cp_model(cfg, cp) -> torch.nn.Module:
    """The model under cp, as a user makes it: built, then `parallelize(model, cp)` (cpattn's
    way onto models with token mixers, issue 55)."""
    from cpattn.integrations.transformers import parallelize

    model = build(cfg)
    parallelize(model, cp)
    return model


def document_lengths(total: int, seed: int = 0, median: float = 128.0, sigma: float = 1.5,
                     shortest: int = 8) -> list[int]:
    """Log-normal document lengths filling `total` tokens (the last one cut to fit)."""
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(median * math.exp(sigma * float(torch.randn((), generator=gen))))
        lengths.append(min(max(n, shortest), total - sum(lengths)))
    return lengths


def make_batch(batch: str, seqlen: int) -> tuple[dict, Optional[list[int]]]:
    """(the full batch "one" or "packed" of seqlen tokens, its document lengths or None)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (1, seqlen), generator=gen)
    if batch == "one":
        return {"input_ids": ids, "labels": ids.clone()}, None
    from transformers import DataCollatorWithFlattening

    lengths = document_lengths(seqlen, median=min(128.0, seqlen / 16))
    docs = [{"input_ids": part.tolist()} for part in ids[0].split(lengths)]
    return dict(DataCollatorWithFlattening()(docs)), lengths


def sockets(known: tuple = ()) -> Optional[dict[str, int]]:
    """Bytes sent so far by each TCP socket of this process, by its addresses (ss's tcp_info);
    None without ss. ss now and then misses a socket's owner: read again (5 times at most) until
    every socket in `known` is there."""
    if shutil.which("ss") is None:
        return None
    for _ in range(5):
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True).stdout
        sent: dict[str, int] = {}
        key = None
        for line in out.splitlines():
            if line and not line[0].isspace():  # a socket (state, queues, local, peer, process)
                key = " ".join(line.split()[3:5]) if f"pid={os.getpid()}," in line else None
                if key is not None:
                    sent[key] = 0
            if key is not None:  # (its tcp_info follows, on the indented line(s) after it)
                sent[key] += sum(int(b) for b in re.findall(r"\bbytes_sent:(\d+)", line))
        if set(known) <= set(sent):
            break
        time.sleep(0.05)
    return sent


def sent_between(before: Optional[dict], after: Optional[dict]) -> Optional[int]:
    """Bytes sent between two sockets() readings (and by any socket opened in between); None
    when a socket of the first is missing from the second (not seen: unknown)."""
    if before is None or after is None or not set(before) <= set(after):
        return None
    return sum(n - before.get(key, 0) for key, n in after.items())


@contextlib.contextmanager
def mixers_alone():
    """The ablation: every rank's mixers see zeros for the other ranks' halos and summaries."""
    from cpattn.mixers import sharded

    real = sharded.group_exchange
    sharded.group_exchange = lambda groups: (
        lambda x: x.new_zeros((math.prod(dist.get_world_size(g) for g in groups), *x.shape)))
    try:
        yield
    finally:
        sharded.group_exchange = real


def cpu_line() -> str:
    """The CPU: its model, the flags that pick torch's bf16 kernels, its core count."""
    from cpattn.core.machine import cpu_model

    with open("/proc/cpuinfo") as f:
        flags = next((line.split() for line in f if line.startswith("flags")), [])
    wanted = ("avx512f", "avx512_bf16", "amx_tile")
    have = [flag if flag in flags else f"no {flag}" for flag in wanted]
    return f"{cpu_model()} ({', '.join(have)}), {os.cpu_count()} cores"
