"""Kernel calls the sandbox worker uses to confine itself (Linux only, via ``ctypes``).

Everything here is stdlib + libc: the worker imports this module before any user code, and
must not pull in gyre's heavy dependencies. Each function either does its job or reports why
not (a string); the worker decides what a refusal means (``_worker.py``).
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource
from collections.abc import Callable, Iterable

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flag -> mount flag: a read-only remount of a bind mount must keep the flags the
# kernel locked on it (nosuid, nodev, ...), or it is refused with EPERM.
_ST_TO_MS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)

_libc = ctypes.CDLL(None, use_errno=True)


def _why(call: str) -> str:
    err = ctypes.get_errno()
    return f"{call} failed: {os.strerror(err) if err else 'error'}"


def libc_unshare(flags: int) -> int:
    return _libc.unshare(flags)


def unshare(flags: int, unshare_fn: Callable[[int], int] | None = None) -> str | None:
    """``unshare(flags)``; None on success, else why it failed."""
    fn = unshare_fn or libc_unshare
    if fn(flags) != 0:
        names = [
            n
            for n, f in (
                ("CLONE_NEWUSER", CLONE_NEWUSER),
                ("CLONE_NEWPID", CLONE_NEWPID),
                ("CLONE_NEWNS", CLONE_NEWNS),
                ("CLONE_NEWNET", CLONE_NEWNET),
            )
            if flags & f
        ]
        return _why(f"unshare({'|'.join(names)})")
    return None


def prctl(option: int, arg: int) -> str | None:
    if _libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        return _why(f"prctl({option}, {arg})")
    return None


def die_with_parent(parent_pid: int, sig: int = 9) -> bool:
    """SIGKILL this process when its parent dies; False if the parent is already gone (the
    check after prctl closes the race of a parent dying before the call)."""
    prctl(PR_SET_PDEATHSIG, sig)
    return os.getppid() == parent_pid


def drop_to_user(name: str) -> str | None:
    """As root, switch real/effective/saved uid and gid to ``name`` (no supplementary groups);
    a no-op for any other uid or an empty name. None on success, else why not."""
    if os.getuid() != 0 or not name:
        return None
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        return f"no user {name!r} on this machine (reward.sandbox.user)"
    os.setgroups([])
    os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
    os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
    return None


def make_private_mounts() -> str | None:
    """Stop mount events propagating back to the parent's namespace (needs CLONE_NEWNS)."""
    if _libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        return _why("mount(/, MS_REC|MS_PRIVATE)")
    return None


def mount_proc() -> str | None:
    """A /proc of this PID namespace: the reward sees only its own processes."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    if _libc.mount(b"proc", b"/proc", b"proc", flags, None) != 0:
        return _why("mount(proc, /proc)")
    return None


def bind_read_only(path: str) -> str | None:
    """Bind ``path`` onto itself and remount that bind read-only (in this mount namespace)."""
    p = os.fsencode(path)
    if _libc.mount(p, p, None, MS_BIND | MS_REC, None) != 0:
        return _why(f"bind mount of {path}")
    st = os.statvfs(path).f_flag
    keep = sum(ms for stf, ms in _ST_TO_MS if st & stf)
    if _libc.mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | keep, None) != 0:
        return _why(f"read-only remount of {path}")
    return None


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def drop_capabilities() -> str | None:
    """Empty the effective, permitted and inheritable capability sets and set no_new_privs:
    reward code cannot mount (undo a read-only bind), ptrace or raise its limits."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        return _why("capset(0)")
    return prctl(PR_SET_NO_NEW_PRIVS, 1)


def limit_memory(memory_mb: int) -> None:
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def limit_processes(n: int) -> None:
    """RLIMIT_NPROC = ``n``. The kernel never applies it to uid 0 (why root workers switch to
    ``reward.sandbox.user``); in a user namespace it counts that namespace's processes only."""
    resource.setrlimit(resource.RLIMIT_NPROC, (n, n))


def read_only_paths(paths: Iterable[str]) -> list[str]:
    """Make every existing path read-only; returns the errors (empty when all worked)."""
    errors = []
    for path in paths:
        if os.path.exists(path):
            why = bind_read_only(path)
            if why:
                errors.append(why)
    return errors
