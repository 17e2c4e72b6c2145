"""Which source files one call crosses: the Python files of cpattn it runs (traced) and, with a
coverage build of the extension, the C++ files and headers whose lines it runs (gcov).

Two paths (README §11), W = 2 gloo ranks, forward and backward, rank 0 recorded:
  ring    cpattn.ring_attention(q, k, v, causal=True, layout="zigzag") on CPU tensors;
  packed  a packed batch of three documents (cpattn.shard_batch) through a tiny Llama whose
          attention is cpattn's transformers integration (strategy ring).

    python bench/files_crossed.py --path ring packed                # Python files only
    python bench/files_crossed.py --path ring packed --gcov-build B # and C++: B = the build folder
                                                                    # of a --coverage build

C++ files are counted by difference: the same script runs once with the call and once without
(import, group, inputs, model alike) and a file counts when the call ran any of its lines more
often. The coverage build: `pip install --no-build-isolation --no-deps --target SITE
-Cbuild-dir=B -Ccmake.define.CMAKE_CXX_FLAGS=--coverage
-Ccmake.define.CMAKE_SHARED_LINKER_FLAGS=--coverage .` then PYTHONPATH=SITE.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading

import torch


def _ring():
    """The ring path's inputs; returns the call."""
    import cpattn

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 64, 4, 32, requires_grad=True) for _ in range(3))

    def call() -> None:
        out = cpattn.ring_attention(q, k, v, causal=True, layout="zigzag")
        out.sum().backward()

    return call


def _packed():
    """The packed path's model and batch (made, not run); returns the call."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, LlamaConfig

    import cpattn
    from cpattn.integrations.transformers import register

    cp = cpattn.ContextParallel(dist.group.WORLD, strategy="ring")
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=register(cp))
    ids = torch.randint(0, 64, (1, 96))
    lengths = [40, 24, 32]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    batch = cpattn.shard_batch({"input_ids": ids, "labels": ids, "position_ids": position_ids},
                               cp)
    labels = batch.pop("shift_labels")

    def call() -> None:
        logits = model(**batch, use_cache=False).logits
        cpattn.cross_entropy(logits, labels, cp).backward()

    return call


PATHS = {"ring": _ring, "packed": _packed}


def _python_files(call) -> list[str]:
    """The cpattn files whose Python code runs while call() does."""
    import cpattn

    root = str(pathlib.Path(cpattn.__file__).parent)
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(os.path.relpath(frame.f_code.co_filename, root))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return sorted(seen)


def _rank(rank: int, world: int, path: str) -> list[str]:
    return _python_files(PATHS[path]())


def _child_rank(rank: int, world: int, init_file: str, path: str, call: bool) -> None:
    """A rank of a gcov run: it leaves through the interpreter's normal exit, which writes the
    coverage counts (run_ranks' ranks leave without it)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    run = PATHS[path]()
    if call:
        run()
    dist.destroy_process_group()


def _gcov_lines(build: pathlib.Path) -> dict[str, dict[int, int]]:
    """source file -> line -> count, from the .gcda files under build."""
    counts: dict[str, dict[int, int]] = {}
    for gcda in build.rglob("*.gcda"):
        out = subprocess.run(["gcov", "--json-format", "--stdout", str(gcda)], cwd=gcda.parent,
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if not line.startswith("{"):
                continue
            for f in json.loads(line)["files"]:
                mine = counts.setdefault(f["file"], {})
                for ln in f["lines"]:
                    mine[ln["line_number"]] = mine.get(ln["line_number"], 0) + ln["count"]
    return counts


def _cpp_files(path: str, build: pathlib.Path) -> list[str]:
    """The csrc/ files whose lines the call runs: one run with it, one without, compared."""
    runs = []
    for call in (False, True):
        for gcda in build.rglob("*.gcda"):
            gcda.unlink()
        subprocess.run([sys.executable, __file__, "--child", path, "--call", str(int(call))],
                       check=True)
        runs.append(_gcov_lines(build))
    without, with_call = runs
    crossed = set()
    for name, lines in with_call.items():
        if "/csrc/" not in name or "site-packages" in name:  # (torch's own csrc headers)
            continue
        base = without.get(name, {})
        if any(n > base.get(ln, 0) for ln, n in lines.items()):
            crossed.add(name[name.index("/csrc/") + 1:])
    return sorted(crossed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", nargs="+", choices=sorted(PATHS), default=sorted(PATHS))
    parser.add_argument("--gcov-build", type=pathlib.Path, default=None)
    parser.add_argument("--child", choices=sorted(PATHS), help=argparse.SUPPRESS)
    parser.add_argument("--call", type=int, default=1, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    from cpattn.testing.distributed import run_ranks

    if opts.child:  # one run for gcov
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_child_rank, args=(2, os.path.join(tmp, "rendezvous"), opts.child,
                                        bool(opts.call)), nprocs=2)
        return
    for path in opts.path:
        python = run_ranks(2, _rank, path, poison=False)[0]
        print(f"{path}: {len(python)} Python files: {' '.join(python)}")
        if opts.gcov_build is not None:
            cpp = _cpp_files(path, opts.gcov_build)
            print(f"{path}: {len(cpp)} C++ files: {' '.join(cpp)}")
            print(f"{path}: {len(python) + len(cpp)} files in all")


if __name__ == "__main__":
    main()
