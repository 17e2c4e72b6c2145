"""Who trains with whom: the (dp, cp) mesh of `context_parallel`, this rank's data-parallel
replica, and the TrainingArguments' view of the ranks (a CPU machine under torchrun)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from cpattn.parallel import ContextParallel
from cpattn.strategies.registry import STRATEGIES

WHAT = "cpattn.integrations.trainer"


def context_parallel(cp_size: int, strategy: str = "ring", *, ulysses_size: Optional[int] = None,
                     **options) -> ContextParallel:
    """ContextParallel settings for a trainer: the W ranks form W / cp_size data-parallel
    replicas, each a context-parallel group of cp_size consecutive ranks (a (dp, cp) device
    mesh, cp innermost, so that a group stays inside a node). strategy "hybrid" needs
    ulysses_size (dividing cp_size): the group is a (ring, Ulysses) grid of cp_size /
    ulysses_size x ulysses_size ranks. options: ContextParallel's (layout, timeout, ...).
    Needs torch.distributed started (TrainingArguments starts it under torchrun); call it on
    every rank, once, and give it to the trainer (which attaches it to the model)."""
    from torch.distributed.device_mesh import init_device_mesh

    what = f"{WHAT}.context_parallel"
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"{what}: torch.distributed is not started: create the "
                         "TrainingArguments first (under torchrun or accelerate launch they "
                         "start it), or call torch.distributed.init_process_group")
    world = dist.get_world_size()
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1 or (
            world % cp_size):
        raise ValueError(f"{what}: cp_size must be a positive int dividing the world size "
                         f"{world}, got {cp_size!r}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dp = world // cp_size
    spec = STRATEGIES.get(strategy)
    if spec is None:
        raise ValueError(f"{what}: strategy must be one of {tuple(STRATEGIES)}, got "
                         f"{strategy!r}")
    sizes = {} if ulysses_size is None else {"ulysses_size": ulysses_size}
    dims, names = spec.mesh_dims(what, cp_size, sizes)
    mesh = init_device_mesh(device, (dp, *dims), mesh_dim_names=("dp", *names))
    return ContextParallel(mesh[names if len(names) > 1 else names[0]], strategy=strategy,
                           **options)


def data_parallel(cp: ContextParallel) -> tuple[int, int]:
    """(dp rank, dp size) of this rank; cp's ranks must be a block of consecutive ranks
    (context_parallel's), else ValueError (the same on every rank)."""
    world, rank, size = dist.get_world_size(), dist.get_rank(), cp.world_size
    start = rank - cp.rank
    block = set(range(start, start + size))
    members = set().union(*(dist.get_process_group_ranks(g) for g in cp.groups))
    if world % size or start % size or not members <= block:
        raise ValueError(f"{WHAT}: the context-parallel group must be {size} consecutive ranks "
                         f"starting at a multiple of {size} (this rank {rank} is in "
                         f"{sorted(members)}): build cp with {WHAT}.context_parallel(cp_size="
                         f"{size}, ...)")
    return rank // size, world // size


def use_cpu_ranks(args) -> None:
    """On a machine without an accelerator, TrainingArguments made under torchrun run each
    process alone unless use_cpu=True (accelerate only starts CPU ranks when asked): with
    torch.distributed started on W > 1 ranks, ask for them (use_cpu=True). transformers caches
    its device set-up in the private `_setup_devices`: dropped and redone (accelerate's state
    included), with every rank."""
    if args is None or args.use_cpu or _has_accelerator() or not _started_with_ranks():
        return
    if args.world_size == dist.get_world_size():
        return
    args.use_cpu = True
    args.__dict__.pop("_setup_devices", None)
    args.device  # noqa: B018 (sets the devices up again: distributed_state, world_size)


def check_world(args) -> None:
    """The Trainer must see the ranks torch.distributed has: else ValueError naming the fix."""
    if args is None or not _started_with_ranks() or args.world_size == dist.get_world_size():
        return
    fix = ("pass use_cpu=True to the TrainingArguments (on a machine without GPUs, accelerate "
           "runs each process alone unless asked)" if not _has_accelerator() else
           "create the TrainingArguments in the processes torchrun or accelerate launch started")
    raise ValueError(f"{WHAT}: torch.distributed has {dist.get_world_size()} ranks but the "
                     f"TrainingArguments run {args.world_size} process(es) together: {fix}")


def _started_with_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _has_accelerator() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def host_or_device() -> torch.device:
    """Where the world group's collectives take tensors: the CPU with gloo (also in a
    "cpu:gloo,cuda:nccl" group, or a group whose backend was left to torch on a machine without
    GPUs), else this rank's GPU."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def refuse_accelerate_parallelism(config) -> None:
    """accelerate's own context / sequence / tensor parallelism next to cpattn's: refused."""
    if config is None:
        return
    sizes = {"cp_size": getattr(config, "cp_size", 1), "sp_size": getattr(config, "sp_size", 1),
             "tp_size": getattr(config, "tp_size", 1)}
    used = [f"{k}={v}" for k, v in sizes.items() if (v or 1) > 1]
    if used:
        raise ValueError(
            f"{WHAT}: accelerate's ParallelismConfig has {', '.join(used)}: cpattn runs the "
            "context parallelism itself (its size is the cp given to the trainer). Remove "
            "parallelism_config from TrainingArguments (and parallelism_config_cp_size from the "
            "accelerate config, PARALLELISM_CONFIG_CP_SIZE from the environment)")
