"""The sandbox worker process: ``python -m gyre.rewards._worker`` (started by ``sandbox.py``).

It confines itself *before* it imports any user code, then serves calls until its stdin closes:

1. network: ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` — a fresh network namespace with only a
   loopback device that is down, owned by a fresh user namespace so that even a root worker
   holds no capability in the parent's namespaces (it cannot ``setns`` back, nor raise limits);
2. memory: ``RLIMIT_AS`` soft = hard = the configured MiB (``MemoryError`` past it), no cores;
3. it imports every configured reward module once, then answers ``call`` frames.

Protocol: frames of a 4-byte big-endian length then UTF-8 JSON, on private duplicates of the
original stdin (requests) and stdout (replies). fd 0 then reads /dev/null and fd 1 writes to
stderr, so user code that reads input or prints cannot disturb the protocol. Replies are JSON,
never pickle: the parent does not trust what comes back.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import inspect
import json
import math
import os
import resource
import struct
import sys
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MAX_FRAME = 256 * 1024 * 1024


def read_frame(stream: BinaryIO) -> Any | None:
    head = stream.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    body = stream.read(n)
    if len(body) < n:
        return None
    return json.loads(body)


def write_frame(stream: BinaryIO, obj: Any) -> None:
    data = json.dumps(obj, default=str).encode()
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def isolate_network(unshare: Callable[[int], int] | None = None) -> str | None:
    """Enter a new user + network namespace; return None on success, else why it failed."""
    if unshare is None:
        libc = ctypes.CDLL(None, use_errno=True)
        unshare = libc.unshare
    if unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        return (
            f"unshare(CLONE_NEWUSER|CLONE_NEWNET) failed: {os.strerror(err) if err else 'error'}"
            " — this kernel/container does not allow unprivileged user+network namespaces, so "
            "sandboxed rewards cannot be cut off the network here. Set "
            "reward.sandbox.network=allow to run them WITH network access, or run on a host "
            "that permits namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1, or a "
            "container without a seccomp profile that blocks unshare)."
        )
    return None


def limit_memory(memory_mb: int) -> None:
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def resolve(path: str) -> Callable[..., Any]:
    """``module:attr`` (``attr`` may be dotted) -> the object, or an exception."""
    mod_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{path} is a {type(obj).__name__}, not a callable")
    return obj


def _call(fns: dict[str, Callable[..., Any]], req: dict[str, Any]) -> dict[str, Any]:
    fn = fns.get(req["fn"]) or resolve(req["fn"])
    out = fn(req["prompts"], req["completions"], **req["columns"], **req["kwargs"])
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    values = [float(v) for v in out]
    n = len(req["prompts"])
    if len(values) != n:
        return {
            "ok": False,
            "kind": "bad_output",
            "error": f"returned {len(values)} values for {n} samples",
        }
    if not all(math.isfinite(v) for v in values):
        return {
            "ok": False,
            "kind": "bad_output",
            "error": f"returned a non-finite value: {values}",
        }
    return {"ok": True, "values": values}


async def _await(aw: Any) -> Any:
    return await aw


def main() -> int:
    # Private, non-inheritable copies of the protocol pipes; fd 0 becomes /dev/null (user code
    # calling input() cannot eat requests) and fd 1 stderr (its prints cannot corrupt replies).
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    init = read_frame(requests)
    if init is None:
        return 1
    if init["network"] == "deny":
        why = isolate_network()
        if why is not None:
            write_frame(replies, {"ok": False, "kind": "isolation", "error": why})
            return 1
    limit_memory(int(init["memory_mb"]))
    sys.path[:] = init["sys_path"]
    fns: dict[str, Callable[..., Any]] = {}
    errors: dict[str, str] = {}
    for path in init["fns"]:
        try:
            fns[path] = resolve(path)
        except BaseException:
            errors[path] = traceback.format_exc(limit=-3)
    write_frame(replies, {"ok": not errors, "errors": errors, "pid": os.getpid()})
    while True:
        req = read_frame(requests)
        if req is None:
            return 0
        try:
            reply = _call(fns, req)
        except MemoryError:
            reply = {"ok": False, "kind": "memory", "error": traceback.format_exc()}
        except BaseException:
            reply = {"ok": False, "kind": "exception", "error": traceback.format_exc()}
        write_frame(replies, reply)


if __name__ == "__main__":
    sys.exit(main())
