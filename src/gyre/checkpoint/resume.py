"""Surviving kills, preemption and bad input: the machinery the training loop calls.

- :class:`StopGuard`: SIGTERM / SIGINT set a flag the loop checks at its safe points (the end of
  an SFT or GRPO step); the loop then writes a checkpoint and raises :class:`Preempted`, which
  the CLI turns into exit code :data:`EXIT_PREEMPTED`. A second signal exits at once with
  :data:`EXIT_ABORTED`: checkpoints are renamed into place atomically and metrics lines are
  repaired on resume, so an abort never corrupts what is on disk.
- :class:`TaskCursor`: the data position (index within the epoch, epoch, items consumed) for a
  finite dataset in a seeded per-epoch order, or for an endless procedural task stream.
- :class:`Checkpointer`: one object the loop asks to save (phase-aware names, metrics offset,
  retention, the ``checkpoint.on_error`` policy) and to plan a resume.
- :func:`rewind_metrics`: cut a JSONL metrics file back to the byte offset a checkpoint recorded
  (dropping steps that will be recomputed, and any torn last line).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, Literal

import numpy as np
import torch

from gyre.checkpoint.files import MANIFEST_FILE, verify_dir
from gyre.checkpoint.identity import check_config, check_model, config_hash
from gyre.checkpoint.snapshot import STATE_FILE, Snapshot, save
from gyre.checkpoint.store import (
    GRPO_PREFIX,
    SFT_PREFIX,
    CheckpointError,
    CheckpointStore,
    NonFiniteError,
    newest_valid,
)

log = logging.getLogger("gyre.checkpoint.resume")

EXIT_OK = 0
EXIT_ERROR = 1  # bad input, failed checkpoint write with checkpoint.on_error=stop, ...
EXIT_CONFIG = 2  # config error (nothing ran)
EXIT_FAULTS = 3  # aborted by a fault policy: too many non-finite steps or failed episodes
EXIT_PREEMPTED = 75  # stopped on SIGTERM/SIGINT after writing a checkpoint (EX_TEMPFAIL)
EXIT_ABORTED = 130  # second signal: exited at once, without a new checkpoint


class Preempted(Exception):
    """Training stopped on a signal after writing the checkpoint ``path``."""

    def __init__(self, signame: str, phase: str, step: int, path: str) -> None:
        super().__init__(
            f"stopped on {signame} during {phase} step {step}; checkpoint {path}; "
            "continue with run.resume=auto"
        )
        self.signame, self.phase, self.step, self.path = signame, phase, step, path


class FaultAbort(RuntimeError):
    """A fault policy (``faults.*``) stopped the run; the message says which and why."""


# -- signals -----------------------------------------------------------------------------------
class StopGuard:
    """Turn SIGTERM/SIGINT into a stop request while active (a context manager).

    Only installs handlers in the main thread (signals cannot be handled elsewhere); in other
    threads it is inert. The previous handlers are restored on exit.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signame: str | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signame is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signame is not None:
            os.write(2, f"\ngyre: second {name}: aborting now, without a new checkpoint\n".encode())
            os._exit(EXIT_ABORTED)
        self.signame = name
        os.write(
            2,
            f"\ngyre: {name} received: stopping at the end of this step after a "
            "checkpoint (send it again to abort at once)\n".encode(),
        )

    def __enter__(self) -> StopGuard:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


# -- data position -----------------------------------------------------------------------------
class TaskCursor:
    """Where the data stream is: ``(epoch, pos)`` plus ``consumed`` items in total.

    ``size=None``: an endless procedural stream (task ``i`` is seed ``i``); the epoch stays 0.
    ``size=N``: a finite dataset read in a fresh seeded permutation each epoch. The permutation
    of an epoch is drawn lazily when its first item is taken, so a cursor saved exactly at an
    epoch boundary holds ``pos == size`` of the finished epoch and the next take starts the next
    epoch -- nothing skipped, nothing replayed, no empty epoch. The state is a few integers and
    the generator state before the current permutation was drawn (the permutation itself is
    never stored, so it stays small for any dataset size).
    """

    def __init__(self, size: int | None, rng: np.random.Generator | None = None) -> None:
        if size is not None and size <= 0:
            raise ValueError(f"TaskCursor needs a positive dataset size, got {size}")
        self.size = size
        self.rng = rng if rng is not None else np.random.default_rng(0)
        self.epoch = 0
        self.pos = 0
        self.consumed = 0
        self._perm: np.ndarray | None = None
        self._perm_rng_state: dict[str, Any] | None = None
        if size is not None:
            self._draw()

    def _draw(self) -> None:
        self._perm_rng_state = self.rng.bit_generator.state
        self._perm = self.rng.permutation(self.size)

    def take(self, n: int) -> list[int]:
        """The next ``n`` item indices (crossing epoch boundaries as needed)."""
        out = []
        for _ in range(n):
            if self.size is None:
                out.append(self.consumed)
            else:
                if self.pos == self.size:
                    self._draw()
                    self.epoch += 1
                    self.pos = 0
                assert self._perm is not None
                out.append(int(self._perm[self.pos]))
                self.pos += 1
            self.consumed += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "size": self.size,
            "epoch": self.epoch,
            "pos": self.pos if self.size is not None else self.consumed,
            "consumed": self.consumed,
            "perm_rng_state": self._perm_rng_state,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("size") != self.size:
            raise CheckpointError(
                f"data size changed: checkpoint cursor is over {state.get('size')} items, "
                f"this run has {self.size}"
            )
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        if self.size is None:
            self.pos = self.consumed
            return
        self.rng.bit_generator.state = state["perm_rng_state"]
        self._draw()
        self.pos = int(state["pos"])


# -- derived data cache ------------------------------------------------------------------------
def cached(path: Path, key: Mapping[str, Any], build: Callable[[], Any]) -> Any:
    """``build()``'s result, kept in ``path`` for the same ``key`` (deterministic data only).

    SFT demonstrations take tens of seconds to generate and are a pure function of the config;
    caching them makes a resume reach its first step in seconds. A different key (config
    change) or an unreadable file rebuilds.
    """
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()
    if path.is_file():
        try:
            saved = torch.load(path, weights_only=False)
            if saved.get("key") == digest:
                return saved["value"]
        except Exception as exc:  # a torn or foreign file: rebuild it
            log.warning("ignoring cache %s (%s); rebuilding", path, exc)
    value = build()
    tmp = path.parent / f".tmp_{path.name}"
    torch.save({"key": digest, "value": value}, tmp)
    os.replace(tmp, path)
    return value


# -- metrics files -----------------------------------------------------------------------------
def durable_size(path: Path) -> int:
    """fsync ``path`` (through any descriptor: fsync acts on the file) and return its size."""
    if not path.is_file():
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def rewind_metrics(path: Path, offset: int) -> None:
    """Cut ``path`` back to ``offset`` bytes (the size the checkpoint saw), then drop a torn tail.

    Lines past the offset belong to steps after the checkpoint: the resumed run recomputes and
    re-logs them, so each step ends up in the file exactly once.
    """
    if not path.is_file():
        return
    size = path.stat().st_size
    if size < offset:
        log.warning(
            "%s holds %d bytes but the checkpoint recorded %d; keeping what is there",
            path,
            size,
            offset,
        )
    elif size > offset:
        with open(path, "r+b") as f:
            f.truncate(offset)
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        log.warning("%s ends with a torn line (%d bytes); removing it", path, len(data) - cut)
        with open(path, "r+b") as f:
            f.truncate(cut)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


# -- checkpoint policy -------------------------------------------------------------------------
Phase = Literal["fresh", "sft", "grpo_start", "grpo"]


@dataclass
class ResumePlan:
    """Where a run starts: from scratch, inside SFT, at the start of GRPO, or inside GRPO."""

    phase: Phase
    ckpt: Path | None = None  # local folder of the checkpoint to load
    where: str = ""  # its path or URL, for messages
    state: dict[str, Any] = field(default_factory=dict)


# Everything a run writes into run.dir (what run.overwrite=true removes).
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "sft_metrics.jsonl",
    "sft",
    "final",
    "init",
    "summary.json",
    ".resume_cache",
    "sft_demos.pt",
)


class Checkpointer:
    """The loop's single handle on checkpointing, resume and the on-error policy."""

    def __init__(self, cfg: Any, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        url = cfg.checkpoint.dir or str(self.run_dir / "checkpoints")
        self.store = CheckpointStore(url, cfg.checkpoint.upload_timeout_s)
        self.cache = self.run_dir / ".resume_cache"
        self.config = cfg.model_dump(mode="json")
        self.config_hash = config_hash(self.config)
        self.failed_writes = 0
        self.stats: list[dict[str, Any]] = []
        # More files for every GRPO checkpoint of this handle, written into the staged folder
        # (so the manifest and the atomic rename cover them): the Ray runner's rollout buffer.
        self.also_write: list[Callable[[Path], None]] = []

    # -- fresh-run refusal ---------------------------------------------------------------------
    def holds_run(self) -> list[str]:
        """What in run.dir / the checkpoint root shows an earlier run (empty: nothing)."""
        found = [
            n
            for n in ("metrics.jsonl", "sft_metrics.jsonl", "sft", "final")
            if (self.run_dir / n).exists()
        ]
        n = len(self.store.names(GRPO_PREFIX)) + len(self.store.names(SFT_PREFIX))
        if n:
            found.insert(0, f"{n} checkpoint(s) in {self.store.url}")
        return found

    def check_fresh(self) -> None:
        """With run.resume=never, refuse a used directory unless run.overwrite=true."""
        if self.cfg.run.resume != "never":
            return
        found = self.holds_run()
        if not found:
            return
        if not self.cfg.run.overwrite:
            raise FileExistsError(
                f"run.dir '{self.run_dir}' already holds a run ({', '.join(found)}); pass "
                "run.resume=auto to continue it, run.overwrite=true to start over (deletes it), "
                "or choose a new run.dir"
            )
        log.warning("run.overwrite=true: deleting the earlier run in %s", self.run_dir)
        for name in RUN_OUTPUTS:
            p = self.run_dir / name
            if p.is_dir():
                shutil.rmtree(p)
            elif p.exists():
                p.unlink()
        for prefix in (GRPO_PREFIX, SFT_PREFIX):
            for n in self.store.names(prefix):
                self.store.remove(n)

    # -- resume --------------------------------------------------------------------------------
    def plan(self) -> ResumePlan:
        """Pick the starting point for run.resume (verifying hashes; see docs/operations.md)."""
        self.store.clean_staging()
        resume = self.cfg.run.resume
        if resume == "never":
            plan = ResumePlan("fresh")
        elif resume == "auto":
            plan = self._plan_auto()
        else:
            plan = self._plan_explicit(resume)
        if plan.ckpt is not None:
            check_config(plan.ckpt, self.config)
            if self.cfg.model.path:
                check_model(plan.ckpt / "model", Path(self.cfg.model.path))
            plan.state = json.loads((plan.ckpt / STATE_FILE).read_text())
        return plan

    def sft_done(self) -> bool:
        sft = self.run_dir / "sft"
        if not sft.is_dir():
            return False
        problems = verify_dir(sft)
        if problems:
            log.warning("ignoring %s: %s", sft, "; ".join(problems[:3]))
        return not problems

    def _plan_auto(self) -> ResumePlan:
        found = newest_valid(self.store, GRPO_PREFIX, self.cache)
        if found:
            return ResumePlan("grpo", found[1], self.store.url_of(found[0]))
        if self.cfg.sft.steps > 0:
            if self.sft_done():
                return ResumePlan("grpo_start", where=str(self.run_dir / "sft"))
            found = newest_valid(self.store, SFT_PREFIX, self.cache)
            if found:
                return ResumePlan("sft", found[1], self.store.url_of(found[0]))
        if self.holds_run():
            log.warning(
                "run.resume=auto: no valid checkpoint in %s; starting from scratch", self.store.url
            )
        return ResumePlan("fresh")

    def _plan_explicit(self, resume: str) -> ResumePlan:
        parent, _, name = resume.rstrip("/").rpartition("/")
        store = CheckpointStore(parent or ".")
        local, problems = store.verify(name, self.cache)
        if local is None:
            raise FileNotFoundError(
                f"run.resume='{resume}' is not a valid checkpoint: {'; '.join(problems)}"
            )
        phase = json.loads((local / STATE_FILE).read_text()).get("phase", "grpo")
        return ResumePlan("sft" if phase == "sft" else "grpo", local, resume)

    # -- saving --------------------------------------------------------------------------------
    def save(
        self, model: torch.nn.Module, tokenizer: Any, snap: Snapshot, metrics_path: Path
    ) -> str | None:
        """Write ``snap`` (its ``phase``: ``sft`` or ``grpo``) with the run's config, recording
        the metrics file's durable size, and prune old checkpoints.

        ``snap.extra(folder)`` writes additional files into the staged folder before the
        manifest.

        Returns its path, or None when the write failed and ``checkpoint.on_error=continue``.
        """
        phase, step = snap.phase, snap.step
        prefix = SFT_PREFIX if phase == "sft" else GRPO_PREFIX
        writers = [w for w in (snap.extra, *self.also_write) if w is not None]

        def write_more(folder: Path) -> None:
            for w in writers:
                w(folder)

        snap = replace(
            snap,
            state={**snap.state, "metrics_offset": durable_size(metrics_path)},
            config=self.config,
            config_hash=self.config_hash,
            extra=write_more if writers else None,
        )
        t0 = time.perf_counter()
        try:
            path = save(self.store, f"{prefix}{step:06d}", model, tokenizer, snap)
        except CheckpointError as exc:
            self.failed_writes += 1
            # (a nan/inf model is never "go on": the next write would be refused again)
            if self.cfg.checkpoint.on_error == "continue" and not isinstance(exc, NonFiniteError):
                log.warning("%s (checkpoint.on_error=continue: training goes on)", exc)
                return None
            raise
        self.stats.append(
            {
                "phase": phase,
                "step": step,
                "seconds": time.perf_counter() - t0,
                "bytes": self._size(path),
            }
        )
        self.store.prune(prefix, self.cfg.checkpoint.keep, self.cfg.checkpoint.keep_every)
        return path

    def _size(self, path: str) -> int:
        try:
            return int(
                sum(
                    m["size"]
                    for m in json.loads(self.store.fs.cat_file(f"{path}/{MANIFEST_FILE}"))[
                        "files"
                    ].values()
                )
            )
        except (OSError, ValueError, KeyError):
            return -1

    def summary(self) -> dict[str, Any]:
        """Checkpoint writes of this process: count, failures, mean seconds, last size."""
        grpo = [s for s in self.stats if s["phase"] == "grpo"] or self.stats
        return {
            "writes": len(self.stats),
            "failed_writes": self.failed_writes,
            "mean_write_s": float(np.mean([s["seconds"] for s in grpo])) if grpo else 0.0,
            "bytes": grpo[-1]["bytes"] if grpo else 0,
        }

    def drop_sft(self) -> None:
        """SFT checkpoints are useless once ``sft/`` is complete."""
        for n in self.store.names(SFT_PREFIX):
            self.store.remove(n)

    def close(self) -> None:
        if self.cache.is_dir():
            shutil.rmtree(self.cache, ignore_errors=True)


def preempt_if_requested(
    guard: StopGuard | None,
    phase: str,
    step: int,
    saved: str | None,
    save_now: Callable[[], str | None],
) -> None:
    """At a safe point: if a stop was requested, make sure a checkpoint exists and stop."""
    if guard is None or not guard.requested:
        return
    path = saved if saved is not None else save_now()
    if path is None:
        raise CheckpointError(f"stopping on {guard.signame} but the checkpoint write failed")
    raise Preempted(guard.signame or "signal", phase, step, path)


__all__ = [
    "EXIT_ABORTED",
    "EXIT_CONFIG",
    "EXIT_ERROR",
    "EXIT_FAULTS",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "MANIFEST_FILE",
    "Checkpointer",
    "FaultAbort",
    "Preempted",
    "ResumePlan",
    "StopGuard",
    "TaskCursor",
    "durable_size",
    "rewind_metrics",
]


def check_parameters_finite(model: torch.nn.Module, phase: str, step: int) -> None:
    """After an optimizer step: every trainable parameter must be finite, else the run stops
    (exit 3) before anything is synced or checkpointed. A finite loss can still take a step
    that overflows the weights (a huge learning rate); the skip-on-NaN guard cannot see that."""
    from gyre.checkpoint.store import first_nonfinite

    found = first_nonfinite((n, p) for n, p in model.named_parameters() if p.requires_grad)
    if found is not None:
        name, count = found
        raise FaultAbort(
            f"{phase} step {step}: after the optimizer step parameter '{name}' has {count} "
            "non-finite (nan/inf) values; stopping without a checkpoint (lower the learning "
            "rate, or resume from the last checkpoint: docs/operations.md, NaN policy)"
        )


def check_nonfinite(cfg: Any, streak: int, phase: str, step: int) -> None:
    """``faults.max_nonfinite_streak``: abort after that many skipped (NaN/inf) steps in a row."""
    if streak >= cfg.faults.max_nonfinite_streak:
        raise FaultAbort(
            f"{phase} step {step}: {streak} steps in a row had a NaN/inf loss or gradient "
            f"(faults.max_nonfinite_streak={cfg.faults.max_nonfinite_streak}); aborting"
        )


def check_failures(cfg: Any, failed: int, episodes: int, step: int) -> None:
    """``faults.max_failed_fraction``: abort when too many episodes so far raised in the env."""
    frac = failed / max(episodes, 1)
    if frac > cfg.faults.max_failed_fraction:
        raise FaultAbort(
            f"GRPO step {step}: {failed} of {episodes} episodes failed in the env ({frac:.1%} > "
            f"faults.max_failed_fraction={cfg.faults.max_failed_fraction}); see the logged "
            "tracebacks"
        )
