"""Futures: every long request is queued now and its result retrieved later.

One worker thread runs the queue in arrival order. A queue may have several *lanes*, each
with its own jobs and worker threads (``runner: ray``: training on a lane of one worker, so its
order is kept; sampling on a lane of one worker per sampler actor, since a sample reads only
saved, frozen weights); a queue with one lane is the plain single-worker queue. The SDK
sends a training client's requests one after another (each waits for the previous one's
submission), so arrival order is its ``seq_id`` order, and work on one model always runs in
the order the client issued it.
Batchable jobs (samples from the same frozen weights with the same sampling parameters) that
stand next to each other at the head of the queue run as one batch: they read no state that
other jobs change, so this reorders nothing observable. A result waits for
``retrieve_future`` until ``result_ttl_s`` after it finished; a client that disappears
mid-future costs nothing but that memory until then.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
import uuid
from collections import deque
from collections.abc import Callable, Hashable
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


@dataclass
class Job:
    request_id: str
    fn: Callable[[list[Any]], list[dict[str, Any] | bytes]]
    item: Any = None
    key: Hashable | None = None  # jobs with equal keys may run as one batch
    name: str = "job"  # for the log


class FutureQueue:
    def __init__(
        self, ttl_s: float, max_batch: int = 64, lanes: dict[str, int] | None = None
    ) -> None:
        """``lanes``: lane name -> worker threads (default: one lane ``main``, one worker)."""
        self.ttl_s, self.max_batch = ttl_s, max_batch
        lanes = lanes or {"main": 1}
        self._jobs: dict[str, deque[Job]] = {lane: deque() for lane in lanes}
        self._ready = threading.Condition()
        self._closed = False
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._workers = [
            threading.Thread(target=self._run, args=(lane,), name=f"tinker-{lane}", daemon=True)
            for lane, n in lanes.items()
            for _ in range(n)
        ]
        for worker in self._workers:
            worker.start()

    def submit(
        self, fn: Callable[[], dict[str, Any] | bytes], name: str = "job", lane: str = "main"
    ) -> str:
        return self.submit_batchable(None, None, lambda items: [fn()], name, lane)

    def submit_batchable(
        self,
        key: Hashable | None,
        item: Any,
        fn: Callable[[list[Any]], list[Any]],
        name: str = "job",
        lane: str = "main",
    ) -> str:
        """Queue ``fn([item, ...])`` on ``lane``; with a ``key``, neighbours of the same key
        join one call."""
        request_id = uuid.uuid4().hex
        with self._lock:
            self._evict()
            self._pending[request_id] = Pending()
        with self._ready:
            self._jobs[lane].append(Job(request_id, fn, item, key, name))
            self._ready.notify_all()
        return request_id

    def wait(self, request_id: str, timeout: float) -> Result | None:
        """The result, or None while it runs; KeyError if the id is unknown or expired."""
        with self._lock:
            pending = self._pending[request_id]
        pending.done.wait(timeout)
        return pending.result

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()

    def _evict(self) -> None:
        cutoff = time.monotonic() - self.ttl_s
        stale = [k for k, p in self._pending.items() if p.result and p.result.done_at < cutoff]
        for k in stale:
            del self._pending[k]

    def _next(self, lane: str) -> list[Job] | None:
        jobs = self._jobs[lane]
        with self._ready:
            while not jobs and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            batch = [jobs.popleft()]
            key = batch[0].key
            while key is not None and jobs and jobs[0].key == key and len(batch) < self.max_batch:
                batch.append(jobs.popleft())
            return batch

    def _run(self, lane: str) -> None:
        while (batch := self._next(lane)) is not None:
            start = time.perf_counter()
            try:
                payloads = batch[0].fn([job.item for job in batch])
                results = [Result(payload=p) for p in payloads]
            except TinkerError as exc:
                results = [Result(error=(exc.message, exc.category)) for _ in batch]
            except Exception as exc:  # the server must outlive any one bad request
                log.error("request %s failed:\n%s", batch[0].request_id, traceback.format_exc())
                msg = f"internal error: {type(exc).__name__}: {exc}"
                results = [Result(error=(msg, "server")) for _ in batch]
            now = time.monotonic()
            took = time.perf_counter() - start
            log.info("%s: %d request(s) in %.2fs", batch[0].name, len(batch), took)
            for job, result in zip(batch, results, strict=True):
                result.done_at = now
                with self._lock:
                    pending = self._pending.get(job.request_id)
                if pending is not None:
                    pending.result = result
                    pending.done.set()
