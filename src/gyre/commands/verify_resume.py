"""``gyre verify-resume``: prove that kill -9 + resume reproduces the uninterrupted run.

It runs the same config twice as ``python -m gyre.cli train`` subprocesses:

1. **straight**: start to finish, never interrupted;
2. **killed**: SIGKILLed at ``kills`` moments and resumed (``run.resume=auto``) after each,
   then run to the end. The moments are random -- once the metrics files reach a seeded line
   count (spread over SFT and GRPO, never the last few lines, so the run cannot finish first),
   plus a seeded fraction of a step -- except one, which is guaranteed to land *inside* a
   checkpoint write: that process stalls in the write (``GYRE_FAULT=checkpoint.write:pause``)
   after the files are written and before the manifest and the rename, and is killed there. One
   extra SIGTERM checks the preemption path (exit code 75) on the way.

Then it compares the two run directories: the SFT and final weights must be bit-identical, and
``metrics.jsonl`` / ``sft_metrics.jsonl`` must hold every step exactly once with identical values
(wall-clock keys ``time/*``, ``perf/*`` and any ``*_s`` duration excepted: they measure the
machine, not the run).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gyre.checkpoint.resume import EXIT_OK, EXIT_PREEMPTED
from gyre.engines.credentials import secrets_to_env

METRIC_FILES = ("sft_metrics.jsonl", "metrics.jsonl")
MODEL_DIRS = ("sft", "final")
VOLATILE_PREFIXES = ("time/", "perf/")
VOLATILE_SUFFIX = "_s"  # durations in seconds, e.g. sync/load_s


def _volatile(key: str) -> bool:
    return key.startswith(VOLATILE_PREFIXES) or key.endswith(VOLATILE_SUFFIX)


@dataclass
class Event:
    kind: str  # "random", "checkpoint-write", "sigterm"
    progress_lines: int  # metrics lines on disk when the signal was sent
    rc: int | None  # exit status (-9 for SIGKILL)


@dataclass
class VerifyReport:
    ok: bool
    kills: int
    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    straight_s: float = 0.0
    killed_s: float = 0.0
    workdir: str = ""

    def summary(self) -> str:
        lines = [
            f"straight run: {self.straight_s:.1f}s; killed run: {self.kills} SIGKILLs + resumes, "
            f"{self.killed_s:.1f}s in all (work dir {self.workdir})",
        ]
        for e in self.events:
            lines.append(f"  {e.kind:<17} after {e.progress_lines:>4} metrics lines -> rc {e.rc}")
        if self.ok:
            lines.append(
                "RESUME IS EXACT: weights bit-identical, every metrics step once, same values"
            )
        else:
            lines.append("RESUME MISMATCH:")
            lines.extend(f"  {p}" for p in self.problems)
        return "\n".join(lines)


def _progress(run_dir: Path) -> int:
    n = 0
    for name in METRIC_FILES:
        p = run_dir / name
        if p.is_file():
            n += p.read_bytes().count(b"\n")
    return n


class _ForkProc:
    """A ``gyre train`` in a forked child of this (already imported) process.

    The fast test variant uses it to skip the seconds of ``import torch`` per launch; the child
    is a separate process all the same, so SIGKILL hits it exactly as it hits a real one.
    """

    def __init__(self, argv: list[str], log: Path, extra_env: dict[str, str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child
            rc = 1
            try:
                fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.environ.update(extra_env)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                # exactly what ``python -m gyre.cli ARGV`` runs, in this already-imported process
                sys.argv = ["gyre", *argv]
                try:
                    runpy.run_module("gyre.cli", run_name="__main__", alter_sys=True)
                    rc = 0
                except SystemExit as done:
                    rc = (
                        done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
                    )
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(rc)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.perf_counter() + timeout
        while self.poll() is None:
            if end is not None and time.perf_counter() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _launch(
    args: list[str], run_dir: Path, log: Path, extra_env: dict[str, str], fork: bool = False
) -> Any:
    args, secret_env = secrets_to_env(args)  # an API key goes by environment, not argv
    extra_env = {**extra_env, **secret_env}
    argv = ["train", *args, f"run.dir={run_dir}", "log.console=off"]
    if fork:
        return _ForkProc(argv, log, extra_env)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **extra_env}
    with open(log, "ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "gyre.cli", *argv], stdout=f, stderr=subprocess.STDOUT, env=env
        )


def _wait(proc: Any, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=60)  # SIGKILLed: reaped at once
        raise RuntimeError(f"gyre train did not finish within {timeout:.0f}s") from None


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out.append({k: v for k, v in rec.items() if not _volatile(k)})
    return out


def compare_runs(a: Path, b: Path) -> list[str]:
    """Differences between two finished run dirs (empty: identical)."""
    import torch
    from safetensors.torch import load_file

    problems = []
    for d in MODEL_DIRS:
        fa, fb = a / d / "model.safetensors", b / d / "model.safetensors"
        if not fa.is_file() and not fb.is_file():
            continue
        if not (fa.is_file() and fb.is_file()):
            problems.append(f"{d}/model.safetensors missing in one run")
            continue
        wa, wb = load_file(fa), load_file(fb)
        if wa.keys() != wb.keys():
            problems.append(f"{d}: different tensor names")
            continue
        bad = [k for k in wa if not torch.equal(wa[k], wb[k])]
        if bad:
            problems.append(f"{d}: {len(bad)} tensors differ, e.g. {bad[0]}")
    for name in METRIC_FILES:
        ra, rb = _records(a / name), _records(b / name)
        steps = [r["step"] for r in rb if any(k.startswith(("train/", "sft/")) for k in r)]
        if len(steps) != len(set(steps)):
            problems.append(f"{name}: a training step is logged more than once in the killed run")
        if len(ra) != len(rb):
            problems.append(f"{name}: {len(ra)} records straight vs {len(rb)} killed")
        for i, (x, y) in enumerate(zip(ra, rb, strict=False)):
            if x != y:
                keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                problems.append(f"{name} record {i} (step {x.get('step')}) differs in {keys[:5]}")
                break
    return problems


def verify_resume(
    args: list[str],
    kills: int = 5,
    seed: int = 0,
    workdir: Path | None = None,
    timeout: float = 1800.0,
    echo: bool = False,
    fork: bool = False,
) -> VerifyReport:
    """Run ``gyre train *args`` straight and SIGKILLed ``kills`` times; compare the results.

    ``args`` are the ``gyre train`` arguments (an optional config file then key=value
    overrides); ``run.dir``, ``run.resume`` and ``log.console`` are set here. ``fork=True``
    forks this process for each launch instead of starting ``python -m gyre.cli`` (faster; the
    caller must already be single-threaded, as the test suite is).
    """
    if kills < 1:
        raise ValueError("verify-resume needs kills >= 1")
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="gyre-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    straight, killed = work / "straight", work / "killed"
    for d in (straight, killed):
        if d.exists():
            raise FileExistsError(f"{d} exists; give verify-resume an empty --workdir")
    report = VerifyReport(ok=False, kills=0, workdir=str(work))
    rng = np.random.default_rng(seed)

    def say(text: str) -> None:
        if echo:
            print(text, flush=True)

    # 1. the straight run, timing its steps to size the random kill delays
    say(f"[verify-resume] straight run in {straight}")
    t0 = time.perf_counter()
    proc = _launch(args, straight, work / "straight.log", {}, fork)
    first_progress = None
    while proc.poll() is None:
        if first_progress is None and _progress(straight) > 0:
            first_progress = time.perf_counter()
        time.sleep(0.05)
    report.straight_s = time.perf_counter() - t0
    if proc.returncode != EXIT_OK:
        report.problems.append(
            f"straight run failed (rc {proc.returncode}); see {work / 'straight.log'}"
        )
        return report
    lines = max(_progress(straight), 1)
    step_s = (time.perf_counter() - (first_progress or t0)) / lines

    # 2. the killed run
    t0 = time.perf_counter()
    log = work / "killed.log"
    run = _KilledRun(args, work, killed, log, timeout, fork, say)
    _kill_rounds(run, _kill_plan(rng, lines, kills), step_s, report, rng)
    say("[verify-resume] resuming to the end")
    proc = _launch([*args, "run.resume=auto"], killed, log, {}, fork)
    rc = _wait(proc, timeout)
    report.killed_s = time.perf_counter() - t0
    if rc != EXIT_OK:
        report.problems.append(f"final resume failed (rc {rc}); see {log}")
        return report
    if report.kills < kills:
        report.problems.append(
            f"only {report.kills} of {kills} kills landed before the run "
            "finished (use a longer run)"
        )
    report.problems.extend(compare_runs(straight, killed))
    report.ok = not report.problems
    return report


def _kill_plan(rng: np.random.Generator, lines: int, kills: int) -> list[tuple[str, int]]:
    """Random kills land after a seeded number of metrics lines (spread over SFT and GRPO, never
    in the last few lines so the run cannot finish first) plus a seeded part of a step; one kill
    lands inside a checkpoint write and one is a SIGTERM."""
    hi = max(lines - 3, kills)
    targets = sorted(int(t) for t in rng.choice(np.arange(1, hi + 1), kills - 1, replace=False))
    plan: list[tuple[str, int]] = [("random", t) for t in targets]
    plan.insert(int(rng.integers(0, len(plan) + 1)), ("checkpoint-write", 0))
    plan.insert(int(rng.integers(0, len(plan) + 1)), ("sigterm", 0))
    return plan


@dataclass(frozen=True)
class _KilledRun:
    """The run that is killed: its ``gyre train`` args, folders, log, limits and printer."""

    args: list[str]
    work: Path
    killed: Path
    log: Path
    timeout: float
    fork: bool
    say: Any


def _kill_rounds(
    run: _KilledRun,
    plan: list[tuple[str, int]],
    step_s: float,
    report: VerifyReport,
    rng: np.random.Generator,
) -> None:
    """Launch (resume=auto) and kill the run once per entry of ``plan``, recording events."""
    args, work, killed, log = run.args, run.work, run.killed, run.log
    timeout, say = run.timeout, run.say
    for kind, target in plan:
        before = _progress(killed)
        marker = work / "in-checkpoint-write"
        marker.unlink(missing_ok=True)
        env = (
            {"GYRE_FAULT": f"checkpoint.write:pause=600:{marker}"}
            if kind == ("checkpoint-write")
            else {}
        )
        say(f"[verify-resume] {kind}: launching (resume=auto)")
        proc = _launch([*args, "run.resume=auto"], killed, log, env, run.fork)
        deadline = time.perf_counter() + timeout
        while proc.poll() is None and time.perf_counter() < deadline:
            if kind == "checkpoint-write" and marker.exists():
                break
            if kind != "checkpoint-write" and _progress(killed) > max(before, target - 1):
                break
            time.sleep(0.01)
        if kind != "checkpoint-write":
            time.sleep(float(rng.uniform(0.0, step_s)))
        if proc.poll() is not None:
            report.events.append(Event(kind, _progress(killed), proc.returncode))
            say(f"[verify-resume] the run ended (rc {proc.returncode}) before the {kind}")
            return
        sig = signal.SIGTERM if kind == "sigterm" else signal.SIGKILL
        at = _progress(killed)
        proc.send_signal(sig)
        rc = _wait(proc, timeout)
        report.events.append(Event(kind, at, rc))
        if kind == "sigterm":
            if rc not in (EXIT_PREEMPTED, EXIT_OK):
                report.problems.append(f"SIGTERM gave exit code {rc}, expected {EXIT_PREEMPTED}")
        else:
            report.kills += 1
