"""Token mixers of hybrid models under context parallelism: one layer's forward + backward per
rank with cpattn (convolution halo + state scan) against one process on the whole sequence, an
all-to-all head split and gathering the whole sequence; bytes per layer; peak memory per rank.

    python bench/bench_mixers.py [--kinds gdn mamba2 conv lightning] [--worlds 2 4]
                                 [--seqlens 2048 4096 8192] [--reps 2] [--out FILE.md]
    python bench/bench_mixers.py --quick     # a smoke run (seconds)
    python bench/bench_mixers.py --packed --kinds gdn mamba2 --worlds 2 --seqlens 4096
                                             # + a packed log-normal batch of W * S_local tokens

Layers (transformers 5.24 classes, fp32, batch 1, the module's own parameters):
  gdn        Qwen3_5GatedDeltaNet, Qwen3.5 scaled down: hidden 512, 8 value / 4 key heads of 64
  mamba2     Mamba2Mixer: hidden 512, expand 2, 16 heads of 64, state 64, 4 groups
  conv       Lfm2ShortConv: hidden 512, kernel 3
  lightning  MiniMaxLightningAttention: hidden 512, 8 heads of 64
Method (1 thread throughout, as the ranks of the CI machine: W ranks would oversubscribe its 2
cores, so each rank's work is timed alone; times are the process's CPU time, which a loaded
machine disturbs far less than the wall clock):
  one        the layer on all W * S_local tokens in one process (cpattn's kernels; the module's
             own forward, transformers' torch path, in the column "own" for reference: one call
             without a warm-up, up to 16K tokens)
  alone      the rank's tokens as a sequence of their own (no halo, no scan): alone / rank is
             the share of the rank's time that is not cpattn's addition
  cpattn     one rank's work on its S_local zigzag tokens: the layer with the halo and the state
             scan (the exchange's result replaced by zeros of its shape: the same compute), the
             busiest rank (the one whose pieces all have neighbours)
  a2a        the head split: the layer with H / W heads (same hidden size: the projections' work
             per rank is that of S_local tokens) on all W * S_local tokens
  gather     the whole sequence on every rank (all-gather of the input, reduce-scatter back):
             the compute of "one"
  packed     (--packed) W * S_local tokens of log-normal documents (median 148 tokens, a few
             of thousands; seed 0) sharded by cpattn.shard_documents (zigzag, "balanced", as
             shard_batch for the ring: "plan") and every document over every rank (zigzag, as
             shard_batch for Ulysses: "per-document"): per rank, its tokens' layer with the halo
             and the scan (zeros for the exchange); "one" and "own" on the whole packed batch
Communication is modelled from the bytes each rank receives per layer (forward + backward) on
the cpu-gloo link of cpattn.plan (1 GB/s, 100 us per message; loopback TCP between 1-thread
ranks). Efficiency = T_one / (W * T_rank), with and without that communication.
Peak memory: bytes of the tensors the rank's forward + backward allocates on top of its inputs
(cpattn.memory.counting), against one process's / W.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import time

import torch

from cpattn.core.machine import cpu_model
from cpattn.memory import counting
from cpattn.mixers import build_piece_map, stacked
from cpattn.mixers.mixing import Mixing
from cpattn.plan.model import PRESETS

KINDS = ("gdn", "mamba2", "conv", "lightning")
OWN_UP_TO = 16384  # the module's own forward beyond this: skipped (transformers' torch path of
#                    the delta rule and Mamba-2 grows faster than linearly: minutes at 32K)
LINK = PRESETS["cpu-gloo"].intra


def layer(kind: str, split: int = 1, small: bool = False):
    """(module, class name, in width, out width, state bytes per row) for `kind`, its heads
    divided by `split` (the a2a baseline)."""
    import transformers as T
    from transformers.models.lfm2 import modeling_lfm2
    from transformers.models.mamba2 import modeling_mamba2
    from transformers.models.minimax import modeling_minimax
    from transformers.models.qwen3_5 import modeling_qwen3_5

    hidden = 128 if small else 512
    torch.manual_seed(0)
    if kind == "gdn":
        heads, dim = (4, 16) if small else (8, 64)
        cfg = T.Qwen3_5TextConfig(hidden_size=hidden, linear_num_value_heads=heads // split,
                                  linear_num_key_heads=max(1, heads // 2 // split),
                                  linear_key_head_dim=dim, linear_value_head_dim=dim,
                                  layer_types=["linear_attention"], num_hidden_layers=1)
        m = modeling_qwen3_5.Qwen3_5GatedDeltaNet(cfg, 0)
        width_in = m.conv_dim + m.value_dim + 2 * m.num_v_heads
        return m, "Qwen3_5GatedDeltaNet", width_in, m.value_dim
    if kind == "mamba2":
        heads, dim, state = (16, 16, 16) if small else (16, 64, 64)
        cfg = T.Mamba2Config(hidden_size=hidden, num_heads=heads, head_dim=dim,
                             state_size=state, n_groups=4, expand=2, chunk_size=64,
                             num_hidden_layers=1)
        # the split: H / W heads of the same size and groups / W (checked at init only)
        for field, value in (("num_heads", heads // split), ("n_groups", 4 // split),
                             ("expand", 2 / split)):
            object.__setattr__(cfg, field, value)
        m = modeling_mamba2.Mamba2Mixer(cfg, 0)
        return m, "Mamba2Mixer", m.intermediate_size + m.conv_dim + m.num_heads, \
            m.intermediate_size
    if kind == "conv":
        cfg = T.Lfm2Config(hidden_size=hidden, conv_L_cache=3, layer_types=["conv"],
                           num_hidden_layers=1)
        m = modeling_lfm2.Lfm2ShortConv(cfg, 0)
        return m, "Lfm2ShortConv", 3 * hidden, hidden
    if kind == "lightning":
        heads = 4 if small else 8
        cfg = T.MiniMaxConfig(hidden_size=hidden, num_attention_heads=heads // split,
                              head_dim=hidden // heads, layer_types=["linear_attention"],
                              num_hidden_layers=1, block_size=256)
        m = modeling_minimax.MiniMaxLightningAttention(cfg, 0)
        return m, "MiniMaxLightningAttention", 3 * heads // split * (hidden // heads) * 2, \
            heads // split * (hidden // heads)
    raise ValueError(kind)


def _call(kind, module, name, x, piece_map, rank, exchange, own: bool = False):
    from cpattn.integrations.hybrid.registry import adapter_of

    adapter = adapter_of(module)
    if own:  # (the class's own forward: parallelize changes instances, never the class)
        out = type(module).forward(module, x, **adapter.call)
    else:
        out = adapter.fn(module, x, Mixing(piece_map, rank, exchange, 1))
    return out[0] if isinstance(out, tuple) else out


def timed(fn, reps: int, warmup: bool = True) -> tuple[float, int]:
    """(median CPU seconds of fn() = forward + backward over `reps` calls after a warm-up, the
    peak bytes of the first timed call). CPU time of the process (1 thread): on a shared machine
    it moves much less than the wall clock with the other processes' load."""
    if warmup:
        fn()
    times, peak = [], 0
    for i in range(reps):
        with counting() if i == 0 else contextlib.nullcontext() as c:
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        if i == 0:
            peak = c.peak
    return statistics.median(times), peak


def fwd_bwd(kind, module, name, x, piece_map, rank, exchange, own=False):
    def run():
        module.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        out = _call(kind, module, name, xi, piece_map, rank, exchange, own)
        out.backward(torch.ones_like(out))
    return run


def zeros_exchange(world: int):
    """The exchange's result with every rank's entry zero: the compute of the real one."""
    return lambda t: torch.zeros((world, *t.shape), dtype=t.dtype)


def exchanged_bytes(piece_map, rank: int, width: int, conv: int, state: tuple) -> int:
    """Bytes rank receives per layer, forward + backward: the halo rows of the conv inputs and
    the summaries (M, S), from the W - 1 other ranks, each way."""
    from cpattn.mixers.pieces import PieceMap

    assert isinstance(piece_map, PieceMap)
    rows = len(piece_map.halo(rank, conv - 1)[0]) if conv > 1 else 0
    m_size, s_size = state
    per_rank = rows * width * 4 + piece_map.slots * (m_size + s_size) * 4
    return 2 * (piece_map.world - 1) * per_rank


def state_sizes(kind: str, module) -> tuple[int, int]:
    """(|M|, |S|) of one summary, in elements."""
    if kind == "gdn":
        k, v, h = module.head_k_dim, module.head_v_dim, module.num_v_heads
        return h * k * k, h * k * v
    if kind == "mamba2":
        return module.num_heads, module.num_heads * module.head_dim * module.ssm_state_size
    if kind == "lightning":
        d, h = module.head_dim, module.num_attention_heads
        return h, h * d * d
    return 0, 0


def conv_info(kind: str, module) -> tuple[int, int]:
    """(kernel size, channels) of the layer's convolution (1, 0: none)."""
    if kind == "lightning":
        return 1, 0
    conv = module.conv if kind == "conv" else module.conv1d
    return conv.kernel_size[0], conv.in_channels


def run(kind: str, world: int, local: int, reps: int, small: bool) -> dict:
    from cpattn.core.layout import shard_positions

    module, name, width_in, width_out = layer(kind, small=small)
    hidden = module.out_proj.out_features if hasattr(module, "out_proj") else module.hidden_size
    total = world * local
    gen = torch.Generator().manual_seed(0)
    x_all = torch.randn(1, total, hidden, generator=gen)
    one_piece_map = build_piece_map([torch.arange(total)], (0, total))
    t_one, mem_one = timed(fwd_bwd(kind, module, name, x_all, one_piece_map, 0, stacked), reps)
    t_own = timed(fwd_bwd(kind, module, name, x_all, one_piece_map, 0, stacked, own=True), 1,
                  warmup=False)[0] if total <= OWN_UP_TO else None  # (reference: one call)
    # The busiest zigzag rank: rank 1 (its two zigzag segments both have neighbours; rank W-1
    # for W = 2).
    indices = [shard_positions(total, "zigzag", world, r) for r in range(world)]
    piece_map = build_piece_map(indices, (0, total))
    rank = 1 if world > 2 else world - 1
    x_local = x_all[:, indices[rank]]
    t_rank, mem_rank = timed(fwd_bwd(kind, module, name, x_local, piece_map, rank,
                                     zeros_exchange(world)), reps)
    # The same tokens as a sequence of their own (no halo, no scan): what cpattn adds.
    alone = build_piece_map([torch.arange(local)], (0, local))
    t_alone, _ = timed(fwd_bwd(kind, module, name, x_local, alone, 0, stacked), reps)
    kernel, channels = conv_info(kind, module)
    nbytes = exchanged_bytes(piece_map, rank, channels, kernel, state_sizes(kind, module))
    messages = 2 * (2 if kernel > 1 else 1) * (world - 1)  # (gloo: one per peer per collective)
    comm = LINK.time(nbytes, messages)
    # The head split: H / W heads over the whole sequence (conv: its compute is all per token).
    if kind == "conv":
        t_a2a = t_one / world
    else:
        split, _, _, _ = layer(kind, split=world, small=small)
        t_a2a, _ = timed(fwd_bwd(kind, split, name, x_all, one_piece_map, 0, stacked), reps)
    a2a_bytes = 2 * 2 * (world - 1) * local * (width_in + width_out) * 4 // world
    a2a_comm = LINK.time(a2a_bytes, 2 * 2 * (world - 1))
    gather_bytes = 2 * (world - 1) * local * hidden * 4
    gather_comm = LINK.time(gather_bytes, 2 * (world - 1))
    return dict(kind=kind, world=world, local=local, t_one=t_one, t_own=t_own, t_rank=t_rank,
                t_alone=t_alone,
                comm=comm, bytes=nbytes, t_a2a=t_a2a, a2a_comm=a2a_comm, a2a_bytes=a2a_bytes,
                gather_comm=gather_comm, gather_bytes=gather_bytes, mem_one=mem_one,
                mem_rank=mem_rank)


def lognormal_lengths(total: int, seed: int = 0) -> list[int]:
    """Document lengths summing to `total`: log-normal (median 148, sigma 1.2), the last cut."""
    gen = torch.Generator().manual_seed(seed)
    lengths, left = [], total
    while left:
        n = min(left, max(1, int(torch.empty(1).log_normal_(5.0, 1.2, generator=gen))))
        lengths.append(n)
        left -= n
    return lengths


def run_packed(kind: str, world: int, local: int, reps: int, small: bool,
               sharding: str = "plan") -> dict:
    """The packed batch, sharded by a document plan ("plan") or every document over every rank
    ("per-document", cpattn.shard_varlen's zigzag): every rank's time and peak (the slowest
    rank's are reported)."""
    from cpattn.core.layout import document_positions
    from cpattn.sharding.documents import shard_documents

    module, name, _, _ = layer(kind, small=small)
    hidden = module.out_proj.out_features if hasattr(module, "out_proj") else module.hidden_size
    total = world * local
    lengths = lognormal_lengths(total)
    cu = torch.tensor([0, *lengths]).cumsum(0)
    bounds = tuple(cu.tolist())
    x_all = torch.randn(1, total, hidden, generator=torch.Generator().manual_seed(0))
    one_map = build_piece_map([torch.arange(total)], bounds)
    t_one, mem_one = timed(fwd_bwd(kind, module, name, x_all, one_map, 0, stacked), reps)
    t_own, mem_own = timed(fwd_bwd(kind, module, name, x_all, one_map, 0, stacked, own=True),
                           1, warmup=False) if total <= OWN_UP_TO else (None, None)
    if sharding == "plan":
        plan = shard_documents(cu, world_size=world, layout="zigzag", split="balanced")
        indices = [plan.positions(r)[0] for r in range(world)]
    else:
        indices = [document_positions(torch.tensor(lengths), "zigzag", world, r)[0]
                   for r in range(world)]
    piece_map = build_piece_map(indices, bounds)
    padded = torch.cat([x_all, x_all.new_zeros((1, 1, hidden))], 1)
    ranks = []
    for rank in range(world):
        x_local = padded[:, torch.where(indices[rank] < 0, total, indices[rank])]
        ranks.append(timed(fwd_bwd(kind, module, name, x_local, piece_map, rank,
                                   zeros_exchange(world)), reps))
    slowest = max(range(world), key=lambda r: ranks[r][0])
    return dict(kind=kind, world=world, local=local, t_one=t_one, t_own=t_own,
                t_rank=ranks[slowest][0], mem_rank=max(m for _, m in ranks), mem_one=mem_one,
                mem_own=mem_own,
                documents=len(lengths), pieces=[len(p) for p in piece_map.pieces],
                sharding=sharding)


def packed_table(rows: list[dict]) -> str:
    head = ("| layer | W | tokens | documents | sharding | pieces per rank | one (own) s | "
            "slowest rank s | eff. vs one | eff. vs own | peak MiB rank | one / W | own / W |")
    lines = [head, "|---|---|--:|--:|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        w = r["world"]
        own = "-" if r["t_own"] is None else f"{r['t_own']:.3f}"
        eff_own = "-" if r["t_own"] is None else f"{r['t_own'] / (w * r['t_rank']):.2f}"
        mem_own = "-" if r["mem_own"] is None else f"{r['mem_own'] / w / 2**20:.0f}"
        lines.append(
            f"| {r['kind']} | {w} | {w * r['local']} | {r['documents']} | {r['sharding']} | "
            f"{r['pieces']} | "
            f"{r['t_one']:.3f} ({own}) | {r['t_rank']:.3f} | "
            f"{r['t_one'] / (w * r['t_rank']):.2f} | {eff_own} | {r['mem_rank'] / 2**20:.0f} | "
            f"{r['mem_one'] / w / 2**20:.0f} | {mem_own} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    head = ("| layer | W | S_local | one (own) s | cpattn rank s | alone / rank | "
            "eff. compute | eff. +comm | a2a eff. +comm | gather eff. +comm | "
            "bytes/layer cpattn | a2a | gather | peak MiB rank | one / W |")
    lines = [head, "|" + "---|" * 2 + "--:|" * 13]
    for r in rows:
        w = r["world"]
        eff = r["t_one"] / (w * r["t_rank"])
        eff_comm = r["t_one"] / (w * (r["t_rank"] + r["comm"]))
        a2a = r["t_one"] / (w * (r["t_a2a"] + r["a2a_comm"]))
        gather = r["t_one"] / (w * (r["t_one"] + r["gather_comm"]))
        own = "-" if r["t_own"] is None else f"{r['t_own']:.3f}"
        lines.append(
            f"| {r['kind']} | {w} | {r['local']} | {r['t_one']:.3f} ({own}) | "
            f"{r['t_rank']:.3f} | {r['t_alone'] / r['t_rank']:.2f} | {eff:.2f} | "
            f"{eff_comm:.2f} | {a2a:.2f} | {gather:.2f} | "
            f"{r['bytes'] / 2**20:.2f} MiB | {r['a2a_bytes'] / 2**20:.1f} MiB | "
            f"{r['gather_bytes'] / 2**20:.1f} MiB | {r['mem_rank'] / 2**20:.0f} | "
            f"{r['mem_one'] / w / 2**20:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--worlds", nargs="+", type=int, default=[2, 4])
    p.add_argument("--seqlens", nargs="+", type=int, default=[2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="small layers and lengths (smoke run)")
    p.add_argument("--packed", action="store_true", help="also a packed log-normal batch")
    p.add_argument("--packed-only", action="store_true", help="only the packed batch")
    p.add_argument("--out", help="write the markdown report here too")
    args = p.parse_args(argv)
    import cpattn.integrations.hybrid.adapters  # noqa: F401 - registers the adapters
    torch.set_num_threads(1)
    if args.quick:
        args.seqlens, args.worlds, args.reps = [128], [2], 1
    rows, packed = [], []
    for kind in args.kinds:
        for world in args.worlds:
            for local in args.seqlens:
                if not args.packed_only:
                    rows.append(run(kind, world, local, args.reps, args.quick))
                    print(table(rows[-1:]).splitlines()[-1], flush=True)
                for sharding in ("plan", "per-document") if args.packed or args.packed_only \
                        else ():
                    packed.append(run_packed(kind, world, local, args.reps, args.quick,
                                             sharding))
                    print(packed_table(packed[-1:]).splitlines()[-1], flush=True)
    report = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"{cpu_model()}, torch {torch.__version__}, 1 thread\n\n"
              + (f"{table(rows)}\n" if rows else "")
              + (f"\npacked:\n\n{packed_table(packed)}\n" if packed else ""))
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    main()
