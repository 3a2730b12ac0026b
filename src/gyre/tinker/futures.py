"""Futures: every long request is queued now and its result retrieved later.

One worker thread runs the queue in arrival order. The SDK sends a training client's requests
one after another (each waits for the previous one's submission), so arrival order is its
``seq_id`` order, and work on one model always runs in the order the client issued it. A
result waits for ``retrieve_future`` until ``result_ttl_s`` after it finished; a client that
disappears mid-future costs nothing but that memory until then.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gyre.tinker.errors import TinkerError

log = logging.getLogger("gyre.tinker")


@dataclass
class Result:
    """A finished request: a JSON object, protobuf bytes, or an error (message, category)."""

    payload: dict[str, Any] | bytes | None = None
    error: tuple[str, str] | None = None
    done_at: float = 0.0


@dataclass
class Pending:
    done: threading.Event = field(default_factory=threading.Event)
    result: Result | None = None


class FutureQueue:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._jobs: queue.Queue[tuple[str, Callable[[], Any]] | None] = queue.Queue()
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name="tinker-worker", daemon=True)
        self._worker.start()

    def submit(self, fn: Callable[[], dict[str, Any] | bytes]) -> str:
        request_id = uuid.uuid4().hex
        with self._lock:
            self._evict()
            self._pending[request_id] = Pending()
        self._jobs.put((request_id, fn))
        return request_id

    def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None while it runs; KeyError if the id is unknown or expired."""
        with self._lock:
            pending = self._pending[request_id]
        pending.done.wait(timeout)
        return pending.result

    def close(self) -> None:
        self._jobs.put(None)

    def _evict(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        stale = [k for k, p in self._pending.items() if p.result and p.result.done_at < cutoff]
        for k in stale:
            del self._pending[k]

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            request_id, fn = job
            try:
                result = Result(payload=fn())
            except TinkerError as exc:
                result = Result(error=(exc.message, exc.category))
            except Exception as exc:  # the server must outlive any one bad request
                log.error("request %s failed:\n%s", request_id, traceback.format_exc())
                result = Result(error=(f"internal error: {type(exc).__name__}: {exc}", "server"))
            result.done_at = time.monotonic()
            with self._lock:
                pending = self._pending.get(request_id)
            if pending is not None:
                pending.result = result
                pending.done.set()
