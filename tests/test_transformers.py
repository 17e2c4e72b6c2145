"""cpattn as a transformers attention backend: one training step of a tiny Llama (GQA) and a
sliding-window Mistral under context parallelism matches the single-process SDPA step (loss and
every parameter gradient), for every strategy and W = 1, 2, 4; options cpattn cannot honour raise
on every rank. Each test spawns one set of gloo ranks and runs all its cases in it (CI time)."""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import cpattn  # noqa: E402
from distributed import run_ranks  # noqa: E402
from transformers_models import (  # noqa: E402
    assert_step_matches,
    cp_step,
    reference_step,
    tiny_batch,
    tiny_config,
    tiny_model,
)


def _strategies(world: int) -> list[str]:
    return ["ring", "allgather", "ulysses"] + (["hybrid"] if world == 4 else [])


def _make_cp(strategy: str, world: int) -> cpattn.ContextParallel:
    if strategy != "hybrid":
        return cpattn.ContextParallel(strategy=strategy)
    from torch.distributed.device_mesh import init_device_mesh

    return cpattn.ContextParallel(init_device_mesh("cpu", (2, world // 2)), strategy="hybrid")


def _training_matches(rank, world, kinds):
    for kind in kinds:
        config = tiny_config(kind)
        batch = tiny_batch(config)
        ref = reference_step(config, batch)
        if kind == "mistral":  # the window must matter, else this case could not fail
            unwindowed = reference_step(tiny_config(kind, sliding_window=None), batch)
            assert abs(unwindowed[0] - ref[0]) > 1e-3
        for strategy in _strategies(world):
            cp = _make_cp(strategy, world)
            loss_group = dist.group.WORLD if strategy == "hybrid" else None
            got = cp_step(config, batch, cp, f"cpattn_{strategy}", loss_group=loss_group)
            assert_step_matches(ref, got, f"{kind} {strategy} W={world}")


def _dp_times_cp(rank, world):
    """The README's recipe: dp = 2 replicas x cp = 2 ranks, gradients averaged over the flattened
    mesh by DDP or FSDP2, loss over the flattened group: exactly the gradient of the mean over
    the global batch (the replicas' batches have different numbers of real targets)."""
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
        logits = forward(input_ids=local["input_ids"], position_ids=local["position_ids"],
                         use_cache=False).logits
        loss = cpattn.cross_entropy(logits, local["shift_labels"], cp, group=dp_cp.get_group())
        loss.backward()
        grads = {n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
                 for n, p in model.named_parameters()}
        assert_step_matches(ref, (loss.item(), grads), wrap)


def _training_matches_w4(rank, world):
    _training_matches(rank, world, ["llama", "mistral"])
    _dp_times_cp(rank, world)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_training_step_matches_single_process(world):
    """W = 4 also runs the dp x cp (2 x 2) gradient reduction with DDP and FSDP2."""
    if world == 4:
        run_ranks(world, _training_matches_w4)
    else:
        run_ranks(world, _training_matches, ["llama", "mistral"] if world > 1 else ["llama"])


def _raises(match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)


def _refusals(rank, world):
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
    _raises("padding", cpattn.shard_batch, {**batch, "attention_mask": padded}, cp)
    local_mask = torch.ones_like(ids)
    local_mask[1, -1] = 0
    _raises("attention mask", model, input_ids=ids, position_ids=pos, use_cache=False,
            attention_mask=local_mask)
    _raises("attention mask", model, input_ids=ids, position_ids=pos, use_cache=False,
            attention_mask=torch.ones(2, 1, ids.shape[1], ids.shape[1], dtype=torch.bool))
    # An all-ones mask masks nothing: it runs.
    model(input_ids=ids, position_ids=pos, use_cache=False, attention_mask=torch.ones_like(ids))
    _raises("use_cache", model, input_ids=ids, position_ids=pos)
    _raises("position_ids are not the global positions", model, input_ids=ids, use_cache=False)
    _raises("softcap", model, input_ids=ids, position_ids=pos, use_cache=False, softcap=30.0)
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


def test_unsupported_options_raise_on_every_rank():
    run_ranks(2, _refusals)


def _loss_is_global_mean(rank, world):
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
    assert torch.allclose(local_logits.grad / world, cp.shard(full.grad), rtol=1e-5, atol=1e-7)


def test_cross_entropy_is_the_global_mean():
    run_ranks(2, _loss_is_global_mean)


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
