"""Checkpoints: ``<checkpoint root>/step_000010/`` holding everything an exact resume needs.

The root is ``<run.dir>/checkpoints`` unless ``checkpoint.dir`` names another place, which may be
any fsspec URL (``file://``, ``memory://`` in tests, ``s3://...`` once ``s3fs`` is installed).

Contents of one checkpoint:

- ``model/``: a Hugging Face folder (safetensors weights + config + tokenizer);
- ``optimizer.pt`` and, when the phase has one, ``scheduler.pt``;
- ``rng.pt``: python, numpy, torch (and CUDA) global generators plus every named generator the
  loop hands in (engine sampler, data order ...);
- ``state.json``: step, phase, policy version, data cursor and epoch, fault counters, metrics
  offset, earlier eval results -- whatever the phase needs to continue identically;
- ``config.json``: the resolved run config, to explain a mismatch field by field;
- ``manifest.json`` (written last): format, gyre version, phase, step, config hash and the sha256
  and size of every other file.

Why a manifest: a checkpoint is only trusted if every file it lists is present with the recorded
hash. A kill mid-write, a torn copy or a flipped bit makes it fail verification, and ``auto``
resume falls back to the previous one with a warning that names the broken one.

Local writes go to ``.tmp_<name>/``; every file and directory is fsynced, then the directory is
renamed into place and the parent fsynced, so a crash (or power loss) leaves either the old
checkpoint set or the new one, never a half checkpoint under a ``step_*`` name. On object stores
(no atomic rename) the files are uploaded straight to ``<name>/`` with the manifest last: until
the manifest is there the checkpoint does not verify, which gives the same guarantee.

This module holds the store (list, write, verify, fetch, prune) and checkpoint selection. The
contents besides the model (optimizer, RNG, ``state.json``) are written and read by
:mod:`gyre.checkpoint.snapshot`, the manifest and fsync helpers are :mod:`gyre.checkpoint.files`,
and the config identity a resume must match is :mod:`gyre.checkpoint.identity`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import fsspec
import torch

from gyre.checkpoint.files import (
    MANIFEST_FILE,
    fsync_tree,
    manifest_files,
    replace_dir_atomically,
    verify_dir,
    write_manifest,
)
from gyre.config.loading import ENV_RECORD
from gyre.deadlines import PeerFault, call_with_deadline
from gyre.errors import disk_full_message, is_disk_full
from gyre.models.vision import save_tokenizer

log = logging.getLogger("gyre.checkpoint.store")

GRPO_PREFIX = "step_"
SFT_PREFIX = "sft_"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names it."""


class NonFiniteError(CheckpointError):
    """A model holds nan/inf values, so it is not written (it would pass its own checksum)."""


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """(name, count of nan/inf entries) of the first floating tensor that is not finite."""
    for name, t in named:
        if hasattr(t, "to_local"):  # an FSDP2 DTensor: this rank's shard
            t = t.to_local()
        if not t.is_floating_point():
            continue
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            return name, int(bad.sum())
    return None


def check_finite(model: torch.nn.Module, target: Path | str) -> None:
    """Refuse to write ``target`` from a model with a nan/inf tensor; the error names it."""
    found = first_nonfinite(model.state_dict().items())
    if found is not None:
        name, count = found
        raise NonFiniteError(
            f"refusing to write {target}: tensor '{name}' has {count} non-finite (nan/inf) values"
        )


def _write_failure(exc: BaseException, target: Path | str, stage: Path) -> str:
    """One line for a failed write; a full disk (whatever library wrote) says so."""
    if is_disk_full(exc, stage):
        return disk_full_message(target)
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"writing {target} failed: {first}"


# -- fault injection ---------------------------------------------------------------------------
# Tests (and ``gyre verify-resume``) need to fail or stall a checkpoint write at a known point.
# In-process tests register a callable; subprocesses use GYRE_FAULT="checkpoint.write:enospc",
# GYRE_FAULT="checkpoint.write:pause=SECONDS:MARKER_FILE" (the marker is created on arrival) or
# GYRE_FAULT="env.step:raise" (every env step raises: failed episodes) or
# GYRE_FAULT="rollout.weights:lost:MARKER_FILE" (the object to fetch was lost with its node,
# as Ray reports it: the first object fetched, named in the marker, stays lost; every other
# one is found). Ray actors inherit it.
_FAULT_HOOKS: dict[str, Callable[[], None]] = {}


def set_fault_hook(point: str, hook: Callable[[], None] | None) -> None:
    """Run ``hook`` whenever the named fault point is reached (None removes it)."""
    if hook is None:
        _FAULT_HOOKS.pop(point, None)
    else:
        _FAULT_HOOKS[point] = hook


def fault_point(point: str, key: str = "") -> None:
    """A place where a fault may be injected; does nothing in a normal run. ``key`` names what
    the point handles (the ``lost`` action loses one object for good)."""
    hook = _FAULT_HOOKS.get(point)
    if hook is not None:
        hook()
    spec = os.environ.get("GYRE_FAULT", "")
    if not spec.startswith(point + ":"):
        return
    action = spec[len(point) + 1 :]
    if action == "enospc":
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "(injected by GYRE_FAULT)")
    if action == "raise":
        raise RuntimeError(f"injected by GYRE_FAULT at {point}")
    if action.startswith("lost:"):
        marker = Path(action[len("lost:") :])
        if marker.exists() and marker.read_text() != key:
            return
        marker.write_text(key)
        from ray.exceptions import ObjectLostError

        raise ObjectLostError("f" * 56, None, f"(injected by GYRE_FAULT at {point})")
    if action.startswith("pause="):
        import time

        seconds, _, marker = action[len("pause=") :].partition(":")
        if marker:
            Path(marker).touch()
        time.sleep(float(seconds))


# -- storage -----------------------------------------------------------------------------------
def write_model_dir(
    final: Path, model: torch.nn.Module, tokenizer: Any, trained_on: dict[str, Any] | None = None
) -> Path:
    """Save a Hugging Face folder (``sft/``, ``final/``) atomically, with a manifest.

    ``trained_on`` (``{"env": ..., "rollout": ...}`` config sections) goes to ``gyre_env.json``,
    so ``gyre eval`` / ``gyre train`` on this folder use the env it was trained on.
    """
    final = Path(final)
    check_finite(model, final)
    final.parent.mkdir(parents=True, exist_ok=True)
    stage = final.parent / f".tmp_{final.name}"
    if stage.exists():
        shutil.rmtree(stage)
    try:
        stage.mkdir()
        model.save_pretrained(stage)
        save_tokenizer(tokenizer, stage)  # a VLM's: with its image processor
        if trained_on is not None:
            (stage / ENV_RECORD).write_text(json.dumps(trained_on, indent=2, sort_keys=True))
        fault_point("model.write")
        write_manifest(stage, {"kind": "model"})
        fsync_tree(stage)
        replace_dir_atomically(stage, final)
    except Exception as exc:
        message = _write_failure(exc, final, stage)
        shutil.rmtree(stage, ignore_errors=True)
        raise CheckpointError(message) from exc
    return final


class CheckpointStore:
    """A checkpoint root on any fsspec filesystem: list, write, verify, fetch, prune."""

    def __init__(self, url: str | Path, upload_timeout_s: float = 1800.0) -> None:
        self.url = str(url)
        self.upload_timeout_s = upload_timeout_s  # checkpoint.upload_timeout_s
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as exc:
            scheme = self.url.split("://", 1)[0]
            raise CheckpointError(
                f"cannot open checkpoint storage {self.url!r}: {exc} (for {scheme}:// install "
                f"its fsspec filesystem, e.g. pip install 'gyre[{scheme}]' for s3 or gcs)"
            ) from exc
        self.local = "file" in _protocols(self.fs)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def url_of(self, name: str) -> str:
        """Where checkpoint ``name`` is, as the user would write it (a path, or a URL)."""
        return self.path(name) if self.local else self.fs.unstrip_protocol(self.path(name))

    def local_path(self, name: str) -> Path:
        assert self.local
        return Path(self.path(name))

    def names(self, prefix: str = GRPO_PREFIX) -> list[str]:
        """Checkpoint names with ``prefix``, oldest first by step number (not by name or mtime).

        Every ``<prefix><int>`` directory counts, valid or not; :meth:`verify` decides.
        """
        if not self.fs.isdir(self.root):
            return []
        found = []
        for info in self.fs.ls(self.root, detail=True):
            name = info["name"].rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") != "directory" or not name.startswith(prefix):
                continue
            try:
                found.append((int(name[len(prefix) :]), name))
            except ValueError:
                continue
        return [n for _, n in sorted(found)]

    def write(
        self, name: str, fill: Callable[[Path], None], manifest_extra: Mapping[str, Any]
    ) -> str:
        """Create checkpoint ``name``: ``fill(folder)`` writes the files, then manifest + commit.

        On any error (a full disk included) the staging folder is removed and the previous
        checkpoints are untouched; the error is raised as :class:`CheckpointError`.
        """
        if self.local:
            root = Path(self.root)
            root.mkdir(parents=True, exist_ok=True)
            stage = root / f".tmp_{name}"
            cleanup: Callable[[], None] = lambda: shutil.rmtree(stage, ignore_errors=True)  # noqa: E731
        else:
            tmpdir = tempfile.mkdtemp(prefix="gyre-ckpt-")
            stage = Path(tmpdir) / name
            cleanup = lambda: shutil.rmtree(tmpdir, ignore_errors=True)  # noqa: E731
        try:
            if stage.exists():
                shutil.rmtree(stage)
            stage.mkdir(parents=True)
            fill(stage)
            fault_point("checkpoint.write")
            write_manifest(stage, manifest_extra)
            if self.local:
                fsync_tree(stage)
                replace_dir_atomically(stage, Path(self.path(name)))
            else:  # an object store: no timeout of its own, so a bounded call
                call_with_deadline(
                    lambda: self._upload(stage, name),
                    "storage",
                    "checkpoint upload",
                    self.url_of(name),
                    self.upload_timeout_s,
                    "checkpoint.upload_timeout_s",
                )
        except PeerFault:
            cleanup()  # a hung store is a storage fault (exit 69), not a failed write
            raise
        except BaseException as exc:
            message = _write_failure(exc, f"checkpoint {self.url_of(name)}", stage)
            cleanup()
            if isinstance(exc, Exception):
                raise CheckpointError(f"{message}; the earlier checkpoints are intact") from exc
            raise
        if not self.local:
            cleanup()
        return self.url_of(name)

    def _upload(self, stage: Path, name: str) -> None:
        dest = self.path(name)
        if self.fs.exists(dest):
            # Invalidate first: without its manifest the old copy can never verify half-replaced.
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(f"{dest}/{MANIFEST_FILE}")
            self.fs.rm(dest, recursive=True)
        for rel in manifest_files(stage):
            self.fs.makedirs(f"{dest}/{rel}".rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(stage / rel), f"{dest}/{rel}")
        self.fs.put_file(str(stage / MANIFEST_FILE), f"{dest}/{MANIFEST_FILE}")

    def fetch(self, name: str, cache: Path) -> Path:
        """A local folder holding checkpoint ``name`` (itself when local, else a download)."""
        if self.local:
            return Path(self.path(name))
        dest = Path(cache) / name
        if dest.exists():
            shutil.rmtree(dest)
        src = self.path(name)
        for path in self.fs.find(src):
            rel = path[len(src.rstrip("/")) + 1 :]
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(dest / rel))
        return dest

    def verify(self, name: str, cache: Path) -> tuple[Path | None, list[str]]:
        """(local folder, []) when checkpoint ``name`` verifies, else (None, problems)."""
        try:
            local = self.fetch(name, cache)
        except OSError as exc:
            return None, [f"cannot read: {exc}"]
        problems = verify_dir(local)
        return (None, problems) if problems else (local, [])

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(name), recursive=True)

    def prune(self, prefix: str, keep: int, keep_every: int = 0) -> list[str]:
        """Retention: keep the newest ``keep`` plus every step divisible by ``keep_every``."""
        names = self.names(prefix)
        doomed = [
            n
            for n in names[: max(len(names) - keep, 0)]
            if not (keep_every and int(n[len(prefix) :]) % keep_every == 0)
        ]
        for n in doomed:
            self.remove(n)
        return doomed

    def clean_staging(self) -> None:
        """Tidy up after a write that was killed: drop ``.tmp_*`` staging folders; put back an
        ``.old_<name>`` whose replacement never got renamed in (a re-save of the same step)."""
        if not self.local or not Path(self.root).is_dir():
            return
        for p in Path(self.root).iterdir():
            if not p.is_dir():
                continue
            if p.name.startswith(".old_"):
                final = p.parent / p.name[len(".old_") :]
                if final.exists():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.rename(final)
            elif p.name.startswith(".tmp_"):
                shutil.rmtree(p, ignore_errors=True)


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


# -- selection ---------------------------------------------------------------------------------
def newest_valid(store: CheckpointStore, prefix: str, cache: Path) -> tuple[str, Path] | None:
    """The newest checkpoint with ``prefix`` that verifies; broken ones are warned about."""
    for name in reversed(store.names(prefix)):
        local, problems = store.verify(name, cache)
        if local is not None:
            return name, local
        log.warning(
            "skipping checkpoint %s: %s; trying the previous one",
            store.url_of(name),
            "; ".join(problems[:3]),
        )
    return None


# -- compatibility helpers (run-dir based, the pre-manifest API) -------------------------------
def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """GRPO checkpoint folders under ``<run_dir>/checkpoints`` that have a manifest, oldest first.

    Presence of the manifest only (cheap); :func:`find_resume` verifies the hashes.
    """
    store = CheckpointStore(checkpoint_dir(run_dir))
    return [
        store.local_path(n)
        for n in store.names(GRPO_PREFIX)
        if (store.local_path(n) / MANIFEST_FILE).is_file()
    ]


def find_resume(run_dir: Path, resume: str) -> Path | None:
    """Which GRPO checkpoint under ``<run_dir>/checkpoints`` to resume from (None: fresh)."""
    if resume == "never":
        return None
    store = CheckpointStore(checkpoint_dir(run_dir))
    if resume == "auto":
        found = newest_valid(store, GRPO_PREFIX, Path(run_dir))
        return found[1] if found else None
    p = Path(resume)
    problems = verify_dir(p) if p.is_dir() else ["not a directory"]
    if problems:
        raise FileNotFoundError(
            f"run.resume='{resume}' is not a valid checkpoint: {'; '.join(problems)}"
        )
    return p


def iter_names(store: CheckpointStore, prefixes: Iterable[str]) -> list[str]:
    return [n for p in prefixes for n in store.names(p)]
