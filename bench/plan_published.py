"""The cost model's ring efficiency for configurations with published measurements (no ranks
needed; the machines are cpattn.plan's published/nominal presets).

    python bench/plan_published.py [--out FILE.md]

Ring efficiency = (the local kernel's time on the whole problem / W) / the ring's time, the
figure both sources report.
  1. zhuzilin/ring-flash-attention README (commit 01c8baf): zigzag ring on 8 GPUs with NVLink,
     Llama-3.1-8B attention (32 heads, 8 KV heads, head dim 128, bf16, causal), 8K tokens per GPU:
     fwd 85.2 % and fwd+bwd 90.2 % on 8xH800, 81.7 % and 89.8 % on 8xA100.
  2. Yang et al., "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783):
     Llama3 405B prefill of 1M tokens on 16 nodes x 8 H100 (TP8 in a node, ring CP across
     nodes over RDMA), 93 % parallelization efficiency (whole model, not attention alone).
"""

import argparse
import dataclasses

from cpattn import plan as P


def efficiency(p: P.Problem, m: P.Machine, world: int, name: str = "ring/zigzag") -> float:
    preds = {r.name: r for r in P.predict(p, m, world)}
    return preds["none"].time / world / preds[name].time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    # H800: the H100 die with NVLink cut to 400 GB/s (200 GB/s per direction), published.
    h800 = dataclasses.replace(P.PRESETS["h100-ib"], name="h800",
                               intra=P.Link(200e9, P.PRESETS["h100-ib"].intra.latency))
    a100 = P.PRESETS["a100-ib"]
    lines = ["| configuration | mode | tokens per GPU | predicted ring efficiency | published |",
             "|---|---|---|---|---|"]
    published = {("8xH800", "forward"): "85.2 %", ("8xH800", "train"): "90.2 %",
                 ("8xA100", "forward"): "81.7 %", ("8xA100", "train"): "89.8 %"}
    for gpu, m in (("8xH800", h800), ("8xA100", a100)):
        for mode in ("forward", "train"):
            for per_gpu in (8192, 32768, 131072):
                p = P.Problem(8 * per_gpu, 32, 8, 128, causal=True, mode=mode)
                pub = published[(gpu, mode)] if per_gpu == 8192 else "-"
                lines.append(f"| zigzag ring, {gpu} NVLink, Llama-3.1-8B attention | {mode} | "
                             f"{per_gpu // 1024}K | {100 * efficiency(p, m, 8):.1f} % | {pub} |")
    # 405B with TP8 inside a node: each GPU holds 128 / 8 = 16 query heads and 1 KV head; the
    # ring runs across nodes (one rank per node in the ring: ranks_per_node = 1).
    cross = dataclasses.replace(P.PRESETS["h100-ib"], ranks_per_node=1)
    for nodes in (2, 4, 8, 16):
        p = P.Problem(1 << 20, 16, 1, 128, causal=True, mode="forward")
        pub = "93 % (whole model)" if nodes == 16 else "-"
        lines.append(f"| 1M-token prefill, Llama3 405B (TP8 per node), {nodes} nodes x 8 H100, "
                     f"IB NDR | forward | {1024 // nodes}K | "
                     f"{100 * efficiency(p, cross, nodes):.1f} % | {pub} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
