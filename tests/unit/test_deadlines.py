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
import time
from pathlib import Path

import pytest

import gyre
from gyre.checkpoint.store import CheckpointStore
from gyre.cli import _error_line
from gyre.deadlines import EXIT_PEER, PeerFault, call_with_deadline
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
