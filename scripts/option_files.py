#!/usr/bin/env python3
"""The files whose code names an attention option: where a new option of its kind goes.

    python scripts/option_files.py softcap        # the library's files, then tests and docs
    python scripts/option_files.py softcap --count  # the number of library files only

Code only: Python comments and strings (docstrings) and C++ comments do not count, so a file
that only mentions the option in prose is left out. Run from anywhere inside the repository.
"""

import argparse
import io
import pathlib
import re
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
LIBRARY = ("csrc/", "python/cpattn/", "CMakeLists.txt")
CPP = (".h", ".cpp", ".cu", ".cuh")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    return out.split()


def python_code(text: str) -> str:
    """The source without comments and string literals."""
    kept = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type not in (tokenize.COMMENT, tokenize.STRING):
                kept.append(tok.string)
    except (tokenize.TokenError, IndentationError):
        return text
    return " ".join(kept)


def cpp_code(text: str) -> str:
    """The source without // and /* */ comments (string literals stay: schemas are code)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def names_option(path: str, option: str) -> bool:
    text = (ROOT / path).read_text(errors="replace")
    if path.endswith(".py"):
        text = python_code(text)
    elif path.endswith(CPP):
        text = cpp_code(text)
    return re.search(rf"\b{re.escape(option)}\b", text) is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("option")
    parser.add_argument("--count", action="store_true", help="print the library files' number")
    args = parser.parse_args()
    files = [f for f in tracked_files() if f.endswith((*CPP, ".py", ".md", ".txt"))]
    library = [f for f in files if f.startswith(LIBRARY) and names_option(f, args.option)]
    if args.count:
        print(len(library))
        return 0
    print(f"library ({len(library)} files):")
    print("".join(f"  {f}\n" for f in library), end="")
    rest = [f for f in files if f.startswith(("tests/", "docs/")) and names_option(f, args.option)]
    print(f"tests and docs ({len(rest)} files):")
    print("".join(f"  {f}\n" for f in rest), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
