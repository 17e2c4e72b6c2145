"""`parallelize(model, cp)`: one model instance made context-parallel, on real gloo ranks (fp32,
loss within 1e-5 and gradients within 1e-4 of one process: hybrid_models.assert_step_matches).

- W = 2, gradient checkpointing, one family per mixer kind (LFM2, Bamba, Qwen3.5, Jamba,
  Kimi-Linear, MiniMax, Mamba-2 and Mamba without attention) and Llama, one sequence and packed
  documents: transformers' gradient_checkpointing_enable (reentrant and non-reentrant) and a
  plain non-reentrant torch.utils.checkpoint around each decoder layer; a forward with other
  documents between a forward and its backward (Jamba, Mamba: their models do not hand the
  documents down to the mixers). Ablations: the recomputes given other documents; for Jamba and
  Mamba the binding of the recomputes to other documents.
- W = 2, copy.deepcopy of a parallelized hybrid and attention-only model (EMA / reference
  copies): the copy trains exactly with its own state, the original too. Ablations: the copy's
  mixers alone, the copy's attention unsharded.
- W = 2, handle.remove(): the model's own forwards again, outputs and gradients bitwise equal to
  before, no hook or instance attribute left. Ablation: a remove() that leaves the mixers'
  forwards.
- W = 2, refusals on every rank: a hybrid model given register()'s implementation (naming
  parallelize; from its config's layer_types, or without them the class names), token mixing
  without an adapter found by structure (a cumulative sum in Llama's MLP, a Mamba mixer class
  under another name), parameters on the meta device, a second parallelize, a model call without
  shard_batch's whole batch, a reentrant plain checkpoint around layers that get no documents.
- W = 4, FSDP2 over dp x cp = 2 x 2 (fully_shard over the data-parallel dimension, the gradients
  then averaged over cp; and over the flattened mesh) for Qwen3.5 and Llama, parallelized before
  fully_shard; parallelize after fully_shard refused (DTensor parameters).
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import hybrid_models as H  # noqa: E402

import cpattn  # noqa: E402

import transformers_models as TM  # noqa: E402
from distributed import run_ranks  # noqa: E402
from failure_cases import raises_same_everywhere  # noqa: E402

KINDS = ("lfm2", "bamba", "qwen3_5", "jamba", "kimi_linear", "minimax", "mamba2")
LENGTHS = [30, 5, 4, 9]  # (the 30-token document is split over the ranks)
NOT_HANDED_DOWN = ("jamba", "mamba")  # (their mixers get no cpattn_documents from their layer)


def _config(kind: str):
    return TM.tiny_config(use_cache=False) if kind == "llama" else H.config(kind)


def _batches():
    return [("sequences", H.sequences(), None), ("packed", H.packed(LENGTHS), LENGTHS)]


def _without_labels(local: dict) -> dict:
    return {k: v for k, v in local.items() if k != "shift_labels"}


@contextlib.contextmanager
def _recomputed_as_one_sequence():
    """Ablation of what a recompute uses: every mixer call in backward (a checkpoint's
    recompute) gets the documents of one sequence instead of its forward's."""
    from cpattn.integrations.hybrid import forward
    from cpattn.sharding.packing import KEYWORD

    real = forward._sharded_forward

    def wrong(role, module, hidden, call):
        if torch._C._current_graph_task_id() != -1:
            call = {**call, KEYWORD: None}
        return real(role, module, hidden, call)

    forward._sharded_forward = wrong
    try:
        yield
    finally:
        forward._sharded_forward = real


@contextlib.contextmanager
def _bound_as_one_sequence():
    """Ablation of the binding: the recomputes bound to the documents of one sequence (where
    the model does not hand its documents down to the mixers, the binding is what they get)."""
    from cpattn.integrations.hybrid import documents

    binding = documents.Binding(None, True)
    run, of_call = documents._run_bound, documents.ModelState.binding_of_call

    def wrong_run(state, _, function, *args, **kwargs):
        return run(state, binding, function, *args, **kwargs)

    def wrong_of_call(self, layer, args, kwargs):
        found = of_call(self, layer, args, kwargs)
        return binding if not self.frames and not self.bindings else found

    documents._run_bound, documents.ModelState.binding_of_call = wrong_run, wrong_of_call
    try:
        yield
    finally:
        documents._run_bound, documents.ModelState.binding_of_call = run, of_call


def _fails(ref, step, what: str) -> None:
    """The ablation's step raises or changes the result."""
    try:
        got = step()
    except (RuntimeError, ValueError):  # (torch's CheckpointError is a RuntimeError)
        return
    H.assert_differs(ref, got, what)


def _interleaved(cfg, cp, prepare, first: dict, other: dict) -> tuple[float, dict]:
    """A step on `first` whose backward runs after another forward, on `other`."""
    m = H.cp_model(cfg, cp, prepare)
    local = cpattn.shard_batch(first, cp)
    loss = cpattn.cross_entropy(m(**_without_labels(local)).logits, local["shift_labels"], cp)
    m(**_without_labels(cpattn.shard_batch(other, cp)))  # (its graph is dropped)
    loss.backward()
    grads = {}
    for n, p in m.named_parameters():
        if p.grad is not None:
            g = p.grad.clone()
            dist.all_reduce(g)
            grads[n] = g / dist.get_world_size()
    return H.unwrapped((loss.item(), grads))


def _checkpointing(rank, world):

    cp = cpattn.ContextParallel()
    for kind in KINDS + ("mamba", "llama"):
        cfg = _config(kind)
        refs = {}
        for name, batch, lengths in _batches():
            ref = refs[name] = H.reference(cfg, batch, lengths)
            for mode in H.CHECKPOINTING:
                got = H.unwrapped(H.cp_step(cfg, batch, cp, prepare=H.checkpointing(mode)))
                H.assert_step_matches(ref, got, f"{kind} {name} checkpointed ({mode})")
        if kind == "llama":
            continue
        packed = H.packed(LENGTHS)
        ablations = [_recomputed_as_one_sequence] + \
            ([_bound_as_one_sequence] if kind in NOT_HANDED_DOWN else [])
        for ablation in ablations:
            with ablation():
                for mode in H.CHECKPOINTING:
                    _fails(refs["packed"], lambda: H.unwrapped(H.cp_step(
                        cfg, packed, cp, prepare=H.checkpointing(mode))),
                        f"{kind} {mode} {ablation.__name__}")
    for kind in NOT_HANDED_DOWN:
        cfg = _config(kind)
        ref = H.reference(cfg, H.packed(LENGTHS), LENGTHS)
        for mode in H.CHECKPOINTING:
            got = _interleaved(cfg, cp, H.checkpointing(mode), H.packed(LENGTHS), H.sequences())
            H.assert_step_matches(ref, got, f"{kind} interleaved ({mode})")


def test_checkpointing_w2():
    run_ranks(2, _checkpointing)


def _copies(rank, world):
    from cpattn.integrations.transformers import handle_of

    cp = cpattn.ContextParallel()
    assert copy.deepcopy(cp) is cp and copy.copy(cp) is cp
    for kind in ("qwen3_5", "jamba", "llama"):
        cfg = _config(kind)
        _, batch, lengths = _batches()[1]
        ref = H.reference(cfg, batch, lengths)
        original = H.cp_model(cfg, cp)
        twin = copy.deepcopy(original)
        handle = handle_of(twin)
        assert handle is not handle_of(original) and handle.cp is cp
        assert handle.model is twin and handle.state is not handle_of(original).state
        for mixer in handle.mixers:
            assert mixer.forward.__self__ is mixer and mixer._cpattn_mixer.state is handle.state
            assert any(mixer is m for m in twin.modules())
        H.assert_step_matches(ref, H.cp_step(cfg, batch, cp, m=twin), f"{kind} copy")
        H.assert_step_matches(ref, H.cp_step(cfg, batch, cp, m=original), f"{kind} original")
        if kind == "llama":  # ablation: the copy's attention unsharded
            twin.set_attn_implementation("eager")
            H.assert_differs(ref, H.cp_step(cfg, batch, cp, m=twin), "llama copy, eager")
        else:
            with H.mixers_alone():
                H.assert_differs(ref, H.cp_step(cfg, batch, cp, m=twin), f"{kind} copy alone")
            handle.remove()
            assert handle_of(original) is not None and not any(
                "forward" in m.__dict__ for m in twin.modules())


def _removal(rank, world):
    from cpattn.integrations.transformers import handle_of, parallelize

    cp = cpattn.ContextParallel()
    batch = H.sequences()
    for kind in ("qwen3_5", "jamba", "mamba2", "llama"):
        cfg = _config(kind)
        m = H.model(cfg, "eager")

        def own_step():
            m.zero_grad()
            out = m(input_ids=batch["input_ids"], use_cache=False).logits
            out.square().mean().backward()
            return out.detach(), [p.grad.clone() for p in m.parameters() if p.grad is not None]

        def fingerprint():
            return ([sorted(k for k in mod.__dict__ if k == "forward" or k.startswith("_cpattn"))
                     for mod in m.modules()],
                    [(len(mod._forward_pre_hooks), len(mod._forward_hooks))
                     for mod in m.modules()], m.config._attn_implementation)

        before, state = own_step(), fingerprint()
        handle = parallelize(m, cp)
        assert fingerprint() != state and handle_of(m) is handle
        H.assert_step_matches(H.reference(cfg, batch), H.cp_step(cfg, batch, cp, m=m),
                              f"{kind} parallelized")
        handle.remove()
        assert fingerprint() == state and handle_of(m) is None
        after = own_step()
        assert torch.equal(before[0], after[0]), f"{kind}: outputs after remove()"
        assert all(torch.equal(a, b) for a, b in zip(before[1], after[1])), kind
        with pytest.raises(ValueError, match="removed already"):
            handle.remove()
        if kind == "jamba":  # ablation: a remove() that leaves the mixers' forwards
            handle = parallelize(m, cp)
            handle.forwards = [f for f in handle.forwards if f[1] != "_cpattn_mixer"]
            handle.remove()
            assert fingerprint() != state
            with pytest.raises(ValueError, match="cannot know how its tokens were sharded"):
                own_step()


class _Blender(torch.nn.Module):
    """A per-token MLP after a cumulative mean over the sequence: token mixing under a name no
    rule knows."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(torch.cumsum(x, 1) / x.shape[1])


def _refusals(rank, world):
    from cpattn.integrations.transformers import parallelize, register

    cp = cpattn.ContextParallel()
    local = _without_labels(cpattn.shard_batch(H.sequences(), cp))
    # (with layer_types, and without; an attention-free model never calls register()'s
    # functions: only parallelize can refuse or run it)
    for kind in ("qwen3_5", "bamba"):
        model = H.model(H.config(kind), register(cp, "cpattn_registered"))
        raises_same_everywhere("parallelize", model, **local)
    llama = H.model(_config("llama"), "eager")
    llama.model.layers[1].mlp = _Blender(llama.model.layers[1].mlp)
    raises_same_everywhere(r"model\.layers\.1\.mlp \(_Blender\)", parallelize, llama, cp,
                           within=30)
    mamba = H.model(H.config("mamba"), "eager")
    mixer = mamba.backbone.layers[0].mixer
    mixer.__class__ = type("Scrambler", (torch.nn.Module,), {"forward": type(mixer).forward})
    raises_same_everywhere(r"backbone\.layers\.0\.mixer \(Scrambler\)", parallelize, mamba, cp,
                           within=30)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(H.config("lfm2"))
    raises_same_everywhere("meta device", parallelize, meta, cp)
    model = H.cp_model(H.config("jamba"), cp)
    raises_same_everywhere("parallelized already", parallelize, model, cp)
    raises_same_everywhere("whole batch of cpattn.shard_batch", model,
                           input_ids=local["input_ids"], position_ids=local["position_ids"])
    mamba = H.cp_model(H.config("mamba"), cp)
    mamba.train()
    layers = mamba.backbone.layers
    for i, layer in enumerate(layers):  # a reentrant plain checkpoint
        layers[i] = H.Checkpointed(layer)
        layers[i].forward = lambda *a, layer=layer, **k: torch.utils.checkpoint.checkpoint(
            layer, *a, use_reentrant=True)
    raises_same_everywhere("reentrant torch.utils.checkpoint", mamba, **local)


def test_copies_removal_and_refusals_w2():
    """One spawn of 2 ranks: deep copies, remove(), the refusals."""
    run_ranks(2, _copies)
    run_ranks(2, _removal)
    run_ranks(2, _refusals)


def _fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from cpattn.integrations.transformers import parallelize

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp = cpattn.ContextParallel(mesh["cp"])
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp")
    replicas = [H.sequences(seed=1), H.sequences(seed=2)]  # (the same number of targets)
    for kind in ("qwen3_5", "llama"):
        cfg = _config(kind)
        refs = [H.reference(cfg, b) for b in replicas]
        ref = ((refs[0][0] + refs[1][0]) / 2, {n: (g + refs[1][1][n]) / 2
                                               for n, g in refs[0][1].items()})

        def step(where: str, ablate: bool = False):
            """ablate: the mixers alone (Qwen3.5), attention within each shard (Llama)."""
            m = H.cp_model(cfg, cp)  # (parallelized before fully_shard)
            if ablate and kind == "llama":
                m.set_attn_implementation("sdpa")
            shard_mesh = mesh["dp"] if where == "dp" else dp_cp
            for layer in m.base_model.layers:
                fully_shard(layer, mesh=shard_mesh)
            fully_shard(m, mesh=shard_mesh)
            local = cpattn.shard_batch(replicas[mesh["dp"].get_local_rank()], cp)
            with H.mixers_alone() if ablate else contextlib.nullcontext():
                logits = m(**_without_labels(local)).logits
                loss = cpattn.cross_entropy(logits, local["shift_labels"], cp,
                                            group=dp_cp.get_group())
                loss.backward()
            grads = {}
            for n, p in m.named_parameters():
                g = p.grad.full_tensor()  # (averaged over shard_mesh)
                if where == "dp":  # the sum over cp of the shares of the tokens
                    dist.all_reduce(g, group=cp.group)
                    g /= cp.world_size
                grads[n] = g
            return loss.item(), grads

        for where in ("dp", "dp_cp"):
            H.assert_step_matches(ref, step(where), f"{kind} FSDP2 over {where}")
        H.assert_differs(ref, step("dp", ablate=True), f"{kind} FSDP2 ablation")
        sharded = H.model(cfg, "eager")
        fully_shard(sharded, mesh=mesh["dp"])
        raises_same_everywhere("DTensor .*call parallelize before", parallelize, sharded, cp)


def test_fsdp2_dp_x_cp_w4():
    run_ranks(4, _fsdp2)
