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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import torch

import gyre
from gyre.errors import InputError, disk_full_message, is_disk_full

log = logging.getLogger("gyre.checkpoint.store")

STATE_FILE = "state.json"
MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
FORMAT_VERSION = 1
GRPO_PREFIX = "step_"
SFT_PREFIX = "sft_"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names it."""


class CheckpointMismatchError(ValueError):
    """The checkpoint belongs to a different config or model; the message lists the fields."""


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
# GYRE_FAULT="env.step:raise" (every env step raises: failed episodes). Ray actors inherit it.
_FAULT_HOOKS: dict[str, Callable[[], None]] = {}


def set_fault_hook(point: str, hook: Callable[[], None] | None) -> None:
    """Run ``hook`` whenever the named fault point is reached (None removes it)."""
    if hook is None:
        _FAULT_HOOKS.pop(point, None)
    else:
        _FAULT_HOOKS[point] = hook


def fault_point(point: str) -> None:
    """A place where a fault may be injected; does nothing in a normal run."""
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
    if action.startswith("pause="):
        import time

        seconds, _, marker = action[len("pause=") :].partition(":")
        if marker:
            Path(marker).touch()
        time.sleep(float(seconds))


# -- storage -----------------------------------------------------------------------------------
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


def _files(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)).replace(os.sep, "/")
        for p in root.rglob("*")
        if p.is_file() and p.name != MANIFEST_FILE
    )


def write_manifest(root: Path, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Hash every file under ``root`` into ``root/manifest.json``; return the manifest."""
    files = {
        rel: {"sha256": sha256_file(root / rel), "size": (root / rel).stat().st_size}
        for rel in _files(root)
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


def _replace_dir_atomically(stage: Path, final: Path) -> None:
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


ENV_RECORD = "gyre_env.json"  # in sft/ and final/: the env (and stop) config it was trained on


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
        tokenizer.save_pretrained(stage)
        if trained_on is not None:
            (stage / ENV_RECORD).write_text(json.dumps(trained_on, indent=2, sort_keys=True))
        fault_point("model.write")
        write_manifest(stage, {"kind": "model"})
        fsync_tree(stage)
        _replace_dir_atomically(stage, final)
    except Exception as exc:
        message = _write_failure(exc, final, stage)
        shutil.rmtree(stage, ignore_errors=True)
        raise CheckpointError(message) from exc
    return final


def write_file_atomically(path: Path, text: str) -> None:
    """Write a small text file via tmp + fsync + rename."""
    tmp = path.parent / f".tmp_{path.name}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


class CheckpointStore:
    """A checkpoint root on any fsspec filesystem: list, write, verify, fetch, prune."""

    def __init__(self, url: str | Path) -> None:
        self.url = str(url)
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
                _replace_dir_atomically(stage, Path(self.path(name)))
            else:
                self._upload(stage, name)
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
        for rel in _files(stage):
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


# -- what goes into a checkpoint ---------------------------------------------------------------
def seed_everything(seed: int) -> None:
    """Python, numpy and torch global RNGs from the run seed (what a checkpoint's RNG state
    restores, see :func:`capture_rng`)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Global generators plus named ones (torch.Generator or numpy Generator)."""
    out: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    named = {}
    for key, g in (generators or {}).items():
        if isinstance(g, torch.Generator):
            named[key] = {"kind": "torch", "state": g.get_state()}
        elif isinstance(g, np.random.Generator):
            named[key] = {"kind": "numpy", "state": g.bit_generator.state}
        else:
            raise TypeError(f"generator {key!r} has unsupported type {type(g).__name__}")
    out["named"] = named
    return out


def restore_rng(saved: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    random.setstate(saved["python"])
    np.random.set_state(saved["numpy"])
    torch.set_rng_state(saved["torch"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])
    named = saved.get("named", {})
    for key, g in (generators or {}).items():
        if key not in named:
            raise CheckpointError(f"checkpoint has no state for generator {key!r}")
        if isinstance(g, torch.Generator):
            g.set_state(named[key]["state"])
        else:
            g.bit_generator.state = named[key]["state"]


@dataclass
class Snapshot:
    """What one checkpoint holds besides the model (kept together so call sites stay short)."""

    step: int
    state: dict[str, Any]
    optimizer: torch.optim.Optimizer
    scheduler: Any = None
    generators: Mapping[str, Any] | None = None
    config: Mapping[str, Any] | None = None
    config_hash: str = ""
    phase: str = "grpo"
    # Writes more files into the staged checkpoint folder (e.g. a PPO value model), so they are
    # covered by the manifest and the atomic rename like everything else.
    extra: Callable[[Path], None] | None = None


def save(
    store: CheckpointStore,
    name: str,
    model: torch.nn.Module,
    tokenizer: Any,
    snap: Snapshot,
) -> str:
    """Write one checkpoint atomically (see the module docstring); return its path.

    A model with a nan/inf tensor is refused (:class:`NonFiniteError`) before anything is
    written: a poisoned checkpoint would verify and be resumed from."""
    check_finite(model, store.url_of(name))

    def fill(d: Path) -> None:
        model.save_pretrained(d / "model")
        tokenizer.save_pretrained(d / "model")
        torch.save(snap.optimizer.state_dict(), d / "optimizer.pt")
        if snap.scheduler is not None:
            torch.save(snap.scheduler.state_dict(), d / "scheduler.pt")
        torch.save(capture_rng(snap.generators), d / "rng.pt")
        state = {**snap.state, "step": snap.step, "phase": snap.phase}
        (d / STATE_FILE).write_text(json.dumps(state, indent=1))
        if snap.config is not None:
            (d / CONFIG_FILE).write_text(json.dumps(snap.config, indent=1, sort_keys=True))
        if snap.extra is not None:
            snap.extra(d)

    extra = {"phase": snap.phase, "step": snap.step, "config_hash": snap.config_hash}
    return store.write(name, fill, extra)


def load_into(
    ckpt: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    generators: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore optimizer, scheduler and RNG states; return ``state.json`` (model loads apart)."""
    ckpt = Path(ckpt)
    state = json.loads((ckpt / STATE_FILE).read_text())
    optimizer.load_state_dict(torch.load(ckpt / "optimizer.pt", weights_only=True))
    if scheduler is not None:
        if not (ckpt / "scheduler.pt").is_file():
            raise CheckpointError(f"{ckpt} has no scheduler.pt but this phase uses a scheduler")
        scheduler.load_state_dict(torch.load(ckpt / "scheduler.pt", weights_only=False))
    restore_rng(torch.load(ckpt / "rng.pt", weights_only=False), generators)
    return state


# -- config identity ---------------------------------------------------------------------------
# Keys that may change between a checkpoint and its resume without changing the trajectory (or
# that only extend it, like train.steps). Every other key is part of the run's identity.
RESUME_MAY_CHANGE = (
    "run.dir",
    "run.resume",
    "run.overwrite",
    "run.threads",
    "run.device",
    "model.path",
    "engine.api_key",  # a secret (written as '***'): rotating it changes nothing
    "engine.api_key_file",
    "train.steps",
    "eval.",
    "checkpoint.",
    "log.",
    "faults.",
)


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The flattened config keys a resume must match."""
    return {
        k: v
        for k, v in _flatten(config).items()
        if not any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUME_MAY_CHANGE)
    }


def config_hash(config: Mapping[str, Any]) -> str:
    blob = json.dumps(identity(config), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def diff_fields(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``key: checkpoint=X, now=Y`` for every differing key of two flat mappings."""
    missing = object()
    lines = []
    for k in sorted(set(saved) | set(now)):
        a, b = saved.get(k, missing), now.get(k, missing)
        if a != b:
            fa = "<absent>" if a is missing else repr(a)
            fb = "<absent>" if b is missing else repr(b)
            lines.append(f"{k}: checkpoint={fa}, now={fb}")
    return lines


def check_config(ckpt: Path, config: Mapping[str, Any]) -> None:
    """Raise :class:`CheckpointMismatchError` listing the identity keys that differ."""
    path = Path(ckpt) / CONFIG_FILE
    if not path.is_file():
        return
    saved = json.loads(path.read_text())
    diffs = diff_fields(identity(saved), identity(config))
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {ckpt} was written by a run with a different config:\n  "
            + "\n  ".join(diffs)
            + "\nrestore these values to resume it, or start a new run (another run.dir, "
            "or run.resume=never run.overwrite=true)"
        )


# Model config keys that say nothing about the weights' shape or meaning.
_MODEL_KEYS_IGNORED = {
    "transformers_version",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "architectures",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
}


def check_model(ckpt_model: Path, base_model: Path) -> None:
    """The checkpoint's model must have the architecture of ``model.path``; list differences."""
    a, b = Path(ckpt_model) / "config.json", Path(base_model) / "config.json"
    if not (a.is_file() and b.is_file()):
        return
    ca, cb = json.loads(a.read_text()), json.loads(b.read_text())
    diffs = diff_fields(
        {k: v for k, v in ca.items() if k not in _MODEL_KEYS_IGNORED},
        {k: v for k, v in cb.items() if k not in _MODEL_KEYS_IGNORED},
    )
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint model {ckpt_model} does not match model.path {base_model}:\n  "
            + "\n  ".join(diffs)
        )


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


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    keep: int,
    keep_every: int = 0,
    scheduler: Any = None,
    generators: Mapping[str, Any] | None = None,
) -> Path:
    """Save a GRPO checkpoint under ``<run_dir>/checkpoints`` and apply retention."""
    store = CheckpointStore(checkpoint_dir(run_dir))
    snap = Snapshot(step, dict(state), optimizer, scheduler, generators)
    path = save(store, f"{GRPO_PREFIX}{step:06d}", model, tokenizer, snap)
    store.prune(GRPO_PREFIX, keep, keep_every)
    return Path(path)


def load_checkpoint_state(
    ckpt: Path,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    generators: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return load_into(ckpt, optimizer, scheduler, generators)


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
