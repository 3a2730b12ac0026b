"""Reward functions the reward tests name by import path (``reward_fixtures:<name>``).

conftest.py puts tests/ on sys.path, and sandbox workers inherit the parent's sys.path, so
these resolve both in process and inside the sandbox.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

CALLS: list[dict[str, Any]] = []  # in-process calls, for tests that inspect what was passed


def length(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Completion length in characters; records its arguments."""
    CALLS.append({"prompts": prompts, "completions": completions, **columns})
    return [float(len(c)) for c in completions]


# numpy / torch are imported inside the functions: sandbox workers import this module under a
# memory limit, and only the tests that need them should pay for them.
def constant(prompts: list[str], completions: list[str], value: float = 1.0, **kw: Any):
    import numpy as np

    return np.full(len(prompts), value)  # a numpy array is accepted


def as_tensor(prompts: list[str], completions: list[str], **kw: Any):
    import torch

    return torch.arange(len(prompts), dtype=torch.float32)


async def async_double_env(prompts: list[str], completions: list[str], env_reward, **kw):
    await asyncio.sleep(0)
    return [2.0 * r for r in env_reward]


# Two coroutines that each wait for the other: they finish only if awaited concurrently.
_EVENTS: dict[str, asyncio.Event] = {}


async def _handshake(me: str, other: str, n: int) -> list[float]:
    _EVENTS.setdefault(me, asyncio.Event()).set()
    await asyncio.wait_for(_EVENTS.setdefault(other, asyncio.Event()).wait(), timeout=5)
    return [1.0] * n


async def ping(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return await _handshake("ping", "pong", len(prompts))


async def pong(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return await _handshake("pong", "ping", len(prompts))


def reset_handshake() -> None:
    _EVENTS.clear()


def too_short(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return [1.0] * (len(prompts) - 1)


def not_numbers(prompts: list[str], completions: list[str], **kw: Any) -> list[Any]:
    return ["high"] * len(prompts)


def nan(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    return [float("nan")] * len(prompts)


def scalar(prompts: list[str], completions: list[str], **kw: Any) -> float:
    return 1.0


def raises(prompts: list[str], completions: list[str], **kw: Any) -> list[float]:
    raise RuntimeError("reward bug")


NOT_CALLABLE = 3


# -- misbehaving rewards for the sandbox: they misbehave only where ``when`` says so -----------
def _bad(group_id: list[int], when: str) -> bool:
    """``always``; ``group0``: the task of group id 0; ``even``: tasks of even id (group ids are
    the run's task indices, so with 2 tasks a step that is each step's first task)."""
    return (
        when == "always"
        or (when == "group0" and group_id[0] == 0)
        or (when == "even" and group_id[0] % 2 == 0)
    )


def sleeper(prompts, completions, group_id, when="always", seconds=600.0, **kw):
    if _bad(group_id, when):
        time.sleep(seconds)
    return [1.0] * len(prompts)


def hog(prompts, completions, group_id, when="always", mb=4096, **kw):
    if _bad(group_id, when):
        blob = bytearray(mb * 1024 * 1024)  # past RLIMIT_AS: MemoryError
        return [float(len(blob) > 0)]
    small = bytearray(16 * 1024 * 1024)  # well below the limit: fine
    return [float(len(small) > 0)] * len(prompts)


def dialer(prompts, completions, group_id, port=0, when="always", **kw):
    if _bad(group_id, when):
        with socket.create_connection(("127.0.0.1", int(port)), timeout=2) as s:
            s.sendall(b"x")
    return [1.0] * len(prompts)


def crash(prompts, completions, **kw):
    os._exit(3)


def chatty(prompts, completions, **kw):
    print("this goes to stderr, not into the protocol")
    return [0.5] * len(prompts)


def secret_len(prompts, completions, **kw):
    """Length of GYRE_TEST_SECRET as the function sees it (0 when the variable is absent)."""
    return [float(len(os.environ.get("GYRE_TEST_SECRET", "")))] * len(prompts)


def reads_stdin(prompts, completions, **kw):
    import sys

    return [float(len(sys.stdin.read()))] * len(prompts)  # /dev/null in the sandbox: 0.0


async def async_raises(prompts, completions, **kw):
    await asyncio.sleep(0)
    raise KeyError("missing")


def first_of_group(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """1 for the first sample of each group, 0 for the rest: every group has reward variance."""
    groups = columns["group_id"]
    return [1.0 if k == 0 or groups[k - 1] != g else 0.0 for k, g in enumerate(groups)]


def odd_groups_raise(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
    """Raises whenever the batch holds a sample of an odd group (a bug on some inputs only)."""
    if any(g % 2 for g in columns["group_id"]):
        raise ValueError("cannot score odd groups")
    return [1.0] * len(prompts)


async def async_odd_groups_raise(prompts: list[str], completions: list[str], **columns: Any):
    return odd_groups_raise(prompts, completions, **columns)


# -- escapes the sandbox must contain (test_sandbox_containment.py) ---------------------------
def setsid_grandchild(prompts, completions, marker="", token="", delay=2.0, double=False, **kw):
    """Start a grandchild in a session of its own (``double``: via a double fork, so that it is
    an orphan), which writes ``marker`` after ``delay`` s and carries ``token`` in its command
    line; then hang. The sandbox must kill the grandchild with the worker."""
    import sys

    code = "import sys, time; time.sleep(float(sys.argv[2])); open(sys.argv[1], 'w').write('x')"
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if double and os.fork() != 0:
            os._exit(0)
        try:
            os.execv(sys.executable, [sys.executable, "-c", code, marker, str(delay), token])
        finally:
            os._exit(127)  # never return into the worker's serve loop
    if double:
        os.waitpid(pid, 0)
    time.sleep(600)
    return [1.0]


def fork_many(prompts, completions, n=200, **kw):
    """Fork up to ``n`` children that sleep 60 s (a bounded fork bomb); 1.0 if all started."""
    for _ in range(int(n)):
        if os.fork() == 0:
            try:
                time.sleep(60)
            finally:
                os._exit(0)
    return [1.0]


def write_into(prompts, completions, path="", **kw):
    """Write a file into the directory ``path``; 1.0 when that worked."""
    with open(os.path.join(path, "written-by-reward"), "w") as fh:
        fh.write("x")
    return [1.0]


def forged_nan(prompts, completions, **kw):
    """Write a NaN reply frame straight onto the protocol pipe, as hostile code could."""
    import gc
    import io
    import json
    import struct

    pipes = [
        o
        for o in gc.get_objects()
        if isinstance(o, io.BufferedWriter) and not o.closed and o.fileno() > 2
    ]
    data = json.dumps({"ok": True, "values": [float("nan")]}).encode()
    pipes[0].write(struct.pack(">I", len(data)) + data)
    pipes[0].flush()
    time.sleep(600)  # the forged frame is the reply the parent reads
    return [1.0]


def huge(prompts, completions, **kw):
    return [1.7e308] * len(prompts)


def inf_on_second(prompts, completions, **kw):
    return [float("inf") if i == 1 else 1.0 for i in range(len(prompts))]
