"""Bounded waits: every wait on a peer has a deadline, a heartbeat, and a named fault.

A peer is anything the run waits on and does not run itself: an engine server, a reward
worker, a Ray actor, a collective, a storage bucket. When one does not answer within its
deadline the run stops with :class:`PeerFault` (exit :data:`EXIT_PEER`, 69, ``EX_UNAVAILABLE``)
and one line naming the kind of peer, the stage that waited, the peer and the time waited:

    gyre: engine fault: completion (no live server): no answer from http://10.0.0.5:8000
    for 20 s (engine.timeout_s=20): http://10.0.0.5:8000: ReadTimeout('timed out')

Long waits log a heartbeat every ``faults.heartbeat_s`` (``waiting for ... : 120 s of 3600 s``)
so a slow stage is told apart from a hung one while it runs. The deadlines come from the config:
``engine.timeout_s`` (HTTP), ``faults.call_timeout_s`` (Ray actor calls),
``faults.startup_timeout_s`` (placement, rendezvous, collectives),
``reward.sandbox.timeout_s`` (reward calls), ``checkpoint.upload_timeout_s`` (object stores).
Every place that waits is listed in docs/operations.md ("Every wait is bounded") and checked by
``tests/unit/test_deadlines.py`` (a scan of the source for waits without a timeout).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

log = logging.getLogger("gyre.deadlines")

EXIT_PEER = 69  # EX_UNAVAILABLE: a peer did not answer in time (sysexits.h)
KINDS = ("engine", "reward worker", "worker", "trainer", "collective", "storage")

T = TypeVar("T")


class PeerFault(RuntimeError):
    """A peer did not answer (or answered unusably) within its deadline; exit 69."""

    def __init__(
        self, kind: str, stage: str, peer: str, waited_s: float, key: str, detail: str = ""
    ):
        self.kind, self.stage, self.peer, self.waited_s, self.key = kind, stage, peer, waited_s, key
        self.detail = detail
        tail = f": {detail}" if detail else ""
        super().__init__(
            f"{kind} fault: {stage}: no answer from {peer} for {waited_s:.0f} s ({key}){tail}"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # raised in a Ray actor, re-raised on the driver
        return type(self), (self.kind, self.stage, self.peer, self.waited_s, self.key, self.detail)


class BadAnswer(RuntimeError):
    """A peer answered, but not usefully (a bad status, a malformed body); exit 69."""

    kind = "peer"


class Heartbeat:
    """Logs ``waiting for <stage> on <peer>`` every ``every_s`` seconds of a long wait."""

    def __init__(self, stage: str, peer: str, timeout_s: float, every_s: float) -> None:
        self.stage, self.peer, self.timeout_s, self.every_s = stage, peer, timeout_s, every_s
        self.t0 = time.monotonic()
        self._next = self.t0 + every_s if every_s > 0 else float("inf")

    @property
    def waited(self) -> float:
        return time.monotonic() - self.t0

    @property
    def left(self) -> float:
        return self.timeout_s - self.waited

    def beat(self) -> None:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self.every_s
            log.warning(
                "gyre: waiting for %s on %s: %.0f s of %.0f s",
                self.stage,
                self.peer,
                now - self.t0,
                self.timeout_s,
            )

    def slice(self) -> float:
        """How long the next blocking wait may last: until the next beat or the deadline."""
        return max(0.0, min(self.left, self.every_s if self.every_s > 0 else self.left))


def ray_ready(
    refs: list[Any], hb: Heartbeat, fault: Callable[[], Exception]
) -> tuple[list[Any], list[Any]]:
    """``ray.wait(refs, num_returns=1)`` in heartbeat slices until one ref is ready: (ready,
    pending). Past ``hb``'s deadline, ``fault()`` is raised instead."""
    import ray

    while True:
        if hb.left <= 0:
            raise fault()
        ready, pending = ray.wait(refs, num_returns=1, timeout=hb.slice())
        if ready:
            return ready, pending
        hb.beat()


def call_with_deadline(
    fn: Callable[[], T],
    kind: str,
    stage: str,
    peer: str,
    timeout_s: float,
    key: str,
    heartbeat_s: float = 60.0,
) -> T:
    """``fn()`` in a daemon thread; :class:`PeerFault` if it has not returned in ``timeout_s``.

    For blocking library calls that take no timeout of their own (an fsspec upload). A call
    that overruns is abandoned, not killed: the run stops on the fault anyway.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn()
        except BaseException as exc:  # handed to the waiting thread
            box["err"] = exc

    th = threading.Thread(target=run, daemon=True, name=f"gyre-{stage}")
    th.start()
    hb = Heartbeat(stage, peer, timeout_s, heartbeat_s)
    while th.is_alive() and hb.left > 0:
        th.join(timeout=hb.slice() or 0.01)
        hb.beat()
    if th.is_alive():
        raise PeerFault(kind, stage, peer, hb.waited, key)
    if "err" in box:
        raise box["err"]
    return box["out"]


def is_collective_timeout(exc: BaseException) -> bool:
    """A torch.distributed collective that gave up waiting for a peer: gloo raises "Timed
    out waiting <N>ms for recv operation", c10d "... timed out" / "Timeout"."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("timed out" in text or "timeout" in text)


@contextmanager
def collective_deadline(stage: str, rank: int, world_size: int, timeout_s: float) -> Iterator[None]:
    """Runs a trainer rank's part of ``stage``; a collective in it that timed out (the process
    group's timeout, ``faults.startup_timeout_s``) becomes a :class:`PeerFault` of kind
    ``collective``. The rank cannot tell which peer never came; the driver, which sees whose
    call has not returned, names it (:meth:`gyre.runners.bounded.Waits.get`)."""
    try:
        yield
    except RuntimeError as exc:
        if world_size < 2 or not is_collective_timeout(exc):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        peer = f"the trainer ranks other than {rank}"
        key = f"faults.startup_timeout_s={timeout_s:g}"
        raise PeerFault("collective", stage, peer, timeout_s, key, first[:300]) from exc
