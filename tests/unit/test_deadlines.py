"""Every wait on a peer is bounded, names what it waited for, and ends with exit 69.

``test_no_wait_in_the_source_lacks_a_timeout`` scans ``src/gyre`` for the calls that can block
forever without a timeout argument (``ray.get``/``ray.wait``, a future's ``.result()``, a queue's
``.get()``, a thread's ``.join()``, ``.wait()``, ``communicate``, ``subprocess.run``, HTTP clients,
``urlopen``, ``init_process_group``); the few left are listed below with the reason they are not
waits on a peer. One fault test per kind of wait follows (the HTTP engine's are in
tests/integration/test_sync_faults.py, the Ray actor's in tests/integration/test_ray_faults.py).
"""

from __future__ import annotations

import ast
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import gyre
from gyre.checkpoint.store import CheckpointStore
from gyre.cli import _error_line
from gyre.deadlines import EXIT_PEER, PeerFault, call_with_deadline, collective_deadline
from gyre.engines.http_engine import HttpEngine, NoServerError
from gyre.types import GenerationRequest, SamplingParams
from serve_helpers import free_port

SRC = Path(gyre.__file__).parent

# (file, call): why it needs no deadline of its own
ALLOWED = {
    ("serve/host.py", "self.queue.get()"): "gyre serve's batcher idling until a "
    "request arrives: the server waits for clients, not on a peer",
    ("tinker/futures.py", "self._ready.wait()"): "gyre tinker-serve's worker idling until a "
    "client submits a request (close() wakes it): the server waits for clients, not on a peer",
    ("rewards/_worker.py", "os.wait()"): "the sandbox's own init reaping the reward's "
    "processes; the trainer bounds the whole sandbox by killing it (reward.sandbox.timeout_s)",
    ("rewards/contract.py", "th.join()"): "in-process reward functions (async ones called "
    "from a running event loop) are the user's trusted code in the trainer's process, like the "
    "env; untrusted or hanging rewards belong in reward.sandbox, which bounds every call",
}
_HTTP = ("get", "post", "put", "request", "Client", "AsyncClient", "stream")
_SUBPROCESS = ("subprocess.run", "subprocess.check_output", "subprocess.call")


def _unbounded(call: ast.Call) -> bool:
    """Whether ``call`` is a blocking call without a timeout argument."""
    fn, name = call.func, ast.unparse(call.func)
    attr = fn.attr if isinstance(fn, ast.Attribute) else getattr(fn, "id", "")
    has = any(k.arg == "timeout" for k in call.keywords)
    bare = isinstance(fn, ast.Attribute) and not call.args and not call.keywords
    if name in ("ray.get", "ray.wait", *_SUBPROCESS) or attr in ("communicate", "urlopen"):
        return not has
    if attr == "init_process_group":
        return not has
    if name.startswith(("httpx.", "requests.")) and attr in _HTTP:
        return not has
    return bare and attr in ("result", "get", "join", "wait")


def unbounded_waits(root: Path) -> list[tuple[str, str, int]]:
    """(file, call, line) of every unbounded wait under ``root`` (an argument of
    ``asyncio.wait_for`` is bounded by it)."""
    out = []
    for f in sorted(root.rglob("*.py")):
        text = f.read_text()
        tree = ast.parse(text)
        inside_wait_for = {
            id(a)
            for n in ast.walk(tree)
            if isinstance(n, ast.Call) and ast.unparse(n.func) == "asyncio.wait_for"
            for a in n.args
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and id(node) not in inside_wait_for and _unbounded(node):
                seg = ast.get_source_segment(text, node) or ""
                out.append((str(f.relative_to(root)), seg, node.lineno))
    return out


def test_no_wait_in_the_source_lacks_a_timeout():
    found = unbounded_waits(SRC)
    unexplained = [(f, c, line) for f, c, line in found if (f, c) not in ALLOWED]
    assert not unexplained, f"waits without a timeout (give one, or explain it): {unexplained}"
    stale = set(ALLOWED) - {(f, c) for f, c, _ in found}
    assert not stale, f"allowed waits no longer in the source: {stale}"


def test_the_scan_finds_each_kind_of_unbounded_wait(tmp_path):
    (tmp_path / "m.py").write_text(
        "ray.get(x)\nray.get(x, timeout=1)\nfut.result()\nfut.result(timeout=2)\nq.get()\n"
        "d.get('k')\nth.join()\n', '.join(xs)\nev.wait()\nhttpx.post(u)\nhttpx.Client()\n"
        "httpx.Client(timeout=3)\nsubprocess.run(c)\nasyncio.wait_for(q.get(), 1)\n"
    )
    assert [line for _, _, line in unbounded_waits(tmp_path)] == [1, 3, 5, 7, 9, 10, 11, 13]


def test_a_call_past_its_deadline_is_a_named_fault_with_a_heartbeat(caplog):
    caplog.set_level(logging.WARNING, logger="gyre.deadlines")
    t0 = time.monotonic()
    with pytest.raises(PeerFault) as err:
        call_with_deadline(
            lambda: time.sleep(30), "storage", "checkpoint upload", "s3://b/run", 0.6,
            "checkpoint.upload_timeout_s", heartbeat_s=0.2,
        )  # fmt: skip
    assert time.monotonic() - t0 < 5
    assert str(err.value).startswith(
        "storage fault: checkpoint upload: no answer from s3://b/run for 1 s "
        "(checkpoint.upload_timeout_s)"
    )
    assert "waiting for checkpoint upload on s3://b/run" in caplog.text
    assert call_with_deadline(lambda: 7, "storage", "x", "y", 5, "k") == 7
    with pytest.raises(ZeroDivisionError):
        call_with_deadline(lambda: 1 / 0, "storage", "x", "y", 5, "k")


def test_a_hung_object_store_upload_is_a_storage_fault(tmp_path, monkeypatch):
    store = CheckpointStore("memory://hung-bucket/run", upload_timeout_s=0.5)
    monkeypatch.setattr(store, "_upload", lambda stage, name: time.sleep(30))
    with pytest.raises(PeerFault, match=r"storage fault: checkpoint upload: .*step_000001"):
        store.write("step_000001", lambda d: (d / "a.txt").write_text("x"), {})
    assert not store.fs.exists(store.path("step_000001"))
    line, code = _error_line(PeerFault("storage", "checkpoint upload", "s3://b", 3, "k"))
    assert code == EXIT_PEER == 69 and line.startswith("gyre: storage fault: ")


def test_no_server_is_an_engine_fault_exit_69_naming_stage_peer_and_time():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    engine = HttpEngine([url], model="m", timeout_s=1.0, health_interval_s=0.1, max_retries=2)
    try:
        with pytest.raises(NoServerError) as err:
            engine.generate([GenerationRequest([1, 2])], SamplingParams(max_new_tokens=2))
    finally:
        engine.close()
    line, code = _error_line(err.value)
    assert code == 69
    assert line.startswith(f"gyre: engine fault: completion (no live server): no answer from {url}")
    assert "(engine.timeout_s=1)" in line and "ConnectError" in line


def _rank(rank: int, port: int, out: Any) -> None:
    """A gloo rank of two with a 2 s process-group timeout: rank 0 all-reduces, rank 1 never
    reaches the collective (it sleeps, as a wedged rank would)."""
    import datetime

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=2))  # fmt: skip
    if rank == 1:
        time.sleep(20)
        return
    t0 = time.monotonic()
    try:
        with collective_deadline("update of step 3", 0, 2, 2.0):
            dist.all_reduce(torch.ones(4))
        out.put(("returned", "", 0.0))
    except PeerFault as exc:
        out.put((exc.kind, str(exc), time.monotonic() - t0))
    except BaseException as exc:  # what the test must see if the guard misses it
        out.put((type(exc).__name__, str(exc), time.monotonic() - t0))


def test_a_rank_that_never_reaches_a_collective_is_a_named_collective_fault():
    """A real gloo all-reduce whose peer never comes gives up after the process group's
    timeout; the waiting rank's guard turns gloo's error into a collective fault (exit 69)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        kind, text, waited = out.get(timeout=60)
    finally:
        for p in procs:
            p.kill()
            p.join(timeout=10)
    assert kind == "collective", text
    assert text.startswith(
        "collective fault: update of step 3: no answer from the trainer ranks other than 0 "
        "for 2 s (faults.startup_timeout_s=2)"
    ), text
    assert 1.5 < waited < 30
    line, code = _error_line(PeerFault("collective", "x", "y", 2, "k"))
    assert code == 69 and line.startswith("gyre: collective fault: x")


class _Ref:
    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error


class _FakeRay:
    """Enough of ``ray`` for :class:`Waits`: refs in ``running`` never become ready."""

    def __init__(self, running: list[_Ref]) -> None:
        self.running = running

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r not in self.running]
        return ready, [r for r in refs if r in self.running]

    def get(self, refs, timeout=None):
        for r in refs if isinstance(refs, list) else [refs]:
            if r.error is not None:
                raise r.error
        return [r.value for r in refs] if isinstance(refs, list) else refs.value


def test_the_driver_names_the_rank_that_never_reached_the_collective(monkeypatch):
    """Rank 0 reports a collective timeout while rank 1's call still runs: the driver stops at
    once (not after faults.call_timeout_s) and names rank 1; a rank that died wins instead,
    so the group restarts."""
    from gyre.config.ops import FaultsConfig
    from gyre.runners.bounded import Waits

    timed_out = PeerFault(
        "collective", "update of step 3", "the trainer ranks other than 0", 600,
        "faults.startup_timeout_s=600", "Timed out waiting 600000ms",
    )  # fmt: skip
    wedged = _Ref()
    monkeypatch.setitem(sys.modules, "ray", _FakeRay([wedged]))
    waits = Waits(FaultsConfig(call_timeout_s=3600, heartbeat_s=1))
    t0 = time.monotonic()
    with pytest.raises(PeerFault) as err:
        waits.get([_Ref(error=timed_out), wedged], "trainer", "update of step 3", "the group")
    assert time.monotonic() - t0 < 5
    assert str(err.value) == (
        "collective fault: update of step 3: no answer from trainer rank 1 for 600 s "
        "(faults.startup_timeout_s=600): rank 0 timed out in a collective that rank 1 never "
        "reached"
    )
    died = RuntimeError("the actor died unexpectedly")
    with pytest.raises(RuntimeError, match="died"):
        waits.get([_Ref(error=timed_out), _Ref(error=died), wedged], "trainer", "s", "g")
    monkeypatch.setitem(sys.modules, "ray", _FakeRay([]))
    assert waits.get([_Ref(1), _Ref(2)], "trainer", "s", "g") == [1, 2]
    with pytest.raises(PeerFault) as err:  # every rank timed out: the rank's own line
        waits.get([_Ref(error=timed_out), _Ref(error=timed_out)], "trainer", "s", "g")
    assert err.value is timed_out
