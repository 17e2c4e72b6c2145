"""What trainer_cp.py and sft_packing_cp.py share: the context-parallel command-line options, the
run (the context-parallel recipe, or --check's one process) and --check's comparison of the
losses.

Not an example by itself; the two examples import it from their own folder.
"""

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def add_parallel_arguments(parser: argparse.ArgumentParser, output_dir: str,
                           check_help: str) -> None:
    parser.add_argument("--cp-size", type=int, default=None, help="default: every rank")
    parser.add_argument("--strategy", default="ring",
                        choices=["ring", "allgather", "ulysses", "hybrid"])
    parser.add_argument("--ulysses-size", type=int, default=None, help="for hybrid")
    parser.add_argument("--output-dir", default=output_dir)
    parser.add_argument("--check", action="store_true", help=check_help)
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # (--check's)


def logged_losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def run(script: str, opts, make_model, make_args, trainer_class: type, **trainer_kwargs) -> None:
    """Train trainer_class(model=make_model(attention), args=make_args(opts, per_device_batch,
    output_dir), **trainer_kwargs) as opts say: context-parallel on every rank, or under
    --reference ("<data-parallel replicas>:<losses file>") in one process with SDPA."""
    if opts.reference:  # one process, SDPA: the losses to compare with
        dp = int(opts.reference.split(":")[0])
        trainer = trainer_class(model=make_model("sdpa"),
                                args=make_args(opts, opts.batch * dp, opts.output_dir + "_ref"),
                                **trainer_kwargs)
        trainer.train()
        with open(opts.reference.split(":", 1)[1], "w") as f:
            json.dump(logged_losses(trainer), f)
        return

    import cpattn
    from cpattn.integrations.trainer import context_parallel, with_context_parallel

    # The recipe: the trainer's arguments start torch.distributed; cp groups of cp_size ranks;
    # the trainer class gets context parallelism and makes the model context-parallel with cp.
    args = make_args(opts, opts.batch, opts.output_dir)
    cp = context_parallel(opts.cp_size or dist.get_world_size(), opts.strategy,
                          ulysses_size=opts.ulysses_size)
    model = make_model("sdpa")
    trainer = with_context_parallel(trainer_class)(cp, model=model, args=args, **trainer_kwargs)
    trainer.train()
    losses = logged_losses(trainer)
    if args.process_index == 0:
        print("losses per step:", " ".join(f"{x:.6f}" for x in losses), flush=True)
    ok = torch.ones(1)
    if opts.check:
        if args.process_index == 0:
            ok[0] = check(script, opts, losses, dist.get_world_size() // cp.world_size)
        dist.broadcast(ok, 0)
    cpattn.destroy_communicators()
    dist.destroy_process_group()
    sys.exit(0 if ok.item() else 1)


def check(script: str, opts, losses: list, dp: int) -> bool:
    """Rank 0: the reference in a subprocess of one process, then the comparison."""
    path = os.path.join(os.path.abspath(opts.output_dir), "reference_losses.json")
    os.makedirs(opts.output_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC")}
    subprocess.run([sys.executable, script, *sys.argv[1:], "--reference", f"{dp}:{path}"],
                   env=env, check=True)
    with open(path) as f:
        reference = json.load(f)
    rtol = 2e-2 if torch.cuda.is_available() else 1e-5
    bad = [(s, a, b) for s, (a, b) in enumerate(zip(losses, reference))
           if abs(a - b) > rtol * abs(b)]
    if bad or len(losses) != len(reference) or not losses:
        print(f"check FAILED: context-parallel {losses} vs one process {reference}", flush=True)
        return False
    print(f"check passed: {len(losses)} steps within relative {rtol} of one process", flush=True)
    return True
