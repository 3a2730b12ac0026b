"""One accelerator pool handed back and forth: engines sleep for the update, wake for rollout.

In a colocated placement with external engines (``engine.kind=http``) the inference servers and
the trainer share the same devices. Before the update gyre puts every live server to sleep
through its own endpoint, and wakes it before the new weights are loaded and the next rollout:

    engine.api=openai (vLLM)   POST /sleep?level=N      POST /wake_up
    engine.api=sglang          POST /release_memory_occupation   POST /resume_memory_occupation

(vLLM serves them with ``--enable-sleep-mode`` and ``VLLM_SERVER_DEV_MODE=1``; SGLang with
``--enable-memory-saver``; ``gyre serve`` always, see ``gyre.serve.memory``.) A server
that refuses is a one-line error naming it and the route. The seconds of each hand-over and the
device memory a server reports freed (``freed_bytes``: ``gyre serve`` reports it; vLLM and
SGLang answer without it, so their share is not counted) become ``handover/*`` metrics.

The trainer's side (offloading its optimizer state while the engines run) is
``gyre.runners.handover``.
"""

from __future__ import annotations

import time
from typing import Any

from gyre.engines.http_engine import HttpEngine, ServerError


def _routes(engine: HttpEngine, level: int) -> tuple[tuple[str, Any], tuple[str, Any]]:
    """((sleep route, its JSON body), (wake route, its body)) of the engine's server API."""
    if engine.api == "sglang":
        return ("/release_memory_occupation", {}), ("/resume_memory_occupation", {})
    return (f"/sleep?level={level}", None), ("/wake_up", None)


def _post_all(engine: HttpEngine, route: str, body: Any) -> int:
    """POST ``route`` to every live server; returns the device bytes they report freed."""
    freed = 0
    for s in engine.servers:
        if not s.alive:
            continue
        try:
            r = engine.pool.client.post(f"{s.url}{route}", json=body)
        except engine.pool.httpx.TransportError as exc:
            engine.pool.take_out(s, f"{route}: {exc!r}")
            continue
        if r.status_code != 200:
            raise ServerError(f"{s.url}{route} answered {r.status_code}: {r.text[:300]}")
        if r.headers.get("content-type", "").startswith("application/json"):
            data = r.json()
            if isinstance(data, dict):
                freed += int(data.get("freed_bytes", 0) or 0)
    return freed


def sleep_engines(engine: HttpEngine, level: int = 1) -> dict[str, float]:
    """Every live server gives its device memory back (before the trainer's update)."""
    t0 = time.perf_counter()
    (route, body), _ = _routes(engine, level)
    freed = _post_all(engine, route, body)
    return {
        "handover/engine_sleep_s": time.perf_counter() - t0,
        "handover/engine_freed_bytes": float(freed),
    }


def wake_engines(engine: HttpEngine) -> dict[str, float]:
    """Every live server takes its memory again (before the weight load and rollout)."""
    t0 = time.perf_counter()
    _, (route, body) = _routes(engine, 1)
    _post_all(engine, route, body)
    return {"handover/engine_wake_s": time.perf_counter() - t0}
