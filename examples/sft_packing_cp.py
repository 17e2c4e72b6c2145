"""Fine-tune a tiny Qwen3 with TRL's SFTTrainer (packing=True) and cpattn context parallelism.

    torchrun --standalone --nproc-per-node 2 examples/sft_packing_cp.py --check     # CPU: gloo
    torchrun --standalone --nproc-per-node 4 examples/sft_packing_cp.py --cp-size 2

Prompt-completion pairs are packed into rows of --max-length tokens (best-fit decreasing, TRL's
default), padding-free, the loss on the completions only. Each group of --cp-size consecutive
ranks shares every packed batch, its documents split over the group. --check fine-tunes the same
way in one process (rank 0 runs it as a subprocess: SDPA, per-device batch x the number of
replicas) and exits 0 only when every step's logged loss matches (fp32: relative 1e-5; bf16 on
GPUs: 2e-2).
Checkpoints and logs go to --output-dir (default: a folder in the system's temporary
directory, never the source tree).
The context-parallel recipe and --check live in cp_training.py (shared with trainer_cp.py).
"""

import argparse
import os
import tempfile

import torch
from cp_training import add_parallel_arguments, run
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config
from trl import SFTConfig, SFTTrainer

VOCAB = 256


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words w0 ... w255, made in memory."""
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0", bos_token="w1",
                                   eos_token="w2", unk_token="w3")


def make_model(attn_implementation: str):
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=4096, attention_dropout=0.0,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, use_cache=False)
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                            dtype=torch.float32)


def pairs(count: int) -> Dataset:
    """Random prompt-completion pairs (a real job would load its instruction data here)."""
    g = torch.Generator().manual_seed(1234)

    def words(n: int) -> str:
        return " ".join(f"w{i}" for i in torch.randint(4, VOCAB, (n,), generator=g).tolist())

    lengths = torch.randint(4, 40, (count, 2), generator=g).tolist()
    # (TRL joins prompt and completion as they are: the completion starts with its space)
    return Dataset.from_list([{"prompt": words(p), "completion": " " + words(c)}
                              for p, c in lengths])


def sft_config(opts, per_device_batch: int, output_dir: str) -> SFTConfig:
    cuda = torch.cuda.is_available()
    return SFTConfig(
        output_dir, packing=True, max_length=opts.max_length, completion_only_loss=True,
        per_device_train_batch_size=per_device_batch, max_steps=opts.steps, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, bf16=cuda)  # (CPUs: no use_cpu needed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2, help="packed rows per batch and replica")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per packed row")
    add_parallel_arguments(parser, os.path.join(tempfile.gettempdir(), "cpattn_sft_packing_cp"),
                           "also fine-tune in one process and compare the losses")
    opts = parser.parse_args()

    data = pairs(opts.steps * opts.batch * 32)  # (enough rows for up to 8 replicas)
    run(__file__, opts, make_model, sft_config, SFTTrainer,
        train_dataset=data, processing_class=make_tokenizer())


if __name__ == "__main__":
    main()
