"""The servers one HTTP engine talks to: which are live, and which takes the next request.

Load balancing: each request goes to the live server with the fewest requests in flight. A
server whose request fails (connection refused or reset, timeout, 5xx, or 404 for a model it
should hold) is taken out. A background thread probes ``/health`` of servers that are out; one
that answers again is handed to the engine's ``bring_up`` (which brings it to the current
policy and checks it serves it) and only then put back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gyre.deadlines import PeerFault
from gyre.engines.http_wire import ServerError

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    url: str
    alive: bool = True
    inflight: int = 0
    served: int = 0  # completed generation requests
    failures: int = 0
    last_error: str = ""


class NoServerError(PeerFault):
    """No server answered a stage of the run within its deadline: an engine fault (exit 69)
    naming the stage, every server with its last error, and the time waited."""

    def __init__(self, stage: str, servers: list[ServerState], waited_s: float, key: str) -> None:
        peers = ", ".join(s.url for s in servers)
        errors = "; ".join(f"{s.url}: {s.last_error}" for s in servers if s.last_error)
        super().__init__("engine", stage, peers, waited_s, key, errors)


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:
        raise ImportError("engine.kind=http needs httpx: pip install 'gyre[serve]'") from exc
    return httpx


@dataclass(frozen=True)
class HttpSettings:
    """How an HTTP engine reaches its servers (the ``engine.*`` keys of the same names).

    ``timeout_s`` bounds one request (and the wait for a live server); a failed request is
    retried on another server up to ``max_retries`` times; servers that are out are probed
    every ``health_interval_s``; at most ``max_concurrency`` requests are in flight."""

    api_key: str = ""
    timeout_s: float = 120.0
    max_retries: int = 8
    health_interval_s: float = 1.0
    max_concurrency: int = 64


class ServerPool:
    """The live set of ``urls``, one HTTP client over all of them, and their counts
    (``stats``: requests, retries, servers taken out and put back)."""

    def __init__(self, urls: list[str], settings: HttpSettings) -> None:
        httpx = _httpx()
        self.httpx = httpx
        t = settings.timeout_s
        headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self.client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(t, connect=min(5.0, t)),
            limits=httpx.Limits(max_connections=settings.max_concurrency + 4),
        )
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.timeout_s = t
        self.health_interval_s = settings.health_interval_s
        self.stats = {"requests": 0, "retries": 0, "servers_taken_out": 0, "servers_put_back": 0}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._rr = 0

    def start_health(self, bring_up: Callable[[ServerState], None]) -> None:
        """Probe the servers that are out every ``health_interval_s``; ``bring_up`` gets each
        that answers (and calls :meth:`put_back` once it serves the current policy)."""
        health = threading.Thread(
            target=self._health_loop, args=(bring_up,), daemon=True, name="gyre-health"
        )
        health.start()

    def alive_count(self) -> int:
        return sum(s.alive for s in self.servers)

    def close(self) -> None:
        self._stop.set()
        self.client.close()

    def list_models(self, s: ServerState) -> list[str]:
        r = self.client.get(f"{s.url}/v1/models")
        if r.status_code != 200:
            raise ServerError(f"{s.url}/v1/models answered {r.status_code}: {r.text[:200]}")
        return [m["id"] for m in r.json().get("data", [])]

    def discover_base(self) -> str:
        """The first base model (no ``parent``) a live server lists: what requests name when
        ``engine.model`` is not set."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for s in self.servers:
                if not s.alive:
                    continue
                try:
                    r = self.client.get(f"{s.url}/v1/models")
                    if r.status_code == 200:
                        data = r.json().get("data", [])
                        bases = [m["id"] for m in data if not m.get("parent")]
                        if bases:
                            return bases[0]
                except self.httpx.TransportError as exc:
                    self.take_out(s, repr(exc))
            self.wait_for_server(deadline)
        raise NoServerError(
            "start-up (GET /v1/models)", self.servers, self.timeout_s, "engine.timeout_s"
        )

    def pick(self, deadline: float) -> ServerState:
        """The live server with the fewest requests in flight (ties taken in turn), counted in
        flight; waits for one until ``deadline``."""
        with self._cond:
            while True:
                live = [s for s in self.servers if s.alive]
                if live:
                    self._rr += 1
                    n = len(live)
                    s = min((live[(self._rr + j) % n] for j in range(n)), key=lambda x: x.inflight)
                    s.inflight += 1
                    return s
                left = deadline - time.monotonic()
                if left <= 0:
                    key = f"engine.timeout_s={self.timeout_s:g}"
                    stage = "completion (no live server)"
                    raise NoServerError(stage, self.servers, self.timeout_s, key)
                self._cond.wait(min(left, self.health_interval_s))

    def wait_for_server(self, deadline: float) -> None:
        with self._cond:
            if not any(s.alive for s in self.servers):
                self._cond.wait(max(0.0, min(deadline - time.monotonic(), self.health_interval_s)))

    def done(self, s: ServerState, ok: bool) -> None:
        with self._cond:
            s.inflight -= 1
            if ok:
                s.served += 1
                self.stats["requests"] += 1

    def count_retry(self) -> None:
        with self._cond:
            self.stats["retries"] += 1

    def take_out(self, s: ServerState, why: str) -> None:
        with self._cond:
            s.last_error = why
            s.failures += 1
            if s.alive:
                s.alive = False
                self.stats["servers_taken_out"] += 1
                log.warning("gyre: server %s taken out: %s", s.url, why)

    def put_back(self, s: ServerState) -> None:
        with self._cond:
            s.alive = True
            s.last_error = ""
            self.stats["servers_put_back"] += 1
            self._cond.notify_all()

    def _health_loop(self, bring_up: Callable[[ServerState], None]) -> None:
        while not self._stop.wait(self.health_interval_s):
            for s in self.servers:
                if s.alive or self._stop.is_set():
                    continue
                try:
                    r = self.client.get(f"{s.url}/health", timeout=2.0)
                    if r.status_code != 200:
                        continue
                    bring_up(s)
                except Exception as exc:  # a probe must never kill the health thread
                    s.last_error = repr(exc)
