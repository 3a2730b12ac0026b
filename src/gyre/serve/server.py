"""``gyre serve``: an OpenAI-compatible HTTP server around the in-process torch engine.

It speaks the dialect RL trainers need from vLLM / SGLang, so the same HTTP engine drives all
three:

- ``POST /v1/completions``: ``prompt`` may be text, a list of token ids, or a list of either;
  ``logprobs: k`` returns the sampled token's logprob (+ the k best), ``return_token_ids: true``
  adds ``token_ids`` / ``prompt_token_ids`` to each choice, ``return_tokens_as_token_ids: true``
  writes tokens as ``"token_id:N"`` (vLLM's fields); ``stop_token_ids`` and ``seed`` as in vLLM.
  ``prompt_logprobs: k`` adds each prompt token's log-prob (vLLM's field; the sync check reads
  it, as it reads SGLang's ``logprob_start_len`` on ``/generate``:
  :mod:`gyre.serve.prompt_logprobs`).
- ``POST /v1/chat/completions`` with ``logprobs`` / ``top_logprobs``; for a VLM, ``image_url``
  parts (data URIs) and SGLang's ``/generate`` with ``image_data`` (:mod:`~gyre.serve.images`).
- ``GET /v1/models``, ``GET /health``.
- ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and ``POST /v1/unload_lora_adapter``
  ``{lora_name}`` (vLLM); a loaded adapter is addressed by passing its name as ``model``.
- ``POST /update_weights_from_disk`` ``{model_path}`` (SGLang's shape): replace the base weights.

Concurrent requests are gathered by a small batching queue (up to ``max_batch`` prompts or
``batch_wait_ms``) and run as one engine batch per (model, sampling parameters). Logprobs are
those of the distribution sampled from (after temperature and top-p), which is what the trainer
recomputes.

Hostile input: a body over ``max_body_bytes`` is a 413 before it is read in full; body
validation, tokenization and decoding run on a preparation thread and the model on the engine
thread, so the event loop (and ``/health``) stays free; every bad value is a 4xx JSON error
naming its field and anything unexpected a JSON 500 naming the route. Weight loads verify the
folder's manifest and refuse non-finite tensors (:mod:`gyre.serve.host`). It binds
127.0.0.1 unless told otherwise, and refuses a wider bind without an API key unless
``--allow-open`` (docs/engines.md).
"""

import argparse
import gc
import ipaddress
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from gyre.models.build import resolve_device
from gyre.serve.guards import BodyLimit, install_error_handlers, parse_body, require_key
from gyre.serve.host import Batcher, ModelHost
from gyre.serve.images import chat_ids, generate_ids
from gyre.serve.prompt_logprobs import sglang_input_logprobs, vllm_prompt_logprobs
from gyre.serve.recorder import (
    Recorder,
    add_recorder_args,
    add_routes,
    build_recorder,
    recorded_chat,
    session_of,
)
from gyre.serve.requests import (
    ApiError,
    ChatBody,
    CompletionBody,
    GenerateBody,
    LoadLoraBody,
    UnloadLoraBody,
    UpdateWeightsBody,
    chat_answer,
    completion_answer,
    generate_answer,
    prompts_of,
    requests_of,
    sampling_params,
)
from gyre.types import GenerationRequest, SamplingParams

__all__ = ["ApiError", "ModelHost", "create_app", "main"]

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB: ~1M token ids; a 32k-token prompt is ~200 KB
LOOPBACK_NAMES = ("localhost",)


def _require_serve_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError("gyre serve needs its extra: pip install 'gyre[serve]'") from exc


def _info_routes(app: Any, host: ModelHost, batcher: Batcher, auth: list[Any]) -> None:
    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok"}

    @app.get("/stats", dependencies=auth)
    async def stats() -> Any:
        return {
            **batcher.stats,
            "adapters": dict(host.adapters),
            "engine_version": host.engine.version,
            "weight_version": host.weight_version,
        }

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Any:
        now = int(time.time())
        base = {"object": "model", "created": now, "owned_by": "gyre"}
        data = [
            {
                **base,
                "id": host.served_name,
                "root": host.model_dir,
                "parent": None,
                "max_model_len": host.max_model_len,
            }
        ]
        for name, path in host.adapters.items():
            data.append({**base, "id": name, "root": path, "parent": host.served_name})
        return {"object": "list", "data": data}


def _weight_routes(app: Any, host: ModelHost, batcher: Batcher, auth: list[Any]) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse, PlainTextResponse

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora(request: Request) -> Any:
        body = await parse_body(request, LoadLoraBody, batcher)
        await batcher.run_in_engine(host.load_lora, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora(request: Request) -> Any:
        body = await parse_body(request, UnloadLoraBody, batcher)
        await batcher.run_in_engine(host.unload_lora, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def sglang(fail_key: str, fn: Any, *args: Any) -> tuple[bool, Any]:
        """Run ``fn`` on the engine; an error in SGLang's ``{"success": false}`` shape."""
        try:
            return True, await batcher.run_in_engine(fn, *args)
        except ApiError as exc:
            content = {"success": False, fail_key: exc.message, "num_paused_requests": 0}
            return False, JSONResponse(status_code=exc.status, content=content)

    @app.post("/load_lora_adapter", dependencies=auth)
    async def load_lora_sglang(request: Request) -> Any:
        body = await parse_body(request, LoadLoraBody, batcher)
        ok, out = await sglang("error_message", host.load_lora, body.lora_name, body.lora_path)
        if not ok:
            return out
        return {"success": True, "error_message": "", "loaded_adapters": dict(host.adapters)}

    @app.post("/unload_lora_adapter", dependencies=auth)
    async def unload_lora_sglang(request: Request) -> Any:
        body = await parse_body(request, UnloadLoraBody, batcher)
        ok, out = await sglang("error_message", host.unload_lora, body.lora_name)
        if not ok:
            return out
        return {"success": True, "error_message": "", "loaded_adapters": dict(host.adapters)}

    @app.post("/update_weights_from_disk", dependencies=auth)
    async def update_weights(request: Request) -> Any:
        body = await parse_body(request, UpdateWeightsBody, batcher)
        args = (body.model_path, body.weight_version)
        ok, out = await sglang("message", host.update_weights, *args)
        if not ok:
            return out
        return {"success": True, "message": out, "num_paused_requests": 0}


# -- generation routes: parse + tokenize on the prep thread, run on the engine thread ------


def _no_stream(body: Any) -> None:
    if body.stream:
        raise ApiError(400, "stream=true is not supported by gyre serve", "stream")


def _prepare_completion(
    host: ModelHost, body: CompletionBody
) -> tuple[str, list[GenerationRequest], SamplingParams]:
    model = host.check_model(body.model)
    _no_stream(body)
    if body.echo:
        raise ApiError(400, "echo=true is not supported by gyre serve", "echo")
    prompts = prompts_of(host.vocab, body.prompt)
    params = sampling_params(host.vocab, body, body.max_tokens or 16, body.logprobs or 0)
    return model, requests_of(host.vocab, prompts, body.n, params.max_new_tokens), params


def _prepare_chat(
    host: ModelHost, body: ChatBody
) -> tuple[str, list[GenerationRequest], SamplingParams]:
    model = host.check_model(body.model)
    _no_stream(body)
    k = body.top_logprobs or 0
    if k and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    prompt, images = chat_ids(host.vocab, body.messages, body.tools)
    max_new = body.max_completion_tokens or body.max_tokens or 64
    params = sampling_params(host.vocab, body, max_new, k)
    return model, requests_of(host.vocab, [prompt], body.n, params.max_new_tokens, images), params


def _prepare_generate(
    host: ModelHost, body: GenerateBody
) -> tuple[str, list[GenerationRequest], SamplingParams]:
    _no_stream(body)
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of text and input_ids", "input_ids")
    model = host.check_model(host.served_name if body.lora_path is None else body.lora_path)
    prompts, images = generate_ids(host.vocab, body)
    sp = body.sampling_params
    params = sampling_params(host.vocab, sp, sp.max_new_tokens, body.top_logprobs_num)
    return model, requests_of(host.vocab, prompts, 1, params.max_new_tokens, images), params


def _generation_routes(
    app: Any, host: ModelHost, batcher: Batcher, auth: list[Any], recorder: Recorder | None
) -> None:
    from fastapi import Request

    async def run(request: Request, cls: type[BaseModel], prepare: Any) -> tuple[Any, ...]:
        body = await parse_body(request, cls, batcher)
        model, reqs, params = await batcher.run_in_prep(prepare, host, body)
        return body, model, reqs, await batcher.submit(model, reqs, params)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Any:
        body, model, reqs, outs = await run(request, CompletionBody, _prepare_completion)
        answer = await batcher.run_in_prep(completion_answer, host.vocab, model, body, reqs, outs)
        if body.prompt_logprobs is not None:
            for choice, req in zip(answer["choices"], reqs, strict=True):
                args = (model, req.prompt_ids, body.prompt_logprobs)
                table = await batcher.run_in_engine(host.prompt_logprobs, *args)
                choice["prompt_logprobs"] = await batcher.run_in_prep(
                    vllm_prompt_logprobs, host.tokenizer, req.prompt_ids, table
                )
        return answer

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(request: Request) -> Any:
        body = await parse_body(request, ChatBody, batcher)
        session = None if recorder is None else session_of(request.headers, body)
        if recorder is not None and session is not None:  # --record: docs/envs.md
            return await recorded_chat(host, batcher, recorder, session, body)
        if recorder is not None:
            recorder.stats["unrecorded_calls"] += 1
        model, reqs, params = await batcher.run_in_prep(_prepare_chat, host, body)
        outs = await batcher.submit(model, reqs, params)
        return await batcher.run_in_prep(chat_answer, host.vocab, model, body, reqs, outs)

    @app.post("/generate", dependencies=auth)
    async def generate(request: Request) -> Any:
        """SGLang's native generate: token ids in, ``output_ids`` + per-token logprobs out."""
        body, model, reqs, outs = await run(request, GenerateBody, _prepare_generate)
        prompt = reqs[0].prompt_ids
        answer = await batcher.run_in_prep(generate_answer, host.vocab, body, prompt, outs[0])
        if body.return_logprob and body.logprob_start_len >= 0:
            k = body.top_logprobs_num
            table = await batcher.run_in_engine(host.prompt_logprobs, model, prompt, k)
            start = min(body.logprob_start_len, len(prompt))
            answer["meta_info"].update(sglang_input_logprobs(prompt, table, start, k > 0))
        return answer


def create_app(
    host: ModelHost,
    api_key: str = "",
    max_batch: int = 64,
    batch_wait_ms: float = 5.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    recorder: Recorder | None = None,
) -> Any:
    """The FastAPI app; ``uvicorn.run(create_app(...))`` serves it. With a ``recorder``
    (``--record``), chat calls that name a session are recorded (:mod:`gyre.serve.recorder`)."""
    _require_serve_extra()
    import asyncio
    from contextlib import asynccontextmanager

    from fastapi import FastAPI

    from gyre.serve.memory import add_memory_routes

    batcher = Batcher(host, max_batch, batch_wait_ms / 1000.0)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(batcher.loop())
        yield
        if recorder is not None:
            await batcher.run_in_prep(recorder.close)
        task.cancel()
        batcher.shutdown()

    app = FastAPI(title="gyre serve", lifespan=lifespan)
    app.state.batcher = batcher
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    install_error_handlers(app)
    auth = require_key(api_key)
    _info_routes(app, host, batcher, auth)
    _weight_routes(app, host, batcher, auth)
    add_memory_routes(app, host, batcher, auth)  # sleep / wake: serve/memory.py
    _generation_routes(app, host, batcher, auth, recorder)
    if recorder is not None:
        add_routes(app, batcher, auth, recorder)
    return app


# -- the command ------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` only accepts connections from this machine."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gyre serve",
        description="OpenAI-compatible server (completions, chat, LoRA load/unload, "
        "update_weights_from_disk) around gyre's torch engine.",
    )
    add = parser.add_argument
    add("model_dir", metavar="MODEL_DIR", help="a Hugging Face model folder")
    add("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    add("--port", type=int, default=8000, help="port (default 8000)")
    add(
        "--api-key-file",
        default="",
        metavar="PATH",
        help="require 'Authorization: Bearer KEY', KEY read from PATH (default: $GYRE_API_KEY)",
    )
    add("--api-key", default="", help="the key itself (visible in the process list; avoid)")
    add(
        "--allow-open",
        action="store_true",
        help="serve without an API key on a non-loopback --host (refused otherwise)",
    )
    add(
        "--max-body-mb",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / (1 << 20),
        help="largest request body in MiB; larger ones get 413 (default 4)",
    )
    add("--served-model-name", default="", help="model id (default MODEL_DIR)")
    add("--device", default="cpu", help="torch device (default cpu)")
    add("--threads", type=int, default=1, help="torch threads (default 1)")
    add("--seed", type=int, default=0, help="sampling seed")
    add("--max-batch", type=int, default=64, help="prompts per engine batch")
    add("--batch-wait-ms", type=float, default=5.0, help="how long to gather a batch")
    add_recorder_args(add)
    return parser


def _api_key(ns: argparse.Namespace) -> str:
    """The key from --api-key-file, else --api-key, else $GYRE_API_KEY ('' for none)."""
    if ns.api_key_file:
        try:
            key = Path(ns.api_key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file '{ns.api_key_file}' cannot be read: {exc}") from exc
        if not key:
            raise ValueError(f"--api-key-file '{ns.api_key_file}' is empty")
        return key
    if ns.api_key:
        warn = "--api-key shows the key in the process list; prefer --api-key-file or $GYRE_API_KEY"
        print(f"gyre serve: warning: {warn}", file=sys.stderr)
        return str(ns.api_key)
    return os.environ.get("GYRE_API_KEY", "").strip()


def _check_exposure(ns: argparse.Namespace, key: str) -> None:
    """Refuse an open server beyond loopback (unless --allow-open); warn about any open one."""
    if key:
        return
    if not is_loopback(ns.host) and not ns.allow_open:
        raise ValueError(
            f"--host {ns.host} accepts connections from other machines and no API key is set: "
            "give --api-key-file PATH or $GYRE_API_KEY (or --allow-open to serve it open)"
        )
    where = f"{ns.host}:{ns.port}"
    warn = f"no API key: every route, weight loads included, is open to anyone reaching {where}"
    print(f"gyre serve: warning: {warn}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """``gyre serve MODEL_DIR [--host H] [--port N] [--api-key-file PATH] ...``"""
    ns = _parser().parse_args(argv)
    try:
        key = _api_key(ns)
        _check_exposure(ns, key)
        if not ns.max_body_mb > 0:
            raise ValueError(f"--max-body-mb must be > 0, got {ns.max_body_mb}")
    except ValueError as exc:
        print(f"gyre serve: error: {exc}", file=sys.stderr)
        return 2
    _require_serve_extra()
    import uvicorn

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, ns.threads))
    try:
        host = ModelHost(
            ns.model_dir, ns.served_model_name or ns.model_dir, resolve_device(ns.device), ns.seed
        )
        recorder = build_recorder(ns.record, ns.reward_fn, host.tokenizer, ns.session_timeout)
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"gyre serve: error: {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print(f"gyre serve: error: {exc.message}", file=sys.stderr)
        return 1
    # The model, torch and transformers are long-lived: out of the collector's sight, a request
    # that allocates many objects no longer pays for full collections that walk all of them.
    gc.freeze()
    body_bytes = int(ns.max_body_mb * (1 << 20))
    app = create_app(host, key, ns.max_batch, ns.batch_wait_ms, body_bytes, recorder)
    print(f"gyre serve: {host.served_name} on http://{ns.host}:{ns.port}", flush=True)
    if recorder is not None:
        print(f"gyre serve: recording sessions to {recorder.path}", flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
