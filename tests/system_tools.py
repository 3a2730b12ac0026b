"""System binaries some tests drive (Debian packages `prometheus`, `chromium`).

Locally a missing binary skips its test with the reason; CI (``.ci/run``) installs both and sets
``GYRE_REQUIRE_SYSTEM_TOOLS=1``, which turns a missing binary into a failure instead of a skip.
"""

from __future__ import annotations

import os
import shutil
import socket

import pytest


def require_binary(name: str, package: str) -> str:
    path = shutil.which(name)
    if path:
        return path
    reason = f"'{name}' is not installed (apt-get install {package}; .ci/run installs it)"
    if os.environ.get("GYRE_REQUIRE_SYSTEM_TOOLS") == "1":
        pytest.fail(reason + " but GYRE_REQUIRE_SYSTEM_TOOLS=1")
    pytest.skip(reason)


def free_port() -> int:
    """A port the OS reports free on loopback (closed again before use)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
