"""transformers' Trainer and TRL's SFTTrainer with cpattn context parallelism
(cpattn.integrations.trainer) against the same trainer in one process with SDPA: per-step logged
loss within 1e-5 (relative), step-1 gradients (after the Trainer's DDP) within 1e-4 of
each tensor's largest entry, final weights within 1e-4, token / FLOP counters and eval loss
equal, predictions in full order. Tiny Llama, Qwen3 and Qwen3-MoE from config, fp32.

One reference process and two torchrun launches (2 ranks: cp 2; 4 ranks: dp 2 x cp 2 and
hybrid cp 4) run every scenario of tests/trainer_cp_worker.py (CI time: the imports and the
process groups are paid once); each test below checks one scenario, its ablation (a deliberate
mistake that must change the result or raise) included. The two examples run with --check.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "trainer_cp_worker.py")
EXAMPLES = os.path.join(HERE, "..", "examples")
W2 = ["rows_ring", "rows_tokens_per_replica", "checkpointing", "mixed_precision", "packed",
      "label_smoothing", "moe", "evaluate_predict", "resume", "sft_packing",
      "sft_completion_only", "loss_options", "refusals"]
W4 = ["dp_accumulation", "dp_one_group_astray", "dp_tokens_per_replica", "dp_evaluate",
      "dp_sft_packing", "hybrid"]
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


def _tensors_close(got: dict, want: dict, rtol: float, what: str) -> None:
    """Each tensor within rtol of its largest reference entry."""
    assert got.keys() == want.keys(), f"{what}: {sorted(got.keys() ^ want.keys())}"
    for name, ref in want.items():
        scale = ref.abs().max().item()
        assert scale > 0, f"{what}: reference {name} is zero: the test cannot fail"
        err = (got[name] - ref).abs().max().item()
        assert err <= rtol * scale, f"{what}: {name} off by {err} (largest entry {scale})"


def assert_matches(got: dict, want: dict, what: str, loss_rtol: float = 1e-5,
                   exact: bool = True) -> None:
    """The context-parallel run equals the reference: logged losses per step (the same on every
    rank), step-1 gradients, final weights, counters; eval loss and predictions if present."""
    assert len(got["loss"]) == len(want["loss"]) > 0, (what, got["loss"], want["loss"])
    for step, (a, b) in enumerate(zip(got["loss"], want["loss"])):
        assert _close(a, b, loss_rtol), f"{what}: step {step + 1} loss {a} vs {b}"
    assert all(r == got["loss"] for r in got["loss_every_rank"]), (what, got["loss_every_rank"])
    if exact:
        for step, (a, b) in enumerate(zip(got["grad_norm"], want["grad_norm"])):
            assert _close(a, b, 1e-4), f"{what}: step {step + 1} grad norm {a} vs {b}"
        _tensors_close(got["grads"], want["grads"], 1e-4, f"{what} step-1 gradients")
        _tensors_close(got["weights"], want["weights"], 1e-4, f"{what} final weights")
    for key in ("tokens", "global_batch"):
        assert got[key] == want[key], (what, key, got[key], want[key])
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
    naming a correct path."""
    got = runs[1]["refusals"]
    expected = {"sdpa": "attn_implementation=cpattn.integrations.transformers.register(cp)",
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
    matches the same trainer in one process."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(EXAMPLES, example), "--check"],
        capture_output=True, text=True, env=_env(), timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
    assert "check passed" in result.stdout, result.stdout[-5000:]
