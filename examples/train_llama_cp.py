"""Train a tiny transformers Llama with context parallelism: every sequence is split over the ranks.

    torchrun --standalone --nproc-per-node 2 examples/train_llama_cp.py            # CPU: gloo
    torchrun --standalone --nproc-per-node 2 examples/train_llama_cp.py --check    # + reference
    torchrun --standalone --nproc-per-node 4 examples/train_llama_cp.py --strategy ulysses

GPUs (one per rank) use NCCL, bf16 weights, and need a cpattn built with CUDA. --check trains the
same model in one process (SDPA, no sharding) from the same initial weights on the same batches
and asserts that the losses agree at every step (fp32: relative 1e-5).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM, LlamaConfig

import cpattn
from cpattn.integrations.transformers import parallelize


def make_model(attn_implementation: str, device: torch.device, dtype: torch.dtype):
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, attention_dropout=0.0, use_cache=False)
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                            dtype=dtype).to(device)


def batches(args, vocab: int, device: torch.device):
    """The same batch of random tokens at every step, on every rank, so that the loss falls as
    the model memorises it (a real job would read its data here)."""
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (args.batch, args.seqlen), generator=g).to(device)
    for _ in range(args.steps):
        yield {"input_ids": ids, "labels": ids}


def train_cp(args, device, dtype) -> list[float]:
    cp = cpattn.ContextParallel(strategy=args.strategy)  # the whole world shares each sequence
    model = make_model("sdpa", device, dtype)
    parallelize(model, cp)  # this instance's attention (and any token mixer), on every rank
    # The model is replicated over the ranks; DDP averages the gradients over the group, and
    # cpattn.cross_entropy scales each rank's gradient so that the average is exact.
    ddp = DDP(model)
    forward = torch.compile(ddp, fullgraph=True) if args.compile else ddp
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for step, batch in enumerate(batches(args, model.config.vocab_size, device)):
        local = cpattn.shard_batch(batch, cp)  # labels shifted globally, global position_ids
        labels = local.pop("shift_labels")  # for cross_entropy: the model would shift them again
        logits = forward(**local).logits  # the rest whole: tokens, positions, documents
        loss = cpattn.cross_entropy(logits, labels, cp)  # global token mean
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if cp.rank == 0:
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
    return losses


def train_reference(args, device, dtype) -> list[float]:
    model = make_model("sdpa", device, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for batch in batches(args, model.config.vocab_size, device):
        loss = model(**batch).loss  # transformers shifts the labels over the full sequence
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seqlen", type=int, default=256, help="a multiple of 2 x ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--strategy", default="ring",
                        choices=["ring", "allgather", "ulysses"])
    parser.add_argument("--compile", action="store_true", help="torch.compile(fullgraph=True)")
    parser.add_argument("--check", action="store_true",
                        help="also train in one process and assert the losses agree")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        losses = train_cp(args, device, dtype)
        if args.check:
            ref = train_reference(args, device, dtype)
            rtol = 1e-5 if dtype == torch.float32 else 2e-2
            for step, (got, want) in enumerate(zip(losses, ref)):
                assert abs(got - want) <= rtol * abs(want), (
                    f"step {step}: context-parallel loss {got} vs single-process {want}")
            if dist.get_rank() == 0:
                print(f"check passed: {len(ref)} steps within relative {rtol} of the "
                      "single-process losses", flush=True)
    finally:
        cpattn.destroy_communicators()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
