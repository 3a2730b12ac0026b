"""Run untrusted reward code in worker processes with a wall-time limit, a memory limit and no
network; a failed call costs that sample a configured reward, never the run.

Guarantees (what is enforced, and how):

- **wall time**: the parent waits at most ``timeout_s`` for a call's reply, then SIGKILLs the
  worker's PID namespace (every process the reward started, ``setsid()`` and double forks
  included) and starts a fresh worker;
- **processes**: the worker is its namespace's PID 2 under an init of ours that dies with the
  launcher, which dies with the trainer (``PR_SET_PDEATHSIG``), so nothing outlives the trainer,
  even on ``kill -9``; ``max_processes`` via a pids cgroup (root) or ``RLIMIT_NPROC``;
- **memory**: ``RLIMIT_AS`` in the worker (soft = hard); past it allocations fail
  (``MemoryError``), and a worker killed outright is reported as a crash;
- **network**: ``network: deny`` adds a network namespace (a downed loopback only); when the
  kernel refuses, starting the sandbox raises :class:`SandboxUnavailableError`;
- **file system**: the run dir and ``read_only`` paths are read-only bind mounts in the
  worker's mount namespace; the worker has no capabilities and cwd/TMPDIR/HOME in a private
  temp dir. Everything else is as readable/writable as for the worker's uid;
- **isolation of the parent**: replies are length-prefixed JSON checked for shape and
  finiteness, not pickle; the worker's environment holds only PATH, LANG, LC_*, TZ and
  thread-count variables (not the parent's API keys or tokens).

Where namespaces are refused and ``network: allow`` was asked for, the fallback is the worker's
own session as a child subreaper, its process tree killed at a timeout (a logged note says so;
then a trainer's ``kill -9`` leaves the reward's children running, and nothing is read-only).
docs/rewards.md, "What the sandbox isolates", has the whole list.

Workers are reused across calls and steps (start-up and imports are paid once), and a call is
one sample so that a failure costs exactly that sample.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import pwd
import queue
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import gyre.rewards._cgroup as _cgroup
from gyre.config import SandboxConfig
from gyre.deadlines import PeerFault
from gyre.rewards.errors import SandboxUnavailableError

log = logging.getLogger("gyre.rewards")

STARTUP_TIMEOUT_S = 60.0
_SPAWN_S = STARTUP_TIMEOUT_S + 10.0  # slack beyond a call's timeout: a fresh worker's start
ENV_PASSTHROUGH = ("PATH", "HOME", "LANG", "TMPDIR", "TZ")
WORKER_ARGS = ["-m", "gyre.rewards._worker"]  # after sys.executable
MAX_REPLY_BYTES = 64 * 1024 * 1024


@dataclass
class CallResult:
    """One sandboxed call: ``values`` on success, else ``kind`` and ``error`` (a traceback)."""

    values: list[float] | None
    kind: str = "ok"  # ok | timeout | memory | crash | exception | bad_output
    error: str = ""
    text: str = ""  # a text call's result (request key "text": true; the python tool)

    @property
    def ok(self) -> bool:
        return self.values is not None


def _read_exact(fd: int, n: int, deadline: float) -> bytes | None:
    """``n`` bytes from ``fd`` before ``deadline``; None on timeout, b'' short on EOF."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        poller = select.poll()  # not select(): fds above 1024 are fine in a long-lived trainer
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        if not poller.poll(left * 1000):
            return None
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return bytes(buf)
        buf += chunk
    return bytes(buf)


class _Worker:
    """One confined worker (launcher, namespace init and worker process) and its pipes."""

    def __init__(self, cfg: SandboxConfig, fns: Sequence[str], read_only: Sequence[str]) -> None:
        # Untrusted code sees no secrets from the parent's environment (API keys, tokens): only
        # the variables below pass. sys.path travels in the init frame instead of PYTHONPATH.
        env = {k: v for k, v in os.environ.items() if k in ENV_PASSTHROUGH or k.startswith("LC_")}
        # Thread pools reserve address space per thread; under RLIMIT_AS one thread is safer.
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = "1"
        # A private working and temp dir, owned by the uid the worker will run as.
        self.workdir = tempfile.mkdtemp(prefix="gyre-reward-")
        uid = _worker_uid(cfg.user)
        if uid is not None:
            os.chown(self.workdir, uid, -1)
        env["TMPDIR"] = env["HOME"] = self.workdir
        # The worker module comes from the same gyre as this one (not whichever is installed).
        env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
        self.ns_init: int | None = None
        # Root is exempt from RLIMIT_NPROC; a pids cgroup bounds a root worker's tree instead.
        self.cgroup = _cgroup.make_pids_cgroup(cfg.max_processes) if uid is None else None
        self.proc = subprocess.Popen(
            [sys.executable, *WORKER_ARGS],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own session and process group
            env=env,
            cwd=self.workdir,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout.fileno()
        init = {
            "network": cfg.network,
            "memory_mb": cfg.memory_mb,
            "max_processes": cfg.max_processes,
            "user": cfg.user,
            "read_only": [os.path.realpath(p) for p in read_only],
            "workdir": self.workdir,
            "cgroup": self.cgroup,
            "parent_pid": os.getpid(),
            "sys_path": list(sys.path),
            "fns": list(fns),
        }
        self._send(init)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        first = self._recv(deadline)
        if isinstance(first, dict) and first.get("kind") == "confined":
            self.ns_init = first.get("ns_init")
            reply = self._recv(deadline)
        else:
            reply = first
        if not isinstance(reply, dict):
            self.kill()
            raise SandboxUnavailableError(
                f"reward sandbox worker did not start ({reply}); see stderr above"
            )
        if reply.get("kind") == "isolation":
            self.kill()
            raise SandboxUnavailableError(
                "reward sandbox cannot enforce reward.sandbox.network=deny: " + reply["error"]
            )
        self.import_errors: dict[str, str] = reply.get("errors", {})
        self.confinement: dict[str, Any] = reply.get("confinement", {})

    def _send(self, obj: Any) -> None:
        data = json.dumps(obj, default=str).encode()
        self._in.write(struct.pack(">I", len(data)) + data)
        self._in.flush()

    def _recv(self, deadline: float) -> Any:
        """The next reply; the string 'timeout' or 'eof' when there is none."""
        head = _read_exact(self._out, 4, deadline)
        if head is None:
            return "timeout"
        if len(head) < 4:
            return "eof"
        (n,) = struct.unpack(">I", head)
        if n > MAX_REPLY_BYTES:
            return "eof"
        body = _read_exact(self._out, n, deadline)
        if body is None:
            return "timeout"
        if len(body) < n:
            return "eof"
        try:
            return json.loads(body)
        except ValueError:
            return "eof"

    def call(self, request: dict[str, Any], timeout_s: float) -> CallResult:
        try:
            self._send(request)
        except (BrokenPipeError, OSError):
            return CallResult(None, "crash", self._death())
        reply = self._recv(time.monotonic() + timeout_s)
        if reply == "timeout":
            self.kill()
            return CallResult(None, "timeout", f"killed after the {timeout_s:g}s wall-time limit")
        if not isinstance(reply, dict):
            return CallResult(None, "crash", self._death())
        if reply.get("ok"):
            values = reply.get("values")
            if isinstance(values, list) and all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in values
            ):
                bad = [v for v in values if not math.isfinite(v)]
                if bad:
                    msg = f"non-finite reward from worker: {bad[0]}"
                    return CallResult(None, "bad_output", msg)
                text = reply.get("text", "")
                if not isinstance(text, str):
                    return CallResult(None, "bad_output", "malformed text reply from worker")
                return CallResult([float(v) for v in values], text=text)
            return CallResult(None, "bad_output", f"malformed reply from worker: {reply!r:.200}")
        return CallResult(None, str(reply.get("kind", "exception")), str(reply.get("error", "")))

    def _death(self) -> str:
        # The reply pipe closes when the worker exits; its launcher exits right after with the
        # worker's status, which is what the message should report.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=2.0)
        self.kill()
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            return f"worker died from signal {signal.Signals(-rc).name} (memory limit or a crash)"
        return f"worker exited with status {rc} without replying"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL everything the worker started: its PID namespace (killing the namespace's
        init kills every process in it), else (fallback) its process tree and process group."""
        if self.proc.poll() is None:
            if self.ns_init is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(self.ns_init, signal.SIGKILL)
            else:
                _kill_tree(self.proc.pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.kill()
        try:
            self.proc.wait(timeout=_SPAWN_S)  # SIGKILLed: only a kernel-stuck process stays
        except subprocess.TimeoutExpired:
            raise PeerFault(
                "reward worker",
                "killing a worker",
                f"pid {self.proc.pid}",
                _SPAWN_S,
                "reward.sandbox.timeout_s",
            ) from None
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(Exception):
                f.close()  # type: ignore[union-attr]
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.cgroup is not None:
            _cgroup.remove(self.cgroup)
            self.cgroup = None


def _worker_uid(user: str) -> int | None:
    """The uid a worker switches to (as root, ``reward.sandbox.user``), else None."""
    if os.getuid() != 0 or not user:
        return None
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None  # the worker reports the missing user


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _kill_tree(root: int) -> None:
    """Fallback containment: stop ``root`` and every descendant (the worker is a child
    subreaper, so orphans of setsid / double forks stay in its tree), then SIGKILL them all.
    Rescanning until no new process appears catches forks racing the scan."""
    seen: set[int] = set()
    for _ in range(20):
        kids = _children()
        tree, todo = [], [root]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(kids.get(pid, []))
        new = [p for p in tree if p not in seen]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        seen.update(new)
    for pid in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _kill_all(workers: list[_Worker]) -> None:
    for w in list(workers):
        w.kill()


class SandboxPool:
    """``workers`` confined processes serving calls in parallel; dead ones are replaced."""

    def __init__(
        self, cfg: SandboxConfig, fns: Sequence[str], read_only: Sequence[str] = ()
    ) -> None:
        self.cfg = cfg
        self.fns = list(fns)
        self.read_only = [*cfg.read_only, *read_only]
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        first = self._spawn()  # fails loudly here if isolation is impossible
        self.import_errors = first.import_errors
        self.confinement = first.confinement
        for note in self.confinement.get("notes", []):
            log.warning("reward sandbox: %s", note)
        self._idle.put(first)
        for _ in range(cfg.workers - 1):
            self._idle.put(None)  # started on first use
        self._executor = ThreadPoolExecutor(cfg.workers, thread_name_prefix="gyre-sandbox")
        self._finalizer = weakref.finalize(self, _kill_all, self._all)

    def _spawn(self) -> _Worker:
        w = _Worker(self.cfg, self.fns, self.read_only)
        with self._lock:
            self._all.append(w)
        return w

    def _run_one(self, request: dict[str, Any]) -> CallResult:
        wait_s = self.cfg.timeout_s + _SPAWN_S
        try:
            w = self._idle.get(timeout=wait_s)
        except queue.Empty:
            stage = "reward (waiting for a free worker)"
            raise PeerFault(
                "reward worker", stage, "the sandbox pool", wait_s, "reward.sandbox.timeout_s"
            ) from None
        try:
            if w is None or not w.alive:
                if w is not None:
                    self._forget(w)
                w = self._spawn()
            result = w.call(request, self.cfg.timeout_s)
            if not w.alive:
                self._forget(w)
                w = None
            return result
        except SandboxUnavailableError as exc:
            return CallResult(None, "crash", f"could not restart a sandbox worker: {exc}")
        finally:
            self._idle.put(w)

    def _forget(self, w: _Worker) -> None:
        with self._lock:
            if w in self._all:
                self._all.remove(w)

    def map(self, requests: Sequence[dict[str, Any]]) -> list[CallResult]:
        """Run every request (one sample each) on the pool; results in request order."""
        # Each call ends within timeout_s (then its worker is killed and replaced); the pool
        # runs `workers` at a time. Past that bound something below the calls is wedged.
        rounds = -(-len(requests) // max(self.cfg.workers, 1)) + 1
        bound = rounds * (self.cfg.timeout_s + _SPAWN_S)
        try:
            return list(self._executor.map(self._run_one, requests, timeout=bound))
        except TimeoutError:
            raise PeerFault(
                "reward worker", "reward", "the sandbox pool", bound, "reward.sandbox.timeout_s"
            ) from None

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._finalizer()
