"""cpattn as a transformers attention backend: one training step of a tiny Llama (GQA), a
sliding-window Mistral, a gpt-oss (sinks, alternating sliding window) and a Gemma 2 (softcap,
alternating sliding window) under context parallelism matches the single-process step (loss and
every parameter gradient, the sinks' included), for the strategies of CASES at W = 1, 2, 4;
options cpattn cannot honour raise on every rank. Each test spawns one set of gloo ranks and runs
all its cases in it (CI time)."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import cpattn  # noqa: E402

from distributed import run_ranks  # noqa: E402
from failure_cases import raises_same_everywhere  # noqa: E402
from transformers_models import (  # noqa: E402
    assert_step_matches,
    cp_step,
    reference_step,
    tiny_batch,
    tiny_config,
    tiny_model,
)

# (model kind, strategies) per world size. W = 1 runs on a one-rank subgroup of the W = 2 ranks.
CASES = {
    1: [("llama", ["ring"])],
    2: [("llama", ["ring", "allgather", "ulysses"]), ("mistral", ["ring", "allgather", "ulysses"]),
        ("gpt_oss", ["ring", "ulysses"]), ("gemma2", ["ring", "allgather"])],
    4: [("llama", ["ring", "allgather", "ulysses", "hybrid"]),
        ("mistral", ["ring", "allgather", "ulysses", "hybrid"]), ("gpt_oss", ["hybrid"]),
        ("gemma2", ["hybrid"])],
}
# Each option must change the single-process loss, else dropping it could not fail the test:
# (kind, config override that turns it off). gpt-oss's sinks: their gradient is compared too.
OPTION_OFF = {"mistral": {"sliding_window": 1000}, "gpt_oss": {"sliding_window": 1000},
              "gemma2": {"attn_logit_softcapping": None}}


def _make_cp(strategy: str, group=None) -> cpattn.ContextParallel:
    if strategy != "hybrid":
        return cpattn.ContextParallel(group, strategy=strategy)
    from torch.distributed.device_mesh import init_device_mesh

    return cpattn.ContextParallel(init_device_mesh("cpu", (2, 2)), strategy="hybrid")


def _training_matches(world: int, group=None) -> None:
    """Every case of CASES[world] (on `group`, default the world): loss and gradients of one
    step under CP equal the single-process step's."""
    for kind, strategies in CASES[world]:
        config = tiny_config(kind)
        batch = tiny_batch(config)
        ref = reference_step(config, batch)
        if kind in OPTION_OFF:
            off = reference_step(tiny_config(kind, **OPTION_OFF[kind]), batch)
            assert abs(off[0] - ref[0]) > 1e-3, f"{kind}: {OPTION_OFF[kind]} does not matter"
        for strategy in strategies:
            cp = _make_cp(strategy, group)
            got = cp_step(config, batch, cp, f"cpattn_{strategy}")
            assert_step_matches(ref, got, f"{kind} {strategy} W={world}")


def _dp_times_cp(rank, world):
    """The recipe of docs/transformers.md, "Gradient reduction with data parallelism": dp = 2
    replicas x cp = 2 ranks, gradients averaged over the flattened mesh by DDP or FSDP2, loss
    over the flattened group: exactly the gradient of the mean over the global batch (the
    replicas' batches have different numbers of real targets)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cpattn.integrations.transformers import register

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = cpattn.ContextParallel(mesh["cp"])
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    config = tiny_config()
    batches = [tiny_batch(config, seed=1), tiny_batch(config, seed=2)]
    batches[1]["labels"][:, :20] = -100
    ref = reference_step(config, {k: torch.cat([b[k] for b in batches]) for k in batches[0]})
    local = cpattn.shard_batch(batches[mesh["dp"].get_local_rank()], cp)
    for wrap in ("ddp", "fsdp2"):
        model = tiny_model(config, register(cp))
        if wrap == "ddp":
            forward = DDP(model, process_group=dp_cp.get_group())
        else:
            for layer in model.model.layers:
                fully_shard(layer, mesh=dp_cp)
            forward = fully_shard(model, mesh=dp_cp)
        inputs = dict(local)
        labels = inputs.pop("shift_labels")  # the README's recipe
        logits = forward(**inputs, use_cache=False).logits
        loss = cpattn.cross_entropy(logits, labels, cp, group=dp_cp.get_group())
        loss.backward()
        grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                 for n, p in model.named_parameters()}
        assert_step_matches(ref, (loss.item(), grads), wrap)


def _w2(rank, world):
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    _training_matches(1, singles[rank])
    _training_matches(2)
    _refusals()
    _loss_is_global_mean()


def _w4(rank, world):
    _training_matches(4)
    _hybrid_loss_group()
    _hybrid_one_rank_refusal()
    _dp_times_cp(rank, world)


def test_w1_w2_training_refusals_and_loss():
    """One spawn of 2 ranks (CI time): the training cases at W = 1 (one-rank groups) and W = 2,
    the refusals, and the global mean of the loss."""
    run_ranks(2, _w2)


def test_w4_training_hybrid_and_dp_x_cp():
    """One spawn of 4 ranks: the training cases at W = 4 (hybrid 2 x 2 among them), the loss
    group of hybrid, and the dp x cp (2 x 2) gradient reduction with DDP and FSDP2."""
    run_ranks(4, _w4)


def _raises(match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _refusals():
    from cpattn.integrations.transformers import register

    cp = cpattn.ContextParallel()
    name = register(cp)
    config = tiny_config()
    batch = tiny_batch(config)
    local = cpattn.shard_batch(batch, cp)
    ids, pos = local["input_ids"], local["position_ids"]
    model = tiny_model(config, name)

    padded = torch.ones_like(batch["input_ids"])
    padded[1, -3:] = 0
    # Padding is unpadded into documents; a padding token with a target would lose its term.
    _raises("padding token has a target", cpattn.shard_batch,
            {**batch, "attention_mask": padded}, cp)
    local_mask = torch.ones_like(ids)
    local_mask[1, -1] = 0
    _raises("attention_mask with padding", model, input_ids=ids, position_ids=pos,
            use_cache=False, attention_mask=local_mask)
    _raises("attention mask", model, input_ids=ids, position_ids=pos, use_cache=False,
            attention_mask=torch.ones(2, 1, ids.shape[1], ids.shape[1], dtype=torch.bool))
    # An all-ones mask masks nothing: it runs.
    model(input_ids=ids, position_ids=pos, use_cache=False, attention_mask=torch.ones_like(ids))
    _raises("use_cache", model, input_ids=ids, position_ids=pos)
    _raises("position_ids are not the position ids", model, input_ids=ids, use_cache=False)
    _raises("position_bias", model, input_ids=ids, position_ids=pos, use_cache=False,
            position_bias=torch.zeros(1))
    _raises("alibi_slopes must be a tensor", model, input_ids=ids, position_ids=pos,
            use_cache=False, alibi_slopes=0.5)
    _raises("softcap=-1.0: must be finite", model, input_ids=ids, position_ids=pos,
            use_cache=False, softcap=-1.0)
    # A model that computes attention in its own code (Bloom: it accepts any implementation)
    # would attend within each rank's shard: it raises.
    from transformers import BloomConfig

    bloom = tiny_model(BloomConfig(vocab_size=96, hidden_size=32, n_layer=1, n_head=4), name)
    _raises("'bloom' model computes attention in its own code", bloom, input_ids=ids,
            use_cache=False)
    _raises("unknown keyword bias_scale", model, input_ids=ids, position_ids=pos,
            use_cache=False, bias_scale=2.0)
    _raises("cross_entropy", model, input_ids=ids, position_ids=pos, use_cache=False,
            shift_labels=local["shift_labels"])
    _raises("multiple of 4", cpattn.shard_batch, {"input_ids": batch["input_ids"][:, :-2]}, cp)

    dropout_model = tiny_model(tiny_config(attention_dropout=0.1), name)
    dropout_model.train()
    _raises("dropout", dropout_model, input_ids=ids, position_ids=pos, use_cache=False)
    dropout_model.eval()  # dropout is off in eval mode: it runs
    dropout_model(input_ids=ids, position_ids=pos, use_cache=False)

    # After all these errors the group still works: a step matches.
    assert_step_matches(reference_step(config, batch), cp_step(config, batch, cp, name),
                        "after errors")


def _loss_is_global_mean():
    # Rank-dependent numbers of ignored targets: a mean of per-rank means would differ.
    cp = cpattn.ContextParallel()
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 8, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 8), generator=g)
    labels[:, :5] = -100  # rank 0 gets fewer real targets (zigzag chunks 0 and 3)
    full = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full.flatten(0, 1), labels.flatten())
    ref.backward()
    local_logits = cp.shard(logits).requires_grad_()
    local_labels = cp.shard(labels)
    loss = cpattn.cross_entropy(local_logits, local_labels, cp)
    assert torch.allclose(loss.double(), ref.detach(), rtol=1e-6)
    loss.backward()
    # The gradient averaged over the group (as DDP does) is the global mean's.
    assert torch.allclose(local_logits.grad / cp.world_size, cp.shard(full.grad), rtol=1e-5,
                          atol=1e-7)
    # A group that misses some of cp's ranks would average over part of the sequence: refused.
    alone = [dist.new_group([r]) for r in range(cp.world_size)][cp.rank]
    _raises("misses ranks", cpattn.cross_entropy, local_logits, local_labels, cp, group=alone)


def _hybrid_one_rank_refusal():
    """Hybrid 2 x 2: a padding mask with zeros in one rank's shard raises on all four ranks
    (agreed over the Ulysses groups, then the ring groups), and the group works afterwards;
    a packed batch matches one process."""
    from cpattn.integrations.transformers import register

    cp = _make_cp("hybrid")
    config = tiny_config()
    batch = tiny_batch(config)
    local = cpattn.shard_batch(batch, cp)
    model = tiny_model(config, register(cp, "cpattn_hybrid_refusal"))
    mask = torch.ones_like(local["input_ids"])
    if dist.get_rank() == 3:
        mask[0, 1] = 0
    # the same text on all four ranks, which names rank 3 and its error
    raises_same_everywhere(r"invalid on rank\(s\) 3 \(.*\)\. rank\(s\) 3: ValueError: .*padding",
                           model, input_ids=local["input_ids"],
                           position_ids=local["position_ids"], use_cache=False,
                           attention_mask=mask)
    import test_transformers_models as models

    # Llama 4's chunks past one chunk: refused under hybrid (ring, all-gather and Ulysses cut
    # them), on every rank
    chunked = tiny_model(models.model_config("llama4", attention_chunk_size=8),
                         register(cp, "cpattn_hybrid_refusal"))
    whole = {k: v for k, v in local.items() if k != "shift_labels"}
    raises_same_everywhere("chunked attention.*'hybrid' runs only while", chunked, **whole,
                           use_cache=False)
    # Packed documents run under hybrid too: one step equals one process per document.

    llama, documents = models.model_config("llama"), models.packed(models.LENGTHS)
    assert_step_matches(models.reference(llama, documents, lengths=models.LENGTHS),
                        models.cp_step(llama, documents, cp), "hybrid packed")
    assert_step_matches(reference_step(config, batch),
                        cp_step(config, batch, cp, "cpattn_hybrid_refusal"), "hybrid after")


def _hybrid_loss_group():
    """Hybrid 2 x 2: with no group, cross_entropy averages over the ring x Ulysses ranks."""
    cp = _make_cp("hybrid")
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 16, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (1, 16), generator=g)
    labels[:, :7] = -100
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    index = cp.positions(16)
    loss = cpattn.cross_entropy(logits[:, index], labels[:, index], cp)
    assert torch.allclose(loss.double(), ref, rtol=1e-6)
    ring_only = [dist.new_group(r) for r in ([0, 2], [1, 3])][dist.get_rank() % 2]
    _raises("misses ranks", cpattn.cross_entropy, logits[:, index], labels[:, index], cp,
            group=ring_only)


def test_import_without_transformers_elsewhere():
    import subprocess
    import sys

    code = "import sys, cpattn; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_example_trains_and_matches_one_process():
    """examples/train_llama_cp.py --check under torchrun on 2 CPU ranks."""
    import os
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_llama_cp.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         example, "--check", "--steps", "3", "--seqlen", "64"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check passed: 3 steps" in result.stdout
