"""Every ```python block of README.md runs as written, in order, in one script under torchrun
with 2 gloo ranks (the README's training and inference code is distributed): the names the
README leaves to the reader are a tiny Llama saved from a config (`name`) and a list of tokenized
documents (`ds`). What the comments claim is checked after the blocks that claim it (tensors the
same on every rank, the loss the same on every rank). The bash blocks (install, scripts/run.sh)
are not run here: CI runs them.

    torchrun --standalone --nproc-per-node 2 tests/test_readme.py --name DIR --out result.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import traceback

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
README = os.path.join(HERE, "..", "README.md")
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
TIMEOUT = 900


def python_blocks() -> list[str]:
    with open(README) as f:
        return BLOCK.findall(f.read())


def _documents(vocab: int) -> list[dict]:
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 61, (16,), generator=g).tolist()
    return [{"input_ids": torch.randint(vocab, (n,), generator=g).tolist()} for n in lengths]


def _same_on_every_rank(value) -> bool:
    import torch
    import torch.distributed as dist

    value = torch.as_tensor(value).detach().double().contiguous()
    every = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(every, value)
    return all(torch.equal(v, value) for v in every)


# What the blocks' comments claim, checked after the block that claims it (by a name it binds).
CLAIMS = {
    "full_out": lambda ns: _same_on_every_rank(ns["q_full"]) and _same_on_every_rank(
        ns["full_out"]),
    "loss": lambda ns: _same_on_every_rank(ns["loss"]) and _same_on_every_rank(ns["ids"]),
    "trainer": lambda ns: ns["trainer"].state.global_step > 0 and _same_on_every_rank(
        [h["loss"] for h in ns["trainer"].state.log_history if "loss" in h]),
    "cache": lambda ns: _same_on_every_rank(ns["out"]) and ns["out"].shape[1] == 1,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True, help="the tiny model's folder")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from transformers import AutoConfig

    namespace = {"name": opts.name, "ds": _documents(AutoConfig.from_pretrained(
        opts.name).vocab_size)}
    done: list[str] = []
    try:
        for i, code in enumerate(python_blocks()):
            exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)
            claims = [k for k in CLAIMS if re.search(rf"^{k}\b\s*=", code, re.M)]
            broken = [k for k in claims if not CLAIMS[k](namespace)]
            done.append("ok" if not broken else f"claims do not hold: {broken}")
    except BaseException:
        done.append(traceback.format_exc())
    if dist.get_rank() == 0:
        with open(opts.out, "w") as f:
            json.dump(done, f)
    sys.stdout.flush()
    import cpattn

    cpattn.destroy_communicators()
    dist.destroy_process_group()
    os._exit(0)  # (no interpreter teardown: see cpattn.testing.distributed)


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[str]:
    """What each README python block gave on 2 ranks ('ok', or why not)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tmp = tmp_path_factory.mktemp("readme")
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, attention_dropout=0.0)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "tiny-llama")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.abspath(__file__), "--name", str(tmp / "tiny-llama"), "--out",
         str(tmp / "result.json")],
        capture_output=True, text=True, env=env, timeout=TIMEOUT, cwd=tmp)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
    with open(tmp / "result.json") as f:
        return json.load(f)


def test_readme_has_python_blocks():
    assert len(python_blocks()) >= 4, python_blocks()


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(ran, index):
    """README python block index + 1 ran as written after the ones before it, and what its
    comments claim holds."""
    assert index < len(ran), f"block {index + 1} did not run (an earlier one failed): {ran}"
    assert ran[index] == "ok", f"README python block {index + 1}:\n{ran[index]}"


if __name__ == "__main__":
    main()
