"""Errors the user fixes in their input, and the one-line wording of disk errors.

The CLI prints an :class:`InputError` (like a :class:`gyre.config.ConfigError`) as one line and
exits 2; the message names the file (``path:line`` for data), folder or config key.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


class InputError(ValueError):
    """Bad input the user can fix: a file, a folder, a dataset row; the message names it."""


# torch's zip writer reports a failed write without an errno ("[enforce fail at
# inline_container.cc:...] ... file write failed" / "unexpected pos"); safetensors' Rust
# writer as "No space left on device (os error 28)".
_WRITER_FAILURES = ("inline_container.cc", "file write failed", "PytorchStreamWriter")
_LOW_SPACE = 16 << 20  # below this many free bytes a failed write is taken as a full disk


def is_disk_full(exc: BaseException, where: Path | None = None) -> bool:
    """Whether ``exc`` (or what caused it) is a full disk: ENOSPC / EDQUOT, a library's
    wording of it, or a library writer failure on a filesystem with (almost) no space left."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(seen)
        if "No space left on device" in text or "os error 28" in text:
            return True
        if where is not None and any(s in text for s in _WRITER_FAILURES):
            return free_bytes(where) < _LOW_SPACE
        seen = seen.__cause__ or seen.__context__
    return False


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding ``path`` (its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return 1 << 62


def disk_full_message(path: Path | str) -> str:
    return f"{os.strerror(errno.ENOSPC)} writing {path}"


def ensure_writable_dir(path: Path, key: str) -> None:
    """Create ``path`` (a directory the config key ``key`` names) and prove it is writable,
    else an :class:`InputError` naming the key and the path."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise InputError(f"{key}='{path}': a file is in the way (not a directory)") from None
    except OSError as exc:
        raise InputError(f"{key}='{path}' cannot be created: {exc.strerror}") from None
    if not path.is_dir():
        raise InputError(f"{key}='{path}': a file is in the way (not a directory)")
    probe = path / f".gyre_write_probe_{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise InputError(disk_full_message(path)) from None
        raise InputError(f"{key}='{path}' is not writable: {exc.strerror}") from None
