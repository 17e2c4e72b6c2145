"""transformers' Trainer and TRL's SFTTrainer with cpattn context parallelism
(cpattn.integrations.trainer) against the same trainer in one process with SDPA: per-step logged
loss within 1e-5 (relative), step-1 gradients (after the Trainer's DDP) within 1e-4 of
each tensor's largest entry, final weights within 1e-4, token / FLOP counters and eval loss
equal, predictions in full order. Tiny Llama, Qwen3 and Qwen3-MoE from config, fp32; the hybrid
models Qwen3.5 and Bamba (tests/trainer_cp_hybrid.py: their reference feeds one document per
padded row). The models are given to the trainers as loaded (the trainer parallelizes them),
except where a scenario says otherwise (register(cp), parallelize beforehand).

One reference process and two torchrun launches (2 ranks: cp 2; 4 ranks: dp 2 x cp 2, cp 4 and
hybrid cp 4) run every scenario of tests/trainer_cp_worker.py, tests/trainer_cp_exact.py and
tests/trainer_cp_hybrid.py (CI time: the imports and the process groups are paid once); each
test below checks one scenario, its ablation (a deliberate mistake that must change the result
or raise) included. The two examples run with --check.
"""

import importlib.metadata
import json
import os
import pydoc
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "trainer_cp_worker.py")
ROOT = os.path.dirname(HERE)
EXAMPLES = os.path.join(ROOT, "examples")
W2 = ["rows_ring", "rows_tokens_per_replica", "checkpointing", "mixed_precision", "packed",
      "label_smoothing", "moe", "evaluate_predict", "resume", "sft_packing",
      "sft_completion_only", "loss_options", "refusals", "partial_batches", "sft_partial_batches",
      "odd_lengths", "cpu_setup", "messages", "hybrid_models_trainer", "hybrid_models_sft"]
W4 = ["dp_accumulation", "dp_one_group_astray", "dp_tokens_per_replica", "dp_evaluate",
      "dp_sft_packing", "hybrid", "partial_batches_cp4", "odd_lengths_cp4", "dp_evaluate_exact"]
TIMEOUT = 900


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _launch(world: int, names: list, tmp) -> dict:
    out = tmp / f"cp{world}.pt"
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(world), WORKER, "--out", str(out), "--tmp", str(tmp / f"cp{world}"),
         "--scenarios", ",".join(names)],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-20000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(reference, context parallel): {scenario: {run: results}} of every scenario."""
    tmp = tmp_path_factory.mktemp("trainer")
    log = open(tmp / "reference.log", "w")
    reference = subprocess.Popen(  # one process, beside the torchrun launches
        [sys.executable, WORKER, "--reference", "--out", str(tmp / "ref.pt"), "--tmp",
         str(tmp / "ref"), "--scenarios", ",".join(W2 + W4)],
        stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        got = {**_launch(2, W2, tmp), **_launch(4, W4, tmp)}
        assert reference.wait(timeout=TIMEOUT) == 0, (tmp / "reference.log").read_text()[-20000:]
    finally:
        reference.kill()
        log.close()
    return torch.load(tmp / "ref.pt", weights_only=False), got


def _close(got: float, want: float, rtol: float) -> bool:
    return abs(got - want) <= rtol * abs(want)


def _tensors_close(got: dict, want: dict, rtol: float, what: str, floor: float = 0.0) -> None:
    """Each tensor within rtol of its largest reference entry (or of `floor` x the largest entry
    of them all, if larger)."""
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    largest = max(ref.abs().max().item() for ref in want.values())
    for name, ref in want.items():
        scale = max(ref.abs().max().item(), floor * largest)
        assert scale > 0, f"{what}: reference {name} is zero: the test cannot fail"
        err = (got[name] - ref).abs().max().item()
        assert err <= rtol * scale, f"{what}: {name} off by {err} (largest entry {scale})"


def assert_matches(got: dict, want: dict, what: str, loss_rtol: float = 1e-5,
                   exact: bool = True, flos: bool = True, grad_floor: float = 0.0) -> None:
    """The context-parallel run equals the reference: logged losses per step (the same on every
    rank), step-1 gradients, final weights, counters (FLOPs unless `flos` is False); eval loss
    and predictions if present. grad_floor: step-1 gradients within 1e-4 of that fraction of
    the largest one where a tensor's own largest entry is smaller."""
    assert len(got["loss"]) == len(want["loss"]) > 0, (what, got["loss"], want["loss"])
    for step, (a, b) in enumerate(zip(got["loss"], want["loss"])):
        assert _close(a, b, loss_rtol), f"{what}: step {step + 1} loss {a} vs {b}"
    assert all(r == got["loss"] for r in got["loss_every_rank"]), (what, got["loss_every_rank"])
    if exact:
        for step, (a, b) in enumerate(zip(got["grad_norm"], want["grad_norm"])):
            assert _close(a, b, 1e-4), f"{what}: step {step + 1} grad norm {a} vs {b}"
        _tensors_close(got["grads"], want["grads"], 1e-4, f"{what} step-1 gradients",
                       floor=grad_floor)
        _tensors_close(got["weights"], want["weights"], 1e-4, f"{what} final weights")
    for key in ("tokens", "global_batch"):
        assert got[key] == want[key], (what, key, got[key], want[key])
    if flos:
        assert _close(got["flos"], want["flos"], 1e-9), (what, got["flos"], want["flos"])
    for key in ("num_tokens", "mean_token_accuracy"):  # TRL's metrics
        assert (key in got) == (key in want), (what, key)
        if key in want:
            assert all(_close(a, b, 1e-6) or a == b for a, b in zip(got[key], want[key])), (
                what, key, got[key], want[key])
    if "eval" in want:
        assert _close(got["eval"], want["eval"], 1e-5), (what, got["eval"], want["eval"])
        assert len(set(got["eval_every_rank"])) == 1, (what, got["eval_every_rank"])
    if "predictions" in want:
        assert got["predictions"].shape == want["predictions"].shape, what
        assert torch.equal(got["label_ids"], want["label_ids"]), what
        scale = want["predictions"].abs().max().item()
        err = (got["predictions"] - want["predictions"]).abs().max().item()
        assert err <= 1e-5 * scale, f"{what}: predictions off by {err} (largest {scale})"


def assert_differs(got: list, want: list, what: str) -> None:
    """The ablation's losses are not the reference's (so the comparison can fail)."""
    assert any(not _close(a, b, 1e-4) for a, b in zip(got, want)), (
        f"{what}: the ablation does not change the loss: {got} vs {want}")


def _check(runs, name: str, run: str = "main", **kw):
    ref, got = runs
    assert_matches(got[name][run], ref[name][run], f"{name}/{run}", **kw)
    return ref[name], got[name]


def _check_with_ablation(runs, name: str, what: str):
    """_check of the main run, and the ablation `what` (a mistake) changes its loss."""
    ref, got = _check(runs, name)
    assert_differs(got["ablation"]["loss"], ref["main"]["loss"], what)
    return ref, got


def test_rows_shuffled_accumulation(runs):
    """Rows with different target counts, shuffled, GA 2, ring (cp 2). Ablations: labels
    shifted per shard change the loss; the sampler left as accelerate deals it (different
    batches on the ranks of the CP group) raises on every rank."""
    _, got = _check_with_ablation(runs, "rows_ring", "labels shifted per shard")
    assert "were given different batches" in got["refused"], got["refused"]
    assert "dp rank = rank // 2" in got["refused"], got["refused"]


def test_tokens_per_replica_and_clipping(runs):
    """average_tokens_across_devices=False and max_grad_norm, all-gather."""
    _check(runs, "rows_tokens_per_replica")


def test_gradient_checkpointing(runs):
    _check(runs, "checkpointing")


def test_mixed_precision(runs):
    """bf16=True: attention runs in the autocast dtype (q, k and v differ in dtype there)."""
    _check(runs, "mixed_precision", loss_rtol=2e-2, exact=False)


def test_packed_documents(runs):
    """DataCollatorWithFlattening, both forms: ring (Qwen3), Ulysses and all-gather (its
    cu_seq_lens form)."""
    for run in ("ring", "ulysses", "allgather"):
        ref, got = _check(runs, "packed", run)
    assert_differs(got["ablation"]["loss"], ref["ring"]["loss"], "packed, labels per shard")


def test_label_smoothing(runs):
    _check_with_ablation(runs, "label_smoothing", "smoothing, labels per shard")


def test_moe_load_balancing_loss(runs):
    """Qwen3-MoE with router_aux_loss_coef: the load-balancing loss of the whole sequence."""
    _check_with_ablation(runs, "moe", "MoE loss per rank")


def test_evaluate_and_predict(runs):
    """eval_loss equal on every rank and to one process; predictions (logits) in the full
    order, rows (ring) and packed documents (Ulysses). Ablation: local order."""
    _check(runs, "evaluate_predict", "rows")
    ref, got = _check(runs, "evaluate_predict", "packed")
    want, wrong = ref["rows"]["predictions"], got["ablation"]["predictions"]
    assert wrong.shape != want.shape or not torch.allclose(wrong, want, atol=1e-3)


def test_resume_and_checkpoint(runs, tmp_path):
    """A checkpoint at step 2, resumed: equal to uninterrupted training and to one process;
    the model saved once, loadable by transformers without cpattn."""
    ref, got = _check(runs, "resume", "whole")
    assert_matches(got["resumed"], ref["resumed"], "resume/resumed")
    _tensors_close(got["resumed"]["weights"], got["whole"]["weights"], 1e-5, "resumed")
    ablation = got["ablation"]["weights"]
    assert any((ablation[n] - w).abs().max() > 1e-4 * w.abs().max()
               for n, w in ref["resumed"]["weights"].items()), "data skip does not matter"
    files = got["files"]
    assert files.count("model.safetensors") == 1 and "config.json" in files, files
    with open(os.path.join(got["checkpoint"], "config.json")) as f:
        assert "cpattn" not in json.dumps(json.load(f)), "the checkpoint names cpattn"
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        "a, b = (AutoModelForCausalLM.from_pretrained(p) for p in sys.argv[1:3])\n"
        "assert a.config._attn_implementation != 'cpattn' and 'cpattn' not in sys.modules\n"
        "for (n, x), y in zip(a.state_dict().items(), b.state_dict().values()):\n"
        "    assert (x - y).abs().max() <= 1e-4 * y.abs().max(), n\n")
    result = subprocess.run([sys.executable, "-c", code, got["checkpoint"], ref["checkpoint"]],
                            capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-5000:]


def test_sft_packing(runs):
    """SFTTrainer packing=True (padding-free, seq_idx), with eval; TRL's num_tokens counter.
    Ablation: the target count not divided by cp."""
    _check_with_ablation(runs, "sft_packing", "count not divided by cp")


def test_sft_completion_only(runs):
    _check_with_ablation(runs, "sft_completion_only", "completion, labels per shard")


def test_cross_entropy_options_and_seq_idx(runs):
    """cpattn.cross_entropy with num_items_in_batch, label smoothing and reduction='sum' equals
    torch's on the full batch (loss, and the logits' gradient); shard_batch drops TRL's seq_idx
    when it marks the batch's documents and raises on every rank when it does not."""
    ref, got = runs[0]["loss_options"], runs[1]["loss_options"]
    for name in ("items", "smoothing", "sum", "mean"):
        assert _close(got[name][0], ref[name][0], 1e-12), (name, got[name][0], ref[name][0])
        torch.testing.assert_close(got[name][1], ref[name][1], rtol=1e-10, atol=1e-12)
    assert got["seq_idx_dropped"]
    assert "seq_idx marks other documents" in got["seq_idx_wrong"], got["seq_idx_wrong"]


def test_refusals(runs):
    """Misuse raises ValueError on every rank (the worker checks that the messages agree),
    naming a correct path; a model parallelize refuses (Qwen3.5 with the striped layout) is
    refused by the trainer's construction."""
    got = runs[1]["refusals"]
    expected = {"parallelize_refuses": "striped layout",
                "accelerate_cp": "Remove parallelism_config",
                "batch_rebalance": "use 'random', 'sequential'",
                "iterable": "use a map-style dataset",
                "eval_not_resharded": "not sharded by accelerate's BatchSamplerShard",
                "sft_label_smoothing": "use ContextParallelTrainer"}
    for case, hint in expected.items():
        assert hint in got[case], (case, got[case])


def test_dp_x_cp_accumulation(runs):
    """dp 2 x cp 2, GA 2, replicas with different target counts. Ablation: get_cp_size left
    at 1 (the count cp times too large)."""
    _check_with_ablation(runs, "dp_accumulation", "count not divided by cp")


def test_dp_x_cp_one_group_astray(runs):
    """One CP group with different batches: every rank of every group raises."""
    refused = runs[1]["dp_one_group_astray"]["refused"]
    assert "were given different batches (data-parallel replica(s) [1]" in refused, refused


def test_dp_x_cp_tokens_per_replica(runs):
    _check(runs, "dp_tokens_per_replica")


def test_dp_x_cp_evaluate(runs):
    """Predictions once per CP group, gathered over the data-parallel ranks."""
    _check(runs, "dp_evaluate")


def test_dp_x_cp_sft_packing(runs):
    _check(runs, "dp_sft_packing")


def test_hybrid(runs):
    """Ring 2 x Ulysses 2: rows and packed documents."""
    _check(runs, "hybrid", "rows")
    _check(runs, "hybrid", "packed")


@pytest.mark.parametrize("example", ["trainer_cp.py", "sft_packing_cp.py"])
def test_example_matches_one_process(example):
    """The examples under torchrun on 2 ranks, --check: exit 0 only when every step's loss
    matches the same trainer in one process; run from the source tree, they write nothing
    there."""
    before = set(os.listdir(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(EXAMPLES, example), "--check"],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
    assert "check passed" in result.stdout, result.stdout[-5000:]
    assert set(os.listdir(ROOT)) <= before, sorted(set(os.listdir(ROOT)) - before)


# ---- issue 56: the batches one process sees, any collator length, the set-up, messages -------


@pytest.mark.parametrize("name", ["partial_batches", "partial_batches_cp4"])
def test_partial_last_batch_as_one_process(runs, name):
    """15 training rows with bs 2 and gradient accumulation 2 (the last batch of 1 row, in the
    last window), 5 evaluation rows and 5 predicted, nothing dropped, at cp 2 and cp 4: every
    logged loss, the gradients, weights, eval loss, tokens seen and predictions equal one
    process's. Ablation: accelerate's filled batches change the last step, the eval loss and
    the token count."""
    ref, got = _check(runs, name)
    filled, want = got["ablation"], ref["main"]
    assert_differs(filled["loss"], want["loss"], f"{name}: filled batches")
    assert not _close(filled["eval"], want["eval"], 1e-5), (filled["eval"], want["eval"])
    assert filled["tokens"] != want["tokens"], (filled["tokens"], want["tokens"])


def test_sft_packing_partial_batches(runs):
    """SFTTrainer packing, bs 2, an odd number of packed rows for training and evaluation; TRL's
    eval metrics (entropy, token accuracy) equal too. Ablations: filled batches change the eval
    loss (and the last step's loss); TRL's per-rank sums truncated change its metrics."""
    ref, got = _check(runs, "sft_partial_batches")
    rows = ref["main"]["packed_rows"]
    assert rows == got["main"]["packed_rows"] and all(n % 2 == 1 for n in rows), rows
    filled, want = got["ablation"], ref["main"]
    assert not _close(filled["eval"], want["eval"], 1e-5), (filled["eval"], want["eval"])
    assert_differs(filled["loss"], want["loss"], "sft packing: filled batches")
    metrics = ("eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens")
    for key in metrics:
        a, b = got["main"]["eval_metrics"][key], want["eval_metrics"][key]
        assert _close(a, b, 1e-6), (key, a, b)
    truncated = got["ablation_gathers"]["eval_metrics"]
    assert any(not _close(truncated[k], want["eval_metrics"][k], 1e-6) for k in metrics), (
        "TRL's gathers: the truncation does not matter", truncated)


@pytest.mark.parametrize("name", ["odd_lengths", "odd_lengths_cp4"])
def test_any_collator_length(runs, name):
    """Batches the layout cannot split evenly, at cp 2 and cp 4: DataCollatorWithFlattening at
    bs 1 with one odd-length document (position-ids form, with evaluate / predict; flash form),
    without position ids, rows of 17 tokens, TRL's packed rows at bs 1: equal to one process.
    Ablation: the batch handed to shard_batch as it is raises."""
    ref, got = runs
    for run in ref[name]:
        assert_matches(got[name][run], ref[name][run], f"{name}/{run}")
    assert "must be a multiple of" in got[name]["refused"], got[name]["refused"]


def test_cpu_setup_without_use_cpu(runs):
    """Under torchrun on CPUs, TrainingArguments without use_cpu: the trainer runs the ranks
    together. Ablation: left alone, the arguments are refused at construction, naming the fix."""
    _, got = _check(runs, "cpu_setup")
    assert "pass use_cpu=True to the TrainingArguments" in got["refused"], got["refused"]


def test_messages_name_the_cause(runs):
    """A dataset that differs between the ranks, a model registered or parallelized with another
    ContextParallel: messages that say so (the same dataset on every rank trains); a plain
    Trainer given a context-parallel model (registered Llama, parallelized Llama and Qwen3.5)
    raises at its first step, on every rank, saying to use ContextParallelTrainer. A model made
    by model_init, and one TRL loads from a folder's name, are attached to the trainer's cp."""
    got = runs[1]["messages"]
    assert "the train dataset differs between ranks" in got["dataset_differs"], got
    assert got["dataset_same"] == "", got["dataset_same"]
    for case, how in (("other_cp", "registered with another ContextParallel"),
                      ("other_cp_parallelized", "was parallelized with another ContextParallel")):
        assert f"{how} than the one given to the trainer" in got[case], got[case]
        assert "build cp once" in got[case], got[case]
    # A plain Trainer never trains a context-parallel model silently: its whole batches are
    # refused at the first forward, on every rank (`raised` checks that the ranks agree), by
    # the position check (Llama) or by the first mixer (Qwen3.5's gated delta rule, layer 0).
    for case in ("plain_trainer", "plain_trainer_parallelized", "plain_trainer_hybrid"):
        message = got[case]
        assert "A transformers Trainer gives the model whole batches" in message, (case, message)
        assert "ContextParallelTrainer" in message and "with_context_parallel" in message, (
            case, message)
    assert "but 0, 1, 2, ..." in got["plain_trainer"], got["plain_trainer"]
    assert "Qwen3_5GatedDeltaNet mixes tokens" in got["plain_trainer_hybrid"], got
    assert got["model_init_attached"] is True
    assert got["sft_from_name_attached"] is True


def test_dp_x_cp_evaluation_exact(runs):
    """dp 2 x cp 2: eval loss over 5 rows and over 5 packed documents, predictions of 7 rows,
    each example once: equal to one process with a batch of 4. Ablation: filled batches."""
    ref, got = _check(runs, "dp_evaluate_exact", "rows")
    _check(runs, "dp_evaluate_exact", "packed")
    filled, want = got["ablation"]["eval"], ref["rows"]["eval"]
    assert not _close(filled, want, 1e-5), (filled, want)


def test_help_shows_cpattn_docstring():
    """help() of the trainer classes documents cp and what is refused, before the base class's
    own documentation."""
    from transformers import Trainer

    from cpattn.integrations import trainer

    class MyTrainer(Trainer):
        """My trainer."""

    for cls in (trainer.ContextParallelTrainer, trainer.ContextParallelSFTTrainer,
                trainer.with_context_parallel(MyTrainer)):
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        for words in ("cp: the cpattn.ContextParallel", "Refused with ValueError",
                      "parallelize(model,", "register(cp)", "partial"):
            assert words in text, (cls.__name__, words)
    text = pydoc.render_doc(trainer.ContextParallelSFTTrainer, renderer=pydoc.plaintext)
    assert text.index("cp: the cpattn") < text.index("SFTTrainer's documentation")


def test_trainer_extra_pins_the_tested_versions():
    """pip install "cpattn[trainer]" pins the transformers / accelerate / trl that CI installs
    (scripts/run.sh) and this environment runs."""
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        extra = re.search(r"^trainer = \[(.*)\]$", f.read(), re.M).group(1)
    pins = dict(re.findall(r'"([a-z]+)==([0-9.]+)"', extra))
    assert set(pins) == {"transformers", "accelerate", "trl"}, extra
    with open(os.path.join(ROOT, "scripts", "run.sh")) as f:
        ci = dict(re.findall(r'"(transformers|accelerate|trl)==([0-9.]+)"', f.read()))
    assert ci == pins, (ci, pins)
    for name, version in pins.items():
        assert importlib.metadata.version(name) == version, (name, version)


# ---- issue 56 item 5: hybrid models under both trainers ----------------------------------------


@pytest.mark.parametrize("kind", ["qwen3_5", "bamba"])
@pytest.mark.parametrize("name", ["hybrid_models_trainer", "hybrid_models_sft"])
def test_hybrid_models_packed_with_checkpointing(runs, name, kind):
    """Qwen3.5 (gated delta rule) and Bamba (Mamba-2), packed documents, gradient checkpointing
    on, under ContextParallelTrainer (DataCollatorWithFlattening) and ContextParallelSFTTrainer
    (packing=True), the model parallelized by the trainer: every logged loss, grad norm, the
    step-1 gradients, final weights and token counters equal the same trainer in one process,
    each document in its own padded row (tests/trainer_cp_hybrid.py says why; checked by
    test_hybrid_reference_keeps_documents_apart). FLOPs are not compared: the reference's count
    includes its padding. Gradients: hybrid_models.FLOOR (Qwen3.5's A_log / dt_bias gradients
    are 2e-4 of the largest one, sums of cancelling terms whose fp32 rounding is of their own
    size's order). Ablation: every mixer on its rank's pieces only changes the losses."""
    import hybrid_models

    ref, got = runs
    assert_matches(got[name][kind], ref[name][kind], f"{name}/{kind}", flos=False,
                   grad_floor=hybrid_models.FLOOR)
    assert len(got[name][kind]["grad_norm"]) == len(got[name][kind]["loss"]) > 1
    assert_differs(got[name][f"ablation_{kind}"]["loss"], ref[name][kind]["loss"],
                   f"{name}/{kind}: mixers alone")
    if name == "hybrid_models_sft":  # (the same packed rows in both runs, on every rank)
        rows = got[name][kind]["every_rank_rows"]
        assert rows == [ref[name][kind]["packed_rows"]] * 2, rows


@pytest.mark.parametrize("kind", ["qwen3_5", "bamba"])
def test_hybrid_reference_keeps_documents_apart(kind):
    """The reference of the hybrid trainer tests, in one process: packed documents in right-padded
    rows (tests/trainer_cp_hybrid.py's collators) give each document's logits alone (one
    forward per document, within fp32 rounding) and the same targets as the packed batch. Not
    a valid reference (the ablations): DataCollatorWithFlattening's packed row through
    transformers' own mixers (documents leak into each other), and TRL's padding-free batch,
    which transformers refuses on a CPU without the causal_conv1d kernel."""
    import hybrid_models as H
    from trainer_cp_hybrid import padded_documents, unpacked
    from trainer_cp_kit import documents
    from transformers import DataCollatorWithFlattening
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    docs = documents(5, seed=3)
    lengths = [len(d["input_ids"]) for d in docs]
    model = H.model(H.config(kind), "sdpa")
    with torch.no_grad():
        alone = torch.cat([model(input_ids=torch.tensor([d["input_ids"]]), use_cache=False).logits
                           for d in docs], 1)
        padded = padded_documents(docs)
        out = model(**{k: v for k, v in padded.items() if k != "labels"}, use_cache=False).logits
        rows = torch.cat([out[i, :n] for i, n in enumerate(lengths)])[None]
        flat = DataCollatorWithFlattening()(docs)
        leaked = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"],
                       use_cache=False).logits
    scale = alone.abs().max().item()
    assert (rows - alone).abs().max().item() <= 1e-5 * scale, kind
    assert (leaked - alone).abs().max().item() > 1e-2 * scale, f"{kind}: packed rows kept apart"
    targets = torch.cat([padded["labels"][i, :n] for i, n in enumerate(lengths)])[None]
    assert torch.equal(targets, flat["labels"]), "the padded rows' targets are not the packed ones"
    packed_row = {"input_ids": sum((d["input_ids"] for d in docs), []), "seq_lengths": lengths}
    assert torch.equal(unpacked([packed_row])["input_ids"], padded["input_ids"])
    trl_batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(docs)
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        model(**{k: v for k, v in trl_batch.items() if k != "labels"}, use_cache=False)
