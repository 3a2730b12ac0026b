"""The python tool's body, run inside a sandbox worker (``gyre.rollout.tools.PythonTool``).

A module of its own that imports nothing from gyre: the sandbox worker imports it under its
memory limit, where importing the rollout package (torch) would not fit.
"""

from __future__ import annotations

import contextlib
import io
import traceback
from typing import Any


def run_python(prompts: list[str], completions: list[str], **_: Any) -> str:
    """Exec ``prompts[0]`` in fresh globals; return what it printed (and the last line of the
    traceback, if it raised)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            exec(compile(prompts[0], "<tool>", "exec"), {"__name__": "__tool__"})
    except BaseException:
        buf.write(traceback.format_exc(limit=0).strip().splitlines()[-1])
    return buf.getvalue()
