"""A pids cgroup per sandbox worker, where this process may make one (cgroup v1 ``pids``
controller, or v2 with ``pids`` enabled in our cgroup's subtree): ``pids.max`` bounds the
processes of the worker's whole tree, root's included (RLIMIT_NPROC never applies to root)."""

from __future__ import annotations

import contextlib
import os
import time
import uuid


def _pids_base() -> str | None:
    """The directory of this process's pids cgroup, when the pids controller is reachable."""
    try:
        with open("/proc/self/cgroup") as fh:
            lines = [ln.rstrip("\n").split(":", 2) for ln in fh]
        with open("/proc/self/mountinfo") as fh:
            mounts = [ln.split() for ln in fh]
    except OSError:
        return None
    for m in mounts:
        sep = m.index("-")
        fstype, opts, point = m[sep + 1], m[sep + 3].split(","), m[4]
        if fstype == "cgroup" and "pids" in opts:
            own = next((p for _, ctl, p in lines if "pids" in ctl.split(",")), None)
            if own is not None:
                return os.path.join(point, own.lstrip("/"))
    for m in mounts:
        sep = m.index("-")
        if m[sep + 1] == "cgroup2":
            own = next((p for h, ctl, p in lines if h == "0" and ctl == ""), None)
            base = os.path.join(m[4], (own or "/").lstrip("/"))
            with contextlib.suppress(OSError), open(f"{base}/cgroup.subtree_control") as fh:
                if "pids" in fh.read().split():
                    return base
    return None


def make_pids_cgroup(max_pids: int) -> str | None:
    """A fresh cgroup with ``pids.max = max_pids``; None where that is not possible here."""
    base = _pids_base()
    if base is None or not os.access(base, os.W_OK):
        return None
    path = os.path.join(base, f"gyre-reward-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(path)
        with open(f"{path}/pids.max", "w") as fh:
            fh.write(str(max_pids))
    except OSError:
        remove(path)
        return None
    return path


def remove(path: str, wait_s: float = 2.0) -> None:
    """Remove the cgroup once its (killed) processes are gone; give up quietly after wait_s."""
    end = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > end:
                return
            time.sleep(0.02)
