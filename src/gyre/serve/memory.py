"""Sleep and wake for ``gyre serve``: the memory hand-over endpoints of vLLM and SGLang.

In a colocated placement the engines and the trainer share one pool of accelerator memory, so
the engines give theirs back before each update and take it again for the next rollout. The
real servers' endpoints, which gyre calls (``gyre.engines.handover``) and this server answers:

- vLLM (``--enable-sleep-mode``, with ``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=1``
  (level 1 moves the weights to host memory and drops the KV cache; level 2 drops the weights
  too), ``POST /wake_up``, ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``;
- SGLang: ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation`` (JSON body,
  optional ``tags``).

Here both pairs do the same to the served model: sleeping drops the parked KV caches, moves the
weights to host memory and empties the device allocator's cache; waking moves them back. Level 2
is answered as level 1 (the weights are kept in host memory: a later weight load fills them).
The answer carries what it cost: ``freed_bytes`` (device memory given back, from
``torch.cuda.memory_allocated``; 0 on a CPU server, which has no device memory to give) and
``seconds``. While asleep, generation routes answer 503 naming ``/wake_up``; weight loads still
work (into the host copy).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import torch

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")


def _device_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


class Sleeper:
    """The sleep state of one served model (called on the engine thread)."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.sleeping = False
        self.counts = {"sleeps": 0, "wakes": 0}

    def sleep(self) -> dict[str, float]:
        t0 = time.perf_counter()
        engine = self.host.engine
        if self.sleeping:
            return {"freed_bytes": 0, "seconds": 0.0}
        before = _device_bytes(engine.device)
        engine.reset_cache()
        engine.model.to("cpu")
        gc.collect()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
        self.sleeping = True
        self.counts["sleeps"] += 1
        freed = before - _device_bytes(engine.device)
        return {"freed_bytes": freed, "seconds": time.perf_counter() - t0}

    def wake(self) -> dict[str, float]:
        t0 = time.perf_counter()
        engine = self.host.engine
        if self.sleeping:
            engine.model.to(engine.device)
            engine.reset_cache()
            self.sleeping = False
            self.counts["wakes"] += 1
        return {"seconds": time.perf_counter() - t0}


def add_memory_routes(app: Any, host: Any, batcher: Any, auth: list[Any]) -> Sleeper:
    """The vLLM and SGLang sleep / wake routes, and a 503 for generation while asleep."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    sleeper = Sleeper(host)
    app.state.sleeper = sleeper

    @app.middleware("http")
    async def refuse_while_asleep(request: Request, call_next: Any) -> Any:
        if sleeper.sleeping and request.url.path in GENERATION_PATHS:
            message = "the engine is asleep (memory released): POST /wake_up first"
            body = {"error": {"message": message, "type": "ServiceUnavailable", "code": 503}}
            return JSONResponse(status_code=503, content=body)
        return await call_next(request)

    @app.post("/sleep", dependencies=auth)
    async def sleep(level: int = 1) -> Any:
        if level not in (1, 2):
            body = {"error": {"message": f"level={level}: use 1 or 2", "param": "level"}}
            return JSONResponse(status_code=400, content=body)
        return await batcher.run_in_engine(sleeper.sleep)

    @app.post("/wake_up", dependencies=auth)
    async def wake_up() -> Any:
        return await batcher.run_in_engine(sleeper.wake)

    @app.get("/is_sleeping", dependencies=auth)
    async def is_sleeping() -> Any:
        return {"is_sleeping": sleeper.sleeping, **sleeper.counts}  # vLLM's key, then ours

    @app.post("/release_memory_occupation", dependencies=auth)
    async def release() -> Any:
        return {"success": True, **(await batcher.run_in_engine(sleeper.sleep))}

    @app.post("/resume_memory_occupation", dependencies=auth)
    async def resume() -> Any:
        return {"success": True, **(await batcher.run_in_engine(sleeper.wake))}

    return sleeper
