"""The repository's tracked files, for the checks that scan all of them."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tracked_text_files() -> list[Path]:
    """Every file git tracks in the repository that decodes as UTF-8 text."""
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    files = []
    for rel in filter(None, out.split("\0")):
        path = ROOT / rel
        if not path.is_file():
            continue  # deleted in the working tree, not yet committed
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary (an image, a checkpoint)
        files.append(path)
    return files
