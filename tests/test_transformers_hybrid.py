"""Hybrid transformers models (token mixers outside attention) under context parallelism
(`parallelize(model, cp)`), on real gloo ranks: every family of tests/hybrid_models.py trains
exactly (fp32: loss within 1e-5 and every gradient within 1e-4 relative of one process, see
hybrid_models.assert_step_matches), or is refused on every rank.

- W = 2, all families: zigzag sequences (ring) and packed documents under a document plan (one
  forward per document is the reference); a padded batch, the collator's cu_seq_lens form.
- W = 3, all families: contiguous sequences and per-document packing (all-gather).
- W = 4, one family per mixer kind: Ulysses, the 2 x 2 hybrid mesh, a plan with the all-gather.
- torch.compile(fullgraph=True) of Qwen3.5 (gated delta rule) and Bamba (Mamba-2), and of Jamba
  (Mamba) on packed documents; refused together with gradient checkpointing.
Each exact case has an ablation (every mixer on its rank's pieces only) that changes the result.
Refused on every rank: the striped layout and invariant mode (by parallelize), generate with
ContextParallelCache, use_cache=True, a padding mask reaching a mixer, a model not given
shard_batch's whole batch, and a module that differs from cpattn's version of it (a changed
transformers class; by parallelize). Checkpointing, copies, FSDP2, remove() and the structural
refusal of unknown mixers: tests/test_parallelize.py."""

from __future__ import annotations

import re
import time

import pytest
import torch

pytest.importorskip("transformers")

import hybrid_models as H  # noqa: E402

import cpattn  # noqa: E402

from distributed import run_ranks  # noqa: E402

PLAN_LENGTHS = [30, 5, 4, 9]  # the 30-token document is split, the short ones stay whole
ALL = tuple(H.FAMILIES)
ONE_PER_KIND = ("lfm2", "bamba", "qwen3_next", "jamba", "kimi_linear", "minimax")


def _cases(cp, kinds, batches) -> None:
    """Each family on each batch: exact, and the mixers alone are not."""
    for kind in kinds:
        cfg = H.config(kind)
        for name, batch, lengths, shard in batches:
            what = f"{kind} {name} {cp.strategy}/{cp.layout} W={cp.world_size}"
            ref = H.reference(cfg, batch, lengths)
            H.assert_step_matches(ref, H.cp_step(cfg, batch, cp, **shard), what)
            with H.mixers_alone():
                H.assert_differs(ref, H.cp_step(cfg, batch, cp, **shard), what)


def _padded() -> dict:
    """Rows of one document each, right- and left-padded (unpadded into documents)."""
    batch = H.sequences()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -7:] = 0
    mask[1, :11] = 0
    batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    batch["labels"][1, 11] = -100  # (predicted by padding)
    batch["attention_mask"] = mask
    return batch


def _raises_everywhere(match: str, fn, *args, **kwargs) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        fn(*args, **kwargs)
    assert time.monotonic() - start < 5.0, f"{match}: raised after {time.monotonic() - start} s"


def _refusals(rank: int) -> None:
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    from cpattn.integrations.transformers import ContextParallelCache

    batch = H.sequences()
    for settings, match in ((dict(layout="striped"), "striped layout"),
                            (dict(invariant=True), "invariant mode")):
        _raises_everywhere(match, H.cp_model, H.config("qwen3_5"),
                           cpattn.ContextParallel(**settings))
    cp = cpattn.ContextParallel()
    local = {k: v for k, v in cpattn.shard_batch(batch, cp).items() if k != "shift_labels"}
    model = H.cp_model(H.config("lfm2"), cp)
    _raises_everywhere("got a cache", model, **{**local, "use_cache": True})
    # A padding mask that reaches the mixer (LFM2 hands the model's to its convolutions).
    mask = torch.ones_like(local["input_ids"])
    mask[0, 1] = 0
    _raises_everywhere("attention.mask", model, **local, attention_mask=mask)
    # An attention-free model given only input_ids: nothing would say how it was sharded.
    mamba = H.cp_model(H.config("mamba"), cp)
    _raises_everywhere("whole batch of cpattn.shard_batch", mamba, input_ids=local["input_ids"])
    # generate with the sharded K/V cache: the mixers' states are not in it.
    prompts = torch.randint(5, 96, (2, 13), generator=torch.Generator().manual_seed(5))
    for kind in ("qwen3_5", "bamba"):
        model = H.cp_model(H.config(kind), cp)
        cache = ContextParallelCache(cp, model.config, capacity=19)
        _raises_everywhere("generate with ContextParallelCache does not support", model.generate,
                           prompts, cache=cache, max_new_tokens=6, do_sample=False,
                           pad_token_id=0)
    # A class whose forward is not what cpattn computes (as if transformers changed it): the
    # equivalence check refuses it on every rank, naming the class and the version.
    forward = Lfm2ShortConv.forward
    Lfm2ShortConv.forward = lambda *a, **k: 1.01 * forward(*a, **k)
    try:
        import transformers

        _raises_everywhere(f"Lfm2ShortConv .*transformers {transformers.__version__}.*"
                           "differs by", H.cp_model, H.config("lfm2"), cp)
    finally:
        Lfm2ShortConv.forward = forward
    H.assert_step_matches(H.reference(H.config("lfm2"), batch),
                          H.cp_step(H.config("lfm2"), batch, cp), "lfm2 after the refusals")


def _w2(rank, world):
    zigzag = cpattn.ContextParallel(strategy="ring", layout="zigzag")
    _cases(zigzag, ALL, [("sequences", H.sequences(), None, {}),
                         ("plan", H.packed(PLAN_LENGTHS), PLAN_LENGTHS, {})])
    gather = cpattn.ContextParallel(strategy="allgather", layout="contiguous")
    _cases(gather, ("lfm2", "qwen3_5"), [("padded", _padded(), None,
                                           {"documents": "per-document"})])
    _cases(gather, ("bamba",), [("cu_seq_lens", H.packed(PLAN_LENGTHS, flash=True),
                                 PLAN_LENGTHS, {})])
    _refusals(rank)


def _w3(rank, world):
    cp = cpattn.ContextParallel(strategy="ring", layout="contiguous")
    _cases(cp, ALL, [("sequences", H.sequences(), None, {})])
    cp = cpattn.ContextParallel(strategy="allgather", layout="contiguous")
    _cases(cp, ALL, [("per-document", H.packed(PLAN_LENGTHS), PLAN_LENGTHS,
                      {"documents": "per-document"})])


def _w4(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    packed = ("packed", H.packed(PLAN_LENGTHS), PLAN_LENGTHS, {})
    _cases(cpattn.ContextParallel(strategy="ulysses"), ONE_PER_KIND,
           [("sequences", H.sequences(), None, {}), packed])
    hybrid = cpattn.ContextParallel(init_device_mesh("cpu", (2, 2)), strategy="hybrid")
    _cases(hybrid, ONE_PER_KIND, [("sequences", H.sequences(), None, {}), packed])
    _cases(cpattn.ContextParallel(strategy="allgather"), ONE_PER_KIND, [packed])


def test_families_w2():
    run_ranks(2, _w2)


@pytest.mark.slow  # a sweep: every family again at W = 3 (W = 2 and 4 run in the main step)
def test_families_w3():
    run_ranks(3, _w3)


def test_families_w4():
    run_ranks(4, _w4)


def _compiled(rank, world):
    from torch._dynamo.utils import counters

    batch = H.sequences()
    for kind in ("qwen3_5", "bamba"):
        torch._dynamo.reset()
        counters.clear()
        cfg = H.config(kind)
        got = H.cp_step(cfg, batch, cpattn.ContextParallel(), compile_backend="aot_eager")
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        H.assert_step_matches(H.reference(cfg, batch), got, f"compiled {kind}")
    # Jamba on packed documents: its model does not hand them down to its Mamba layers (the
    # traced hooks of parallelize do)
    torch._dynamo.reset()
    counters.clear()
    cfg, packed = H.config("jamba"), H.packed(PLAN_LENGTHS)
    got = H.cp_step(cfg, packed, cpattn.ContextParallel(), compile_backend="aot_eager")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    H.assert_step_matches(H.reference(cfg, packed, PLAN_LENGTHS), got, "compiled jamba packed")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="under gradient checkpointing is not supported yet"):
        H.cp_step(cfg, packed, cpattn.ContextParallel(), compile_backend="aot_eager",
                  prepare=H.checkpointing("non-reentrant"))


def test_compile_fullgraph_w2():
    """The aot_eager backend traces what inductor would get (dynamo graph, AOT autograd's joint
    graph with the exchange's custom ops) without generating code (minutes on 2 cores): Qwen3.5
    and Bamba on sequences, Jamba on packed documents; with gradient checkpointing refused."""
    run_ranks(2, _compiled)


def test_probe_refuses_a_changed_class():
    """One process: the equivalence check names the class and the transformers version, what
    differed (the output, or only a gradient: it checks backward too), or the exception."""
    import transformers
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from cpattn.integrations.hybrid.parallelize import verdict
    from cpattn.integrations.hybrid.registry import ADAPTERS, Adapter, adapter_of

    model = H.model(H.config("qwen3_5"), "eager")
    module = model.model.layers[0].linear_attn
    assert verdict(module) == ""
    forward = Qwen3_5GatedDeltaNet.forward
    changes = {  # the module's own forward changed: its output, then its backward only
        "its output differs by": lambda *a, **k: forward(*a, **k) + 1e-3,
        "the gradient of .* differs by": lambda *a, **k: (lambda y: y + 0.05 * (y - y.detach()))(
            forward(*a, **k)),
    }
    for match, changed in changes.items():
        Qwen3_5GatedDeltaNet.forward = changed
        try:
            refusal = verdict(module)
        finally:
            Qwen3_5GatedDeltaNet.forward = forward
        assert "Qwen3_5GatedDeltaNet" in refusal and transformers.__version__ in refusal
        assert re.search(match, refusal), refusal
    key = next(k for k, a in ADAPTERS.items() if a is adapter_of(module))

    def broken(m, h, mix):
        raise RuntimeError("an adapter that fails")

    real = ADAPTERS[key]
    ADAPTERS[key] = Adapter(broken)
    try:
        assert "raised RuntimeError: an adapter that fails" in verdict(module)
    finally:
        ADAPTERS[key] = real


def test_models_built_before_install_are_adopted():
    """parallelize changes one instance, whenever it was built: a model built before it and one
    built after keep their class's own forward (outputs bitwise those of an identical model never
    near cpattn), no class attribute changes, and the parallelized instance's mixers run
    sharded (one rank: its own process group)."""
    import subprocess
    import sys

    script = (
        "import sys, tempfile; sys.path.insert(0, %r)\n"
        "import torch, torch.distributed as dist\n"
        "import hybrid_models as H, cpattn\n"
        "from transformers.models.qwen3_5 import modeling_qwen3_5 as M\n"
        "def methods():  # (every function of every class: transformers caches other values)\n"
        "    return {(n, k): v for n, c in vars(M).items() if isinstance(c, type)\n"
        "            for k, v in vars(c).items() if callable(v)}\n"
        "classes = methods()\n"
        "ids = H.sequences()['input_ids']\n"
        "expected = H.model(H.config('qwen3_5'), 'eager')(input_ids=ids).logits\n"
        "before = H.model(H.config('qwen3_5'), 'eager')\n"
        "dist.init_process_group('gloo', init_method='file://' + tempfile.mktemp(), rank=0,\n"
        "                        world_size=1)\n"
        "from cpattn.integrations.transformers import parallelize\n"
        "target = H.model(H.config('qwen3_5'), 'eager')\n"
        "parallelize(target, cpattn.ContextParallel())\n"
        "after = H.model(H.config('qwen3_5'), 'eager')\n"
        "assert classes == methods(), 'a class changed'\n"
        "for m in (before, after):\n"
        "    assert not any('forward' in x.__dict__ for x in m.modules())\n"
        "    assert torch.equal(m(input_ids=ids).logits, expected)\n"
        "assert all('forward' in m.__dict__ for m in target.modules()\n"
        "           if type(m).__name__ == 'Qwen3_5GatedDeltaNet')\n"
        "print('adopted')\n") % str(__import__("pathlib").Path(__file__).parent)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and "adopted" in run.stdout, run.stderr[-2000:]
