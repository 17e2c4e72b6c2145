"""Mamba (MambaMixer) and Kimi delta attention (KimiLinearDeltaAttention) layers: one rank's
forward + backward with cpattn and its peak memory (run it on two checkouts to compare them).

    python bench/bench_mixer_kinds.py [--kinds mamba kda] [--seqlens 1024 2048] [--reps 2]

Layers (transformers 5.24 classes, fp32, batch 1, hidden 512): mamba: MambaMixer, expand 2,
state 16; kda: KimiLinearDeltaAttention, 8 heads of 64. The rank: the second half of a sequence
of 2 S_local tokens split contiguously over W = 2 (its piece has an entry state: the linked
path, the exchange replaced by zeros of its shape). CPU time of the process (median), 1 thread;
peak: cpattn.memory.counting of one more call.
"""

from __future__ import annotations

import argparse
import time

import torch

from cpattn.core.machine import cpu_model
from cpattn.memory import counting
from cpattn.mixers import build_piece_map
from cpattn.mixers.mixing import Mixing


def layer(kind: str):
    import transformers as T

    torch.manual_seed(0)
    if kind == "mamba":
        from transformers.models.mamba.modeling_mamba import MambaMixer

        cfg = T.MambaConfig(hidden_size=512, state_size=16, expand=2, num_hidden_layers=1)
        return MambaMixer(cfg, 0), "MambaMixer"
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = T.KimiLinearConfig(hidden_size=512, linear_num_heads=8, linear_head_dim=64,
                             num_hidden_layers=1, layer_types=["linear_attention"],
                             linear_conv_kernel_dim=4, num_attention_heads=8,
                             num_key_value_heads=8, kv_lora_rank=16, q_lora_rank=None,
                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    return KimiLinearDeltaAttention(cfg, 0), "KimiLinearDeltaAttention"


def measure(fn, reps: int) -> tuple[float, int]:
    fn()
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    with counting() as c:
        fn()
    return sorted(times)[len(times) // 2], c.peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=["mamba", "kda"], choices=["mamba", "kda"])
    p.add_argument("--seqlens", nargs="+", type=int, default=[1024, 2048])
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args(argv)
    import cpattn.integrations.hybrid.adapters  # noqa: F401 - registers the adapters
    from cpattn.integrations.hybrid.registry import adapter_of

    torch.set_num_threads(1)
    print(f"{cpu_model()}, torch {torch.__version__}, 1 thread\n", flush=True)
    print("| layer | S_local | cpattn rank s | peak MiB rank |\n|---|--:|--:|--:|", flush=True)
    for kind in args.kinds:
        module, _ = layer(kind)
        adapter = adapter_of(module)
        for local in args.seqlens:
            x = torch.randn(1, 2 * local, 512, generator=torch.Generator().manual_seed(0))
            halves = [torch.arange(local), torch.arange(local, 2 * local)]
            piece_map = build_piece_map(halves, (0, 2 * local))
            mix = Mixing(piece_map, 1, lambda t: torch.zeros((2, *t.shape), dtype=t.dtype), 1)

            def step(forward):
                def run():
                    module.zero_grad(set_to_none=True)
                    xi = x[:, local:].detach().requires_grad_(True)
                    out = forward(xi)
                    out = out[0] if isinstance(out, tuple) else out
                    out.backward(torch.ones_like(out))
                return run

            t_rank, m_rank = measure(step(lambda h: adapter.fn(module, h, mix)), args.reps)
            print(f"| {kind} | {local} | {t_rank:.3f} | {m_rank / 2**20:.0f} |", flush=True)


if __name__ == "__main__":
    main()
