"""``gyre serve``'s guards against hostile input, shared by every route.

- A body over the limit is a 413 before it is read in full (:class:`BodyLimit`).
- Bodies are validated on the preparation thread (:func:`parse_body`), with nesting checked
  before JSON parsing; a bad value is a 400 naming its field.
- Every error is a JSON body in OpenAI's shape (:func:`error_response`), anything unexpected a
  500 naming the route; the API key is compared in constant time (:func:`require_key`).
"""

import hmac
from typing import Any

from pydantic import BaseModel, ValidationError

from gyre.serve.host import Batcher
from gyre.serve.requests import ApiError, check_containers, validation_message


def error_response(status: int, message: str, param: str | None = None) -> Any:
    """An OpenAI-shaped JSON error: ``{"error": {message, type, param, code}}``."""
    from fastapi.responses import JSONResponse

    kind = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        405: "MethodNotAllowedError",
        413: "RequestTooLargeError",
    }
    error = {"message": message, "type": kind.get(status, "ServerError"), "param": param}
    return JSONResponse(status_code=status, content={"error": {**error, "code": status}})


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 413 without being read in full.

    A declared ``Content-Length`` over the limit is refused before any of the body is read; a
    chunked body is counted as it arrives and refused as soon as it passes the limit. A body
    within the limit is buffered (at most ``max_bytes``) and replayed to the app.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                await error_response(400, "invalid Content-Length header")(scope, receive, send)
                return
            if too_big:
                await self._refuse(scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        msg = (
            f"request body is larger than this server's limit of {self.max_bytes} bytes "
            "(gyre serve --max-body-mb)"
        )
        await error_response(413, msg)(scope, receive, send)


def install_error_handlers(app: Any) -> None:
    """Every error as a JSON body in OpenAI's shape: a bad value names its field, anything
    unexpected names the route."""
    from fastapi import Request
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Any:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Any:
        return error_response(400, *validation_message(list(exc.errors())))

    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException) -> Any:  # unknown route, wrong method
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Any:
        route = f"{request.method} {request.url.path}"
        return error_response(500, f"internal error in {route}: {type(exc).__name__}: {exc}")


def require_key(api_key: str) -> list[Any]:
    """The route dependency that checks the bearer key (none: every route is open)."""
    from fastapi import Depends, Request

    want = f"Bearer {api_key}".encode()

    async def check_key(request: Request) -> None:
        if not api_key:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, want):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)")

    return [Depends(check_key)]


def _validate(cls: type[BaseModel], raw: bytes) -> Any:
    check_containers(raw)
    try:
        return cls.model_validate_json(raw)
    except ValidationError as exc:
        raise ApiError(400, *validation_message(list(exc.errors(include_url=False)))) from None


async def parse_body(request: Any, cls: type[BaseModel], batcher: Batcher) -> Any:
    """The request body as ``cls``, validated on the preparation thread."""
    return await batcher.run_in_prep(_validate, cls, await request.body())
