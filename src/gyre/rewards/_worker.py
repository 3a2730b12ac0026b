"""The sandbox worker: ``python -m gyre.rewards._worker`` (started by ``sandbox.py``).

It confines itself *before* it imports any user code, then serves calls until its stdin closes.
Where the kernel allows (``_confine.py`` holds the calls), three processes make one worker:

- the **launcher** (the process the trainer started): as root it first switches to
  ``reward.sandbox.user``; it enters a new user + PID + mount (+ network, for ``network: deny``)
  namespace, asks to be SIGKILLed when the trainer dies (``PR_SET_PDEATHSIG``), reports the
  host pid of the namespace's init to the trainer and waits for it;
- **init** (PID 1 of the new PID namespace, our code only): dies with the launcher
  (``PR_SET_PDEATHSIG``), makes the configured paths read-only (bind mounts in its mount
  namespace), mounts a /proc of its own, reaps orphans, and exits with the worker's status.
  When PID 1 of a namespace dies the kernel SIGKILLs every process in it, so nothing a reward
  starts — ``setsid()``, double forks included — outlives a timeout or the trainer, even on
  ``kill -9`` of the trainer (launcher dies -> init dies -> the namespace dies);
- the **worker** (PID 2): ``RLIMIT_AS`` / ``RLIMIT_NPROC``, cwd in a private temp dir, no
  capabilities and ``no_new_privs`` (it cannot undo the read-only mounts), then user code.

When the namespaces are refused and ``network: allow`` was asked for, the launcher is the worker
itself (fallback ``session``): its own session, ``PR_SET_PDEATHSIG``, and it is a child
subreaper, so orphans of the reward stay its descendants and the trainer kills the whole tree
at a timeout. With ``network: deny`` a refusal is reported, never ignored.

Protocol: frames of a 4-byte big-endian length then UTF-8 JSON, on private duplicates of the
original stdin (requests) and stdout (replies). fd 0 then reads /dev/null and fd 1 writes to
stderr, so user code that reads input or prints cannot disturb the protocol. Replies are JSON,
never pickle: the parent does not trust what comes back.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import os
import struct
import sys
import traceback
from collections.abc import Callable
from typing import Any, BinaryIO

import gyre.rewards._confine as cf

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


def isolate_network_message(why: str) -> str:
    return (
        f"{why} — this kernel/container does not allow unprivileged user+network namespaces, "
        "so sandboxed rewards cannot be cut off the network here. Set "
        "reward.sandbox.network=allow to run them WITH network access, or run on a host "
        "that permits namespaces (e.g. sysctl kernel.unprivileged_userns_clone=1, or a "
        "container without a seccomp profile that blocks unshare)."
    )


def resolve(path: str) -> Callable[..., Any]:
    """``module:attr`` or ``file.py:attr`` (``attr`` may be dotted) -> the object, or an
    exception."""
    from gyre.plugins import load_object

    obj = load_object(path, "reward.functions.fn")
    if not callable(obj):
        raise TypeError(f"{path} is a {type(obj).__name__}, not a callable")
    return obj


def _call(fns: dict[str, Callable[..., Any]], req: dict[str, Any]) -> dict[str, Any]:
    fn = fns.get(req["fn"]) or resolve(req["fn"])
    out = fn(req["prompts"], req["completions"], **req["columns"], **req["kwargs"])
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    if req.get("text"):  # a text call (the python tool of gyre.rollout.tools): a string back
        return {"ok": True, "values": [], "text": str(out)}
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


def serve(init: dict[str, Any], requests: BinaryIO, replies: BinaryIO, conf: dict) -> int:
    """Limit this process, import the reward modules, then answer calls until stdin closes."""
    notes: list[str] = conf.setdefault("notes", [])
    if init.get("workdir"):
        os.chdir(init["workdir"])
    cf.limit_memory(int(init["memory_mb"]))
    # RLIMIT_NPROC: never applied by the kernel to uid 0; without a user namespace it counts
    # every process of the uid, so it is set only when the worker has a uid of its own.
    if conf.get("cgroup"):
        conf["max_processes"] = int(init["max_processes"])  # pids.max of its cgroup
    elif conf["root"]:
        notes.append(
            "process limit not enforced: the worker runs as root (RLIMIT_NPROC does not apply) "
            "and no pids cgroup could be made; set reward.sandbox.user"
        )
    elif conf["containment"] == "pidns" or conf["own_uid"]:
        cf.limit_processes(int(init["max_processes"]))
        conf["max_processes"] = int(init["max_processes"])
    else:
        notes.append("process limit not enforced: no user namespace and no uid of its own")
    why = cf.drop_capabilities()
    if why:
        notes.append(why)
    sys.path[:] = init["sys_path"]
    fns: dict[str, Callable[..., Any]] = {}
    errors: dict[str, str] = {}
    for path in init["fns"]:
        try:
            fns[path] = resolve(path)
        except BaseException:
            errors[path] = traceback.format_exc(limit=-3)
    write_frame(replies, {"ok": not errors, "errors": errors, "confinement": conf})
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


def ns_init(
    init: dict[str, Any], requests: BinaryIO, replies: BinaryIO, go: int, conf: dict
) -> int:
    """PID 1 of the sandbox's PID namespace: set up mounts, start the worker, reap, exit."""
    cf.prctl(cf.PR_SET_PDEATHSIG, 9)  # dies with the launcher...
    if os.read(go, 1) != b"x":  # ...which may have died before that call: then stop here
        return 1
    os.close(go)
    notes: list[str] = conf["notes"]
    why = cf.make_private_mounts()
    if why is None:
        conf["read_only"] = [p for p in init["read_only"] if os.path.exists(p)]
        errs = cf.read_only_paths(conf["read_only"])
        if errs:
            conf["read_only"] = []
            notes.extend(errs)
        why = cf.mount_proc()
        conf["own_proc"] = why is None
    if why:
        notes.append(why)
    cf.prctl(cf.PR_SET_DUMPABLE, 0)  # the reward (same uid) cannot ptrace init
    worker = os.fork()
    if worker == 0:
        cf.prctl(cf.PR_SET_DUMPABLE, 1)
        return serve(init, requests, replies, conf)
    requests.close()
    replies.close()
    while True:  # as PID 1, reap every orphan of the namespace until the worker exits
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 1
        if pid == worker:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


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
    was_root = os.getuid() == 0
    cgroup = init.get("cgroup")
    if cgroup:  # before any fork: every process of this worker is counted in pids.max
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    why = cf.drop_to_user(init.get("user", ""))
    if why:
        write_frame(replies, {"ok": False, "kind": "isolation", "error": why})
        return 1
    conf: dict[str, Any] = {
        "root": os.getuid() == 0,
        "own_uid": was_root and os.getuid() != 0,
        "read_only": [],
        "own_proc": False,
        "cgroup": cgroup,
        "notes": [],
    }
    flags = cf.CLONE_NEWUSER | cf.CLONE_NEWPID | cf.CLONE_NEWNS
    if init["network"] == "deny":
        flags |= cf.CLONE_NEWNET
    why = cf.unshare(flags)
    if not cf.die_with_parent(int(init["parent_pid"])):
        return 1
    if why is not None:
        if init["network"] == "deny":
            msg = isolate_network_message(why)
            write_frame(replies, {"ok": False, "kind": "isolation", "error": msg})
            return 1
        conf.update(containment="session", notes=[f"{why}: fallback to session containment"])
        cf.prctl(cf.PR_SET_CHILD_SUBREAPER, 1)  # orphans of the reward stay our descendants
        write_frame(replies, {"kind": "confined", "ns_init": None})
        return serve(init, requests, replies, conf)
    conf["containment"] = "pidns"
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os._exit(ns_init(init, requests, replies, go_r, conf))
    os.close(go_r)
    write_frame(replies, {"kind": "confined", "ns_init": pid})
    os.write(go_w, b"x")
    os.close(go_w)
    requests.close()
    replies.close()
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if 128 < code < 128 + 65:  # init reports a worker killed by a signal as 128 + signal
        os.kill(os.getpid(), code - 128)
    return code


if __name__ == "__main__":
    sys.exit(main())
