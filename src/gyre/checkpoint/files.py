"""Durable local files of a checkpoint (or a model folder): fsync, sha256 manifests and their
verification, atomic directory replacement and atomic small-file writes.

Everything here works on a local folder; :mod:`gyre.checkpoint.store` stages a checkpoint in one
(also when its root is an object store) and commits it with these helpers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gyre
from gyre.errors import InputError

MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = 1


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest_files(root: Path) -> list[str]:
    """Every file under ``root`` but the manifest, as sorted ``/``-separated relative paths."""
    return sorted(
        str(p.relative_to(root)).replace(os.sep, "/")
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    )


def write_manifest(root: Path, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Hash every file under ``root`` into ``root/manifest.json``; return the manifest."""
    files = {
        rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
        for rel in manifest_files(root)
    }
    manifest = {"format": FORMAT_VERSION, "gyre_version": gyre.__version__, **extra, "files": files}
    (root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1))
    return manifest


def verify_dir(root: Path) -> list[str]:
    """Problems with a local checkpoint folder (empty list: it verifies)."""
    mpath = root / MANIFEST_FILE
    if not mpath.is_file():
        return [f"no {MANIFEST_FILE} (incomplete write)"]
    try:
        manifest = json.loads(mpath.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as exc:
        return [f"unreadable {MANIFEST_FILE}: {exc}"]
    problems = []
    for rel, meta in files.items():
        p = root / rel
        if not p.is_file():
            problems.append(f"{rel} missing")
        elif p.stat().st_size != meta["size"]:
            problems.append(f"{rel} has {p.stat().st_size} bytes, manifest says {meta['size']}")
        elif sha256_file(p) != meta["sha256"]:
            problems.append(f"{rel} sha256 mismatch")
    return problems


def check_manifest(root: Path) -> None:
    """A folder someone asks to load (``gyre eval``, ``gyre export``): when it has a
    ``manifest.json`` (or is a checkpoint's ``model/``), every file listed must match, else an
    :class:`InputError` in one line. A folder without one (a model from elsewhere) loads as is."""
    root = Path(root)
    if not (root / MANIFEST_FILE).is_file():
        parent = root.parent  # a checkpoint's model/: the checkpoint's manifest covers it
        if root.name == "model" and (parent / MANIFEST_FILE).is_file():
            root = parent
        else:
            return
    problems = verify_dir(root)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise InputError(
            f"{root / MANIFEST_FILE} does not match the folder: {'; '.join(problems[:3])}{more}"
        )


def replace_dir_atomically(stage: Path, final: Path) -> None:
    """Rename ``stage`` to ``final`` (replacing it), fsyncing the parent directory."""
    old = final.parent / f".old_{final.name}"
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    stage.rename(final)
    _fsync_path(final.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


def write_file_atomically(path: Path, text: str) -> None:
    """Write a small text file via tmp + fsync + rename."""
    tmp = path.parent / f".tmp_{path.name}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)
