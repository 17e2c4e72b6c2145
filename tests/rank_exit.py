"""One rank of a W = 2 (or $WORLD_SIZE) job, launched as its own process by tests/test_exit.py:
catches cpattn errors (the same bad input on every rank, ranks that disagree), destroys the group
and checks that no gloo thread survived it; then, in a new group, catches an integration refusal
and runs one training step of a tiny Llama under context parallelism (the README's recipe), or
with $RANK_EXIT_MODEL=jamba of a parallelized hybrid model (Jamba: Mamba and attention layers)
on packed documents with gradient checkpointing, destroys the group, checks again that no gloo
thread is left (the model's registered settings hold the group weakly), and exits through the
normal interpreter shutdown (exit code 0).

$RANK_EXIT_FAULT makes this rank fail on purpose, for the test's negative controls: "abort"
on rank 1 (SIGABRT at exit, after everything passed: what gloo's threads did when they died in
the interpreter's teardown), "thread" (every rank keeps a group alive past
dist.destroy_process_group())."""

import atexit
import datetime
import os

import torch
import torch.distributed as dist

import cpattn


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def gloo_threads() -> list[str]:
    names = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/comm") as f:
            names.append(f.read().strip())
    return [n for n in names if "gloo" in n]


def llama_step() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from cpattn.integrations.transformers import register

    cp = cpattn.ContextParallel()
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, use_cache=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register(cp))
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    batch = cpattn.shard_batch({"input_ids": ids, "labels": ids}, cp)
    try:
        model(input_ids=batch["input_ids"])  # no position_ids: refused on every rank
        raise AssertionError("no error")
    except ValueError:
        pass
    labels = batch.pop("shift_labels")
    logits = model(**batch).logits
    cpattn.cross_entropy(logits, labels, cp).backward()


def hybrid_step() -> None:
    """Jamba parallelized, packed documents (one split over the ranks), gradient checkpointing,
    after a refusal (the model called without shard_batch's whole batch)."""
    import hybrid_models as H

    from cpattn.integrations.transformers import parallelize

    cp = cpattn.ContextParallel()
    model = H.model(H.config("jamba"), "eager")
    parallelize(model, cp)
    model.train()
    model.gradient_checkpointing_enable()
    batch = cpattn.shard_batch(H.packed([30, 5, 4, 9]), cp)
    try:
        model(input_ids=batch["input_ids"])  # not the whole batch: refused on every rank
        raise AssertionError("no error")
    except ValueError:
        pass
    labels = batch.pop("shift_labels")
    logits = model(**batch).logits
    cpattn.cross_entropy(logits, labels, cp).backward()


def main() -> None:
    torch.set_num_threads(1)
    before = threads()
    # (a short timeout: a peer that died makes this rank fail, not wait 30 minutes)
    timeout = datetime.timedelta(seconds=60)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rendezvous = os.environ["RENDEZVOUS_DIR"]  # a file store: no port to race other jobs for

    def init(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}/{name}", rank=rank,
                                world_size=world, timeout=timeout)

    init("first")
    q = torch.randn(1, 8 + 2 * rank, 4, 16)
    for bad in (lambda: cpattn.ring_attention(q[:, :8], q[:, :8], q[:, :8], window=(-5, 0)),
                lambda: cpattn.ring_attention(q, q, q, causal=True)):
        try:
            bad()
            raise AssertionError("no error")
        except ValueError:
            pass
    dist.destroy_process_group()
    after = threads()
    assert after == before, f"rank {rank}: {after} threads after destroy, {before} before init"
    # A training step through the integration (its registry holds the settings, and through
    # them the group, until exit: the process must still exit cleanly).
    init("second")
    if os.environ.get("RANK_EXIT_MODEL") == "jamba":
        hybrid_step()
    else:
        llama_step()
    fault = os.environ.get("RANK_EXIT_FAULT")
    kept = dist.new_group([0, 1]) if fault == "thread" else None  # noqa: F841
    dist.destroy_process_group()
    left = gloo_threads()
    assert not left, f"rank {rank}: gloo threads left after destroy_process_group(): {left}"
    if fault == "abort" and rank == 1:
        atexit.register(os.abort)


if __name__ == "__main__":
    main()
