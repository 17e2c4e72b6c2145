"""Train a tiny Llama with transformers' Trainer and cpattn context parallelism, packed documents.

    torchrun --standalone --nproc-per-node 2 examples/trainer_cp.py --check     # CPU: gloo
    torchrun --standalone --nproc-per-node 4 examples/trainer_cp.py --cp-size 2 --strategy ulysses

Each group of --cp-size consecutive ranks shares every batch (its documents split over the
group); the groups are data-parallel replicas. --check trains the same Trainer in one process
(rank 0 runs it as a subprocess: SDPA, per-device batch x the number of replicas) and exits 0
only when every step's logged loss matches (fp32: relative 1e-5; bf16 on GPUs: 2e-2).
Checkpoints and logs go to --output-dir (default: a folder in the system's temporary
directory, never the source tree).
The context-parallel recipe and --check live in cp_training.py (shared with sft_packing_cp.py).
"""

import argparse
import os
import tempfile

import torch
from cp_training import add_parallel_arguments, run
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    LlamaConfig,
    Trainer,
    TrainingArguments,
)


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
        save_strategy="no", disable_tqdm=True, seed=0, bf16=cuda)  # (CPUs: no use_cpu needed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=4, help="documents per batch and replica")
    add_parallel_arguments(parser, os.path.join(tempfile.gettempdir(), "cpattn_trainer_cp"),
                           "also train in one process and compare the losses")
    opts = parser.parse_args()

    data = documents(opts.steps * opts.batch * 8)  # (enough for up to 8 replicas)
    run(__file__, opts, make_model, training_args, Trainer,
        train_dataset=data, data_collator=DataCollatorWithFlattening())


if __name__ == "__main__":
    main()
