"""Reward functions the reward tests name by import path (``reward_fixtures:<name>``).

conftest.py puts tests/ on sys.path, and sandbox workers inherit the parent's sys.path, so
these resolve both in process and inside the sandbox.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
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
    return when == "always" or (when == "group0" and group_id[0] == 0)


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


def spawn_and_hang(prompts, completions, pid_file="", **kw):
    """Start a grandchild process, record its pid, then hang: the timeout must kill both."""
    child = subprocess.Popen(["sleep", "600"])
    with open(pid_file, "w") as fh:
        fh.write(str(child.pid))
    time.sleep(600)
    return [1.0]


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
