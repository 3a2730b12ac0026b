"""``gyre tinker-serve``: the Tinker API (``/api/v1/...``) over gyre, for the official SDK.

    gyre tinker-serve [--host H] [--port P] [--api-key-file F] [key=value ...]

Point the SDK at it with ``TINKER_BASE_URL=http://127.0.0.1:8000`` (or
``ServiceClient(base_url=...)``) and an API key: the SDK insists on one that starts with
``tml-``; the server checks it only when started with ``--api-key-file`` (required for a
non-loopback ``--host``). Routes, futures and what is not supported: docs/tinker.md.
"""

import argparse
import asyncio
import hmac
import ipaddress
import logging
from pathlib import Path
from typing import Any

from gyre.tinker.config import TinkerRayConfig, TinkerServeConfig, load_tinker_config
from gyre.tinker.errors import NotFound, TinkerError, UserError
from gyre.tinker.service import TinkerService
from gyre.tinker.wire import PROTO_CONTENT_TYPE, decode_forward_backward

log = logging.getLogger("gyre.tinker")

# Feature flags the SDK reads from /api/v1/client/config; everything not listed keeps the SDK's
# default. Chunks of one forward_backward go one after another (so arrival order is seq_id
# order), custom losses are uploaded and run here, and samples are fetched one retrieve_future
# each.
V1 = "/api/v1"

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False,
    "use_pyqwest_transport": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": True,
    "sample_join_sampling_session": False,
}


def _json(status: int, content: Any) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content=content)


def _error(status: int, message: str) -> Any:
    """The SDK reads ``detail`` (and shows the body); ``error`` mirrors gyre serve's shape."""
    return _json(status, {"detail": message, "error": {"message": message, "code": status}})


def future(request_id: str, **extra: Any) -> dict[str, Any]:
    """An ``UntypedAPIFuture``: what every queued request answers at once."""
    return {"request_id": request_id, **extra}


async def _body(request: Any) -> dict[str, Any]:
    import json

    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as exc:
        raise UserError(f"body: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise UserError("body: expected a JSON object")
    return body


def create_app(service: TinkerService, api_key: str = "") -> Any:
    from fastapi import FastAPI, Request
    from starlette.exceptions import HTTPException

    app = FastAPI(title="gyre tinker-serve")
    want = api_key.encode()

    @app.middleware("http")
    async def auth(request: Request, call_next: Any) -> Any:
        if want and request.url.path != "/api/v1/healthz":
            got = request.headers.get("x-api-key", "")
            bearer = request.headers.get("authorization", "")
            got = got or (bearer[7:] if bearer.lower().startswith("bearer ") else "")
            if not hmac.compare_digest(got.encode(), want):
                return _error(401, "invalid or missing API key (X-API-Key header)")
        return await call_next(request)

    @app.exception_handler(TinkerError)
    async def _tinker_error(_: Request, exc: TinkerError) -> Any:
        return _error(exc.status, exc.message)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Any:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Any:
        log.exception("internal error in %s", request.url.path)
        return _error(500, f"internal error in {request.url.path}: {type(exc).__name__}: {exc}")

    for add in (_session_routes, _training_routes, _sampling_routes, _rest_routes):
        add(app, service)
    return app


def _session_routes(app: Any, service: TinkerService) -> None:
    """Client start-up, sessions and models."""
    from fastapi import Request
    from fastapi.responses import Response

    @app.get(f"{V1}/healthz")
    async def healthz() -> Any:
        return {"status": "ok"}

    @app.post(f"{V1}/client/config")
    async def client_config() -> Any:
        return CLIENT_CONFIG

    @app.post(f"{V1}/client/dynamic_config")
    async def dynamic_config() -> Any:
        return {"sample_cancel_enabled": False}

    @app.post(f"{V1}/telemetry")
    async def telemetry() -> Any:
        return {"status": "accepted"}

    @app.get(f"{V1}/get_server_capabilities")
    async def capabilities() -> Any:
        return service.capabilities()

    @app.post(f"{V1}/create_session")
    async def create_session(request: Request) -> Any:
        return service.create_session(await _body(request))

    @app.post(f"{V1}/session_heartbeat")
    async def heartbeat(request: Request) -> Any:
        service.heartbeat(str((await _body(request)).get("session_id")))
        return {"type": "session_heartbeat"}

    @app.post(f"{V1}/sessions/{{session_id}}/finish")
    async def finish(session_id: str) -> Any:
        service.finish_session(session_id)
        return Response(status_code=204)

    @app.post(f"{V1}/create_model")
    async def create_model(request: Request) -> Any:
        return future(service.create_model(await _body(request)))

    @app.post(f"{V1}/get_info")
    async def get_info(request: Request) -> Any:
        return service.get_info(await _body(request))


def _training_routes(app: Any, service: TinkerService) -> None:
    """forward_backward, optim_step and the weights routes (futures)."""
    from fastapi import Request

    @app.post(f"{V1}/forward_backward")
    async def forward_backward(request: Request) -> Any:
        if PROTO_CONTENT_TYPE not in request.headers.get("content-type", ""):
            raise UserError(f"body: forward_backward takes {PROTO_CONTENT_TYPE} (the SDK's)")
        raw = await request.body()
        call = decode_forward_backward(raw, request.headers.get("content-encoding", ""))
        return future(service.forward_backward(call), model_id=call.model_id)

    @app.post(f"{V1}/create_custom_loss")
    async def create_custom_loss(request: Request) -> Any:
        return future(service.create_custom_loss(await _body(request)))

    @app.post(f"{V1}/optim_step")
    async def optim_step(request: Request) -> Any:
        return future(service.optim_step(await _body(request)))

    @app.post(f"{V1}/save_weights")
    async def save_weights(request: Request) -> Any:
        return future(service.save_weights(await _body(request), "weights"))

    @app.post(f"{V1}/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> Any:
        return future(service.save_weights(await _body(request), "sampler_weights"))

    @app.post(f"{V1}/load_weights")
    async def load_weights(request: Request) -> Any:
        return future(service.load_weights(await _body(request)))


def _sampling_routes(app: Any, service: TinkerService) -> None:
    """Sampling sessions, asample, and retrieving any future."""
    from fastapi import Request
    from fastapi.responses import Response

    @app.post(f"{V1}/create_sampling_session")
    async def create_sampling_session(request: Request) -> Any:
        return service.create_sampling_session(await _body(request))

    @app.get(f"{V1}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str) -> Any:
        return service.samplers.get(sampler_id)

    @app.post(f"{V1}/asample")
    async def asample(request: Request) -> Any:
        rid, seq_ids = service.samplers.asample(await _body(request))
        return future(rid, sample_sequence_ids=seq_ids)

    @app.post(f"{V1}/cancel_future")
    async def cancel_future() -> Any:
        return Response(status_code=204)  # work is short; a result nobody fetches expires

    @app.post(f"{V1}/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        body = await _body(request)
        rid = body.get("request_id")
        try:
            result = await asyncio.to_thread(
                service.futures.wait, str(rid), service.cfg.long_poll_s
            )
        except KeyError:
            raise NotFound(f"request_id: {rid!r} is unknown or expired") from None
        if result is None:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        if result.error is not None:
            return {"error": result.error[0], "category": result.error[1]}
        if isinstance(result.payload, bytes):
            return Response(content=result.payload, media_type=PROTO_CONTENT_TYPE)
        return result.payload


def _rest_routes(app: Any, service: TinkerService) -> None:
    """The RestClient's checkpoint and training-run routes."""
    from fastapi import Request
    from fastapi.responses import Response

    @app.get(f"{V1}/training_runs/{{model_id}}/checkpoints")
    async def checkpoints(model_id: str) -> Any:
        return service.checkpoints(model_id)

    @app.delete(f"{V1}/training_runs/{{model_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> Any:
        service.delete_checkpoint(model_id, checkpoint_id)
        return Response(status_code=204)

    @app.post(f"{V1}/weights_info")
    async def weights_info(request: Request) -> Any:
        return service.weights_info(await _body(request))

    @app.get(f"{V1}/training_runs/{{model_id}}")
    async def training_run(model_id: str) -> Any:
        return service.training_run(model_id)


def resolve_base(cfg: TinkerServeConfig) -> tuple[str, str, str | None]:
    """(name clients use, resolved local folder, hub id or None) of the base model; the tiny
    default is built into ``state_dir`` first."""
    from gyre.config import ModelConfig
    from gyre.models.build import create_tiny_checkpoint
    from gyre.models.hub import looks_like_hub_id, resolve_model_path

    path = cfg.model_path
    if not path:
        path = str(Path(cfg.state_dir) / "tiny-base")
        if not (Path(path) / "config.json").is_file():
            create_tiny_checkpoint(ModelConfig(), path, cfg.seed)
    # a hub id (org/name) loads from the hub cache (downloaded when online); clients name it
    # by the id, and fetch its tokenizer by the id too
    folder = resolve_model_path(path, "model_path")
    hub_id = path if looks_like_hub_id(path) and not Path(path).expanduser().exists() else None
    return cfg.model_name or path, str(folder), hub_id


def build_service(cfg: TinkerServeConfig) -> TinkerService:
    """Load (or build, for the tiny default) the base model and wrap it in the service: in this
    process (``runner=local``), or in a trainer and sampler Ray actors (``runner=ray``)."""
    from gyre.tinker.service import local_backend
    from gyre.tinker.training import load_host

    name, folder, hub_id = resolve_base(cfg)
    if cfg.runner == "ray":
        from gyre.tinker.ray_backend import ray_backend

        return TinkerService(cfg, ray_backend(cfg, folder, name, hub_id))
    return TinkerService(cfg, local_backend(cfg, load_host(cfg, folder, name, hub_id)))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str]) -> int:
    """``gyre tinker-serve [--host H] [--port P] [--api-key-file F] [key=value ...]``."""
    parser = argparse.ArgumentParser(
        prog="gyre tinker-serve",
        description="Serve the Tinker API (the official `tinker` SDK) over gyre. Keys: "
        + ", ".join(k for k in TinkerServeConfig.model_fields if k != "ray")
        + "; runner=ray: "
        + ", ".join(f"ray.{k}" for k in TinkerRayConfig.model_fields),
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key-file", default="", help="require this key (X-API-Key)")
    ns = parser.parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import tinker  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise ImportError(
            f"gyre tinker-serve needs its extra: pip install 'gyre[tinker]' ({exc})"
        ) from exc
    key = ""
    if ns.api_key_file:
        try:
            key = Path(ns.api_key_file).read_text().strip()
        except OSError as exc:
            raise ValueError(
                f"--api-key-file '{ns.api_key_file}' cannot be read: {exc.strerror}"
            ) from exc
        if not key:
            raise ValueError(f"--api-key-file '{ns.api_key_file}' is empty")
    if not key and not _is_loopback(ns.host):
        raise ValueError(f"--host {ns.host} is not loopback: give --api-key-file")
    cfg = load_tinker_config(ns.overrides)
    service = build_service(cfg)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    where = "" if cfg.runner == "local" else " (training and sampling on Ray actors)"
    print(
        f"gyre tinker-serve: {service.host.name} on http://{ns.host}:{ns.port}{where}", flush=True
    )
    try:
        uvicorn.run(create_app(service, key), host=ns.host, port=ns.port, log_level="warning")
    finally:
        service.close()
    return 0
