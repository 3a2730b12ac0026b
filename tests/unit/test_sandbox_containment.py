"""The reward sandbox contains every process a reward starts: a ``setsid()`` or double-forked
grandchild dies at the timeout and with the trainer (even on ``kill -9``), a bounded fork bomb
hits the process limit, reward code cannot write into the run dir, and the fallback without
namespaces still kills a setsid grandchild at the timeout.

Processes are found from the host by a unique token in their command line (pids inside the
sandbox are those of its own PID namespace), and by a marker file each grandchild would write
a little after the timeout if it were still alive."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from gyre.config import SandboxConfig
from gyre.rewards import _cgroup
from gyre.rewards.sandbox import SandboxPool

FIXTURES = [
    "reward_fixtures:" + f
    for f in ("setsid_grandchild", "fork_many", "write_into", "chatty", "forged_nan")
]


def _req(fn: str, **kwargs) -> dict:
    return {
        "fn": f"reward_fixtures:{fn}",
        "prompts": ["p"],
        "completions": ["c"],
        "columns": {"group_id": [0]},
        "kwargs": kwargs,
    }


def _pidns_available() -> bool:
    pool = SandboxPool(SandboxConfig(network="allow", timeout_s=5.0), ["reward_fixtures:chatty"])
    try:
        return pool.confinement.get("containment") == "pidns"
    finally:
        pool.close()


PIDNS = _pidns_available()
needs_pidns = pytest.mark.skipif(not PIDNS, reason="the kernel refuses user+PID namespaces here")


@pytest.fixture
def shared_dir():
    """A directory the sandbox user (nobody, when tests run as root) can write to."""
    d = tempfile.mkdtemp(prefix="gyre-sbx-test-")
    os.chmod(d, 0o777)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _with_token(token: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if token.encode() in fh.read() and _alive(int(entry)):
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _wait_until(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _pool(**kw) -> SandboxPool:
    cfg = SandboxConfig(**{"timeout_s": 1.0, "memory_mb": 512, "network": "allow", **kw})
    return SandboxPool(cfg, FIXTURES)


@pytest.mark.parametrize("double", [False, True], ids=["setsid", "double-fork"])
def test_an_escaped_grandchild_dies_at_the_timeout(shared_dir, double):
    token, marker = uuid.uuid4().hex, shared_dir / "marker"
    pool = _pool()
    try:
        worker = pool._all[0]
        pids = [worker.proc.pid] + ([worker.ns_init] if worker.ns_init else [])
        res = pool.map([_req("setsid_grandchild", marker=str(marker), token=token, delay=2.0)])
        assert res[0].kind == "timeout"
        gone = lambda: not any(_alive(p) for p in pids)  # noqa: E731
        assert _wait_until(gone, 5.0), "the worker survived its timeout"
        assert _wait_until(lambda: not _with_token(token), 5.0), "the grandchild survived"
        time.sleep(2.5)  # past the moment the grandchild would have written the marker
        assert not marker.exists()
        assert pool.map([_req("chatty")])[0].values == [0.5]  # a fresh worker serves
    finally:
        pool.close()


@needs_pidns
def test_kill_9_of_the_trainer_kills_the_worker_and_its_grandchildren(shared_dir):
    token, marker = uuid.uuid4().hex, shared_dir / "marker"
    owner_code = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from gyre.config import SandboxConfig
        from gyre.rewards.sandbox import SandboxPool
        pool = SandboxPool(SandboxConfig(timeout_s=600, network="allow"), {FIXTURES!r})
        w = pool._all[0]
        print(w.proc.pid, w.ns_init, w.workdir, w.cgroup or "", flush=True)
        req = {{"fn": "reward_fixtures:setsid_grandchild", "prompts": ["p"], "completions": ["c"],
               "columns": {{}}, "kwargs": {{"marker": {str(marker)!r}, "token": {token!r},
               "delay": 6.0, "double": True}}}}
        pool.map([req])
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        outer, ns_init, workdir, *cgroup = owner.stdout.readline().split()
        worker_pids = [int(outer), int(ns_init)]
        assert _wait_until(lambda: bool(_with_token(token)), 20.0), "no grandchild started"
        seen_at, hung = time.monotonic(), _with_token(token)
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        gone = lambda: not any(_alive(p) for p in [*worker_pids, *hung])  # noqa: E731
        assert _wait_until(gone, 5.0), "sandbox processes outlived the trainer's kill -9"
        time.sleep(max(0.0, seen_at + 6.5 - time.monotonic()))  # past the marker's time
        assert not marker.exists()
    finally:
        owner.kill()
        owner.wait()
        if "workdir" in locals():  # left behind by a killed trainer (documented): tidy up
            shutil.rmtree(workdir, ignore_errors=True)
            for cg in cgroup:
                _cgroup.remove(cg)


@needs_pidns
def test_a_bounded_fork_bomb_hits_the_process_limit(shared_dir):
    pool = _pool(max_processes=16, timeout_s=20.0)
    try:
        if "max_processes" not in pool.confinement:
            pytest.skip(f"process limit not in force here: {pool.confinement.get('notes')}")
        res = pool.map([_req("fork_many", n=100)])
    finally:
        pool.close()
    assert res[0].kind == "exception"
    assert "BlockingIOError" in res[0].error or "Resource temporarily unavailable" in res[0].error


@needs_pidns
def test_reward_code_cannot_write_into_a_protected_dir(shared_dir):
    protected, open_dir = shared_dir / "run", shared_dir / "scratch"
    for d in (protected, open_dir):
        d.mkdir()
        os.chmod(d, 0o777)  # file permissions alone would let the reward write
    cfg = SandboxConfig(network="allow", timeout_s=5.0, memory_mb=512)
    pool = SandboxPool(cfg, FIXTURES, read_only=[str(protected)])
    try:
        assert pool.confinement["read_only"] == [str(protected.resolve())]
        res = pool.map([_req("write_into", path=str(protected)), _req("write_into", path=open_dir)])
    finally:
        pool.close()
    assert res[0].kind == "exception" and "Read-only file system" in res[0].error
    assert not (protected / "written-by-reward").exists()
    assert res[1].values == [1.0] and (open_dir / "written-by-reward").exists()


def test_fallback_without_namespaces_still_kills_a_setsid_grandchild(monkeypatch, shared_dir):
    """Namespaces refused (injected) with network: allow: session containment, and the
    timeout still kills the grandchild (the worker is a child subreaper; its tree is killed)."""
    from gyre.rewards import sandbox

    refuse = (
        "import ctypes, sys, gyre.rewards._confine as c; "
        "c.libc_unshare = lambda flags: (ctypes.set_errno(1), -1)[1]; "
        "import gyre.rewards._worker as w; sys.exit(w.main())"
    )
    monkeypatch.setattr(sandbox, "WORKER_ARGS", ["-c", refuse])
    token, marker = uuid.uuid4().hex, shared_dir / "marker"
    pool = _pool()
    try:
        assert pool.confinement["containment"] == "session"
        assert pool._all[0].ns_init is None
        res = pool.map([_req("setsid_grandchild", marker=str(marker), token=token, double=True)])
        assert res[0].kind == "timeout"
        assert _wait_until(lambda: not _with_token(token), 5.0), "the grandchild survived"
        time.sleep(2.5)
        assert not marker.exists()
    finally:
        pool.close()


def test_a_forged_nan_reply_is_a_failure_not_a_reward():
    pool = _pool()
    try:
        res = pool.map([_req("forged_nan")])
    finally:
        pool.close()
    assert res[0].values is None and res[0].kind == "bad_output"
    assert "non-finite" in res[0].error
