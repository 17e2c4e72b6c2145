"""Train a tiny Llama with transformers' Trainer and cpattn context parallelism, packed documents.

    torchrun --standalone --nproc-per-node 2 examples/trainer_cp.py --check     # CPU: gloo
    torchrun --standalone --nproc-per-node 4 examples/trainer_cp.py --cp-size 2 --strategy ulysses

Each group of --cp-size consecutive ranks shares every batch (its documents split over the
group); the groups are data-parallel replicas. --check trains the same Trainer in one process
(rank 0 runs it as a subprocess: SDPA, per-device batch x the number of replicas) and exits 0
only when every step's logged loss matches (fp32: relative 1e-5; bf16 on GPUs: 2e-2).
"""

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT")


def make_model(attn_implementation: str):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                            dtype=torch.float32)


def documents(count: int) -> list[dict]:
    """Random documents of 16 to 128 tokens (a real job would tokenize its corpus here)."""
    g = torch.Generator().manual_seed(1234)
    lengths = torch.randint(16, 129, (count,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, 256, (n,), generator=g).tolist()} for n in lengths]


def training_args(opts, per_device_batch: int, output_dir: str) -> TrainingArguments:
    cuda = torch.cuda.is_available()
    return TrainingArguments(
        output_dir, per_device_train_batch_size=per_device_batch, max_steps=opts.steps,
        learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0, bf16=cuda, use_cpu=not cuda,
        dataloader_drop_last=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="documents per batch and replica")
    parser.add_argument("--cp-size", type=int, default=None, help="default: every rank")
    parser.add_argument("--strategy", default="ring",
                        choices=["ring", "allgather", "ulysses", "hybrid"])
    parser.add_argument("--ulysses-size", type=int, default=None, help="for hybrid")
    parser.add_argument("--output-dir", default="trainer_cp_output")
    parser.add_argument("--check", action="store_true",
                        help="also train in one process and compare the losses")
    parser.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # (--check's)
    opts = parser.parse_args()

    data = documents(opts.steps * opts.batch * 8)  # (enough for up to 8 replicas)
    if opts.reference:  # one process, SDPA: the losses to compare with
        dp = int(opts.reference.split(":")[0])
        trainer = Trainer(model=make_model("sdpa"),
                          args=training_args(opts, opts.batch * dp, opts.output_dir + "_ref"),
                          train_dataset=data, data_collator=DataCollatorWithFlattening())
        trainer.train()
        with open(opts.reference.split(":", 1)[1], "w") as f:
            json.dump([h["loss"] for h in trainer.state.log_history if "loss" in h], f)
        return

    import cpattn
    from cpattn.integrations.trainer import ContextParallelTrainer, context_parallel
    from cpattn.integrations.transformers import register

    # The recipe: TrainingArguments start torch.distributed; cp groups of cp_size ranks.
    args = training_args(opts, opts.batch, opts.output_dir)
    cp = context_parallel(opts.cp_size or dist.get_world_size(), opts.strategy,
                          ulysses_size=opts.ulysses_size)
    model = make_model(register(cp))
    trainer = ContextParallelTrainer(cp, model=model, args=args, train_dataset=data,
                                     data_collator=DataCollatorWithFlattening())
    trainer.train()

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if args.process_index == 0:
        print("losses per step:", " ".join(f"{x:.6f}" for x in losses), flush=True)
    ok = torch.ones(1)
    if opts.check:
        if args.process_index == 0:
            ok[0] = check(opts, losses, dist.get_world_size() // cp.world_size)
        dist.broadcast(ok, 0)
    cpattn.destroy_communicators()
    dist.destroy_process_group()
    sys.exit(0 if ok.item() else 1)


def check(opts, losses: list, dp: int) -> bool:
    """Rank 0: the reference in a subprocess of one process, then the comparison."""
    path = os.path.join(os.path.abspath(opts.output_dir), "reference_losses.json")
    os.makedirs(opts.output_dir, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if k not in TORCHRUN_VARIABLES and not k.startswith("TORCHELASTIC")}
    subprocess.run([sys.executable, __file__, *sys.argv[1:], "--reference", f"{dp}:{path}"],
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


if __name__ == "__main__":
    main()
