"""``gyre serve``: an OpenAI-compatible HTTP server around the in-process torch engine.

It speaks the dialect RL trainers need from vLLM / SGLang, so the same HTTP engine drives all
three:

- ``POST /v1/completions``: ``prompt`` may be text, a list of token ids, or a list of either;
  ``logprobs: k`` returns the sampled token's logprob (+ the k best), ``return_token_ids: true``
  adds ``token_ids`` / ``prompt_token_ids`` to each choice, ``return_tokens_as_token_ids: true``
  writes tokens as ``"token_id:N"`` (vLLM's fields); ``stop_token_ids`` and ``seed`` as in vLLM.
- ``POST /v1/chat/completions`` with ``logprobs`` / ``top_logprobs``.
- ``GET /v1/models``, ``GET /health``.
- ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}`` and ``POST /v1/unload_lora_adapter``
  ``{lora_name}`` (vLLM); a loaded adapter is addressed by passing its name as ``model``.
- ``POST /update_weights_from_disk`` ``{model_path}`` (SGLang's shape): replace the base weights.

Concurrent requests are gathered by a small batching queue (up to ``max_batch`` prompts or
``batch_wait_ms``) and run as one engine batch per (model, sampling parameters). Logprobs are
those of the distribution sampled from (after temperature and top-p), which is what the trainer
recomputes. It binds 127.0.0.1 unless told otherwise; ``--api-key`` makes every route except
``/health`` require ``Authorization: Bearer KEY``.
"""

import argparse
import asyncio
import itertools
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from gyre.engines.torch_engine import TorchEngine
from gyre.models.build import load_pretrained, resolve_device
from gyre.types import Completion, GenerationRequest, SamplingParams


def _require_serve_extra() -> None:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError("gyre serve needs its extra: pip install 'gyre[serve]'") from exc


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


# -- request bodies (unknown fields are ignored, as vLLM does) ----------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CompletionBody(_Body):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    temperature: float | None = Field(1.0, ge=0.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    echo: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatBody(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(1.0, ge=0.0)
    top_p: float | None = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class GenerateSamplingParams(_Body):
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class GenerateBody(_Body):
    """SGLang's native ``/generate`` request (one prompt)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20)
    lora_path: str | None = None
    stream: bool = False


class LoadLoraBody(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraBody(_Body):
    lora_name: str = Field(min_length=1)


class UpdateWeightsBody(_Body):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    weight_version: str | None = None


# -- the model host: one engine, a base model and any number of named adapters ------------


class ModelHost:
    """Owns the engine; every call runs under one lock so weights never change mid-batch."""

    def __init__(
        self, model_dir: str | Path, served_name: str, device: torch.device, seed: int = 0
    ) -> None:
        model, tokenizer = load_pretrained(model_dir, device)
        self.model_dir = str(model_dir)
        self.served_name = served_name
        self.tokenizer = tokenizer
        self.engine = TorchEngine(model, tokenizer.pad_token_id, seed=seed)
        self.adapters: dict[str, str] = {}
        self.weight_version: str | None = None
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self.vocab_size = int(model.config.vocab_size)
        self._lock = threading.Lock()

    def generate(
        self, model_name: str, reqs: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        with self._lock:
            model = self.engine.model
            self.engine.reset_cache()  # a cache is only valid for the weights that made it
            if model_name == self.served_name:
                if self.adapters:
                    with model.disable_adapter():
                        return self.engine.generate(reqs, params)
                return self.engine.generate(reqs, params)
            model.set_adapter(model_name)
            return self.engine.generate(reqs, params)

    def load_lora(self, name: str, path: str) -> None:
        from gyre.models.lora import load_adapter_into

        with self._lock:
            if name == self.served_name or name in self.adapters:
                raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
            if not Path(path).is_dir():
                raise ApiError(400, f"lora_path '{path}' is not a directory", "lora_path")
            try:
                self.engine.model = load_adapter_into(self.engine.model, Path(path), name).eval()
            except (FileNotFoundError, ValueError, KeyError, RuntimeError) as exc:
                raise ApiError(
                    400, f"cannot load adapter from '{path}': {exc}", "lora_path"
                ) from exc
            self.adapters[name] = path
            self.engine.reset_cache()

    def unload_lora(self, name: str) -> None:
        with self._lock:
            if name not in self.adapters:
                raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            del self.adapters[name]
            model = self.engine.model
            if self.adapters:
                model.delete_adapter(name)
            else:  # last adapter gone: take the LoRA layers out of the base model again
                self.engine.model = model.unload().eval()
            self.engine.reset_cache()

    def update_weights(self, path: str, version: str | None) -> str:
        import safetensors.torch

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise ApiError(400, f"no *.safetensors weights in model_path '{path}'", "model_path")
        with self._lock:
            own = self.engine.model.state_dict()
            loaded: dict[str, torch.Tensor] = {}
            for f in files:
                loaded.update(safetensors.torch.load_file(f))
            target: dict[str, torch.Tensor] = {}
            for key, tensor in loaded.items():
                name = self._own_key(key, own)
                if name is None:
                    raise ApiError(400, f"weight '{key}' in '{path}' is not in the served model")
                if own[name].shape != tensor.shape:
                    raise ApiError(
                        400,
                        f"weight '{key}' has shape {tuple(tensor.shape)}, the served model "
                        f"{tuple(own[name].shape)}",
                    )
                target[name] = tensor
            self.engine.load_weights(target, self.engine.version + 1)
            self.weight_version = version
        return f"loaded {len(target)} tensors from {path}"

    def _own_key(self, key: str, own: dict[str, torch.Tensor]) -> str | None:
        # With adapters loaded the base weights sit under peft's prefix and `base_layer`.
        candidates = [key]
        if self.adapters:
            wrapped = f"base_model.model.{key}"
            stem, _, leaf = wrapped.rpartition(".")
            candidates += [wrapped, f"{stem}.base_layer.{leaf}"]
        return next((c for c in candidates if c in own), None)


# -- batching queue -------------------------------------------------------------------------


@dataclass
class _Pending:
    key: tuple[Any, ...]
    model: str
    reqs: list[GenerationRequest]
    params: SamplingParams
    future: asyncio.Future


class Batcher:
    """Gathers concurrent requests for up to ``wait_s`` and runs them as few engine batches."""

    def __init__(self, host: ModelHost, max_batch: int = 64, wait_s: float = 0.005) -> None:
        self.host, self.max_batch, self.wait_s = host, max_batch, wait_s
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-engine")
        self.stats = {"batches": 0, "requests": 0, "prompts": 0, "max_batch_prompts": 0}
        self._seeded = itertools.count()

    async def submit(
        self, model: str, reqs: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        # A seeded request runs alone: its samples then do not depend on what it shared a batch
        # with.
        key = (model, params, next(self._seeded) if params.seed is not None else None)
        fut = asyncio.get_running_loop().create_future()
        await self.queue.put(_Pending(key, model, reqs, params, fut))
        return await fut

    async def run_in_engine(self, fn: Any, *args: Any) -> Any:
        """Run a weight-changing call on the engine thread, between batches."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def loop(self) -> None:
        while True:
            first = await self.queue.get()
            items = [first]
            size = len(first.reqs)
            deadline = time.monotonic() + self.wait_s
            while size < self.max_batch:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self.queue.get(), left)
                except TimeoutError:
                    break
                items.append(item)
                size += len(item.reqs)
            groups: dict[tuple[Any, ...], list[_Pending]] = {}
            for it in items:
                groups.setdefault(it.key, []).append(it)
            for group in groups.values():
                await self._run_group(group)

    async def _run_group(self, group: list[_Pending]) -> None:
        reqs = [r for it in group for r in it.reqs]
        head = group[0]
        try:
            outs = await self.run_in_engine(self.host.generate, head.model, reqs, head.params)
        except Exception as exc:
            for it in group:
                if not it.future.done():
                    it.future.set_exception(exc)
            return
        self.stats["batches"] += 1
        self.stats["requests"] += len(group)
        self.stats["prompts"] += len(reqs)
        self.stats["max_batch_prompts"] = max(self.stats["max_batch_prompts"], len(reqs))
        i = 0
        for it in group:
            n = len(it.reqs)
            if not it.future.done():
                it.future.set_result(outs[i : i + n])
            i += n


# -- the app --------------------------------------------------------------------------------


def _error(status: int, message: str, param: str | None = None) -> Any:
    from fastapi.responses import JSONResponse

    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError"}
    return JSONResponse(
        status_code=status,
        content={
            "error": {
                "message": message,
                "type": kind.get(status, "ServerError"),
                "param": param,
                "code": status,
            }
        },
    )


def create_app(
    host: ModelHost, api_key: str = "", max_batch: int = 64, batch_wait_ms: float = 5.0
) -> Any:
    """The FastAPI app; ``uvicorn.run(create_app(...))`` serves it."""
    _require_serve_extra()
    from contextlib import asynccontextmanager

    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    batcher = Batcher(host, max_batch, batch_wait_ms / 1000.0)

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # type: ignore[no-untyped-def]
        task = asyncio.create_task(batcher.loop())
        yield
        task.cancel()
        batcher.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="gyre serve", lifespan=lifespan)
    app.state.batcher = batcher

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Any:
        return _error(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Any:
        parts, param = [], None
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            field = ".".join(loc) or "body"
            param = param or field
            parts.append(f"{field}: {err.get('msg', 'invalid')}")
        return _error(400, "invalid request: " + "; ".join(parts), param)

    def check_key(request: Request) -> None:
        if not api_key:
            return
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)")

    auth = [Depends(check_key)]

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
        data = [
            {
                "id": host.served_name,
                "object": "model",
                "created": now,
                "owned_by": "gyre",
                "root": host.model_dir,
                "parent": None,
                "max_model_len": host.max_model_len,
            }
        ]
        for name, path in host.adapters.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "gyre",
                    "root": path,
                    "parent": host.served_name,
                }
            )
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter", dependencies=auth)
    async def load_lora(body: LoadLoraBody) -> Any:
        from fastapi.responses import PlainTextResponse

        await batcher.run_in_engine(host.load_lora, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", dependencies=auth)
    async def unload_lora(body: UnloadLoraBody) -> Any:
        from fastapi.responses import PlainTextResponse

        await batcher.run_in_engine(host.unload_lora, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/load_lora_adapter", dependencies=auth)
    async def load_lora_sglang(body: LoadLoraBody) -> Any:
        try:
            await batcher.run_in_engine(host.load_lora, body.lora_name, body.lora_path)
        except ApiError as exc:
            return JSONResponse(
                status_code=exc.status,
                content={"success": False, "error_message": exc.message},
            )
        return {"success": True, "error_message": "", "loaded_adapters": dict(host.adapters)}

    @app.post("/unload_lora_adapter", dependencies=auth)
    async def unload_lora_sglang(body: UnloadLoraBody) -> Any:
        try:
            await batcher.run_in_engine(host.unload_lora, body.lora_name)
        except ApiError as exc:
            return JSONResponse(
                status_code=exc.status,
                content={"success": False, "error_message": exc.message},
            )
        return {"success": True, "error_message": "", "loaded_adapters": dict(host.adapters)}

    @app.post("/generate", dependencies=auth)
    async def generate(body: GenerateBody) -> Any:
        """SGLang's native generate: token ids in, ``output_ids`` + per-token logprobs out."""
        if body.stream:
            raise ApiError(400, "stream=true is not supported by gyre serve", "stream")
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "give exactly one of text and input_ids", "input_ids")
        model = host.served_name if body.lora_path is None else body.lora_path
        model = _check_model(host, model)
        (prompt,) = _prompts(host, body.text if body.input_ids is None else body.input_ids)
        sp = body.sampling_params
        params = _params(host, sp, sp.max_new_tokens, body.top_logprobs_num)
        _check_length(host, prompt, params.max_new_tokens)
        (out,) = await batcher.submit(model, [GenerationRequest(prompt)], params)
        if out.finish_reason == "stop":
            finish: dict[str, Any] = {"type": "stop", "matched": out.token_ids[-1]}
        else:
            finish = {"type": "length", "length": len(out.token_ids)}
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(out.token_ids),
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t, None] for t, lp in zip(out.token_ids, out.logprobs, strict=True)
            ]
            meta["output_top_logprobs"] = (
                [[[lp, t, None] for t, lp in d.items()] for d in out.top_logprobs]
                if out.top_logprobs is not None
                else None
            )
        text = host.tokenizer.decode(out.token_ids, skip_special_tokens=sp.skip_special_tokens)
        return {"text": text, "output_ids": out.token_ids, "meta_info": meta}

    @app.post("/update_weights_from_disk", dependencies=auth)
    async def update_weights(body: UpdateWeightsBody) -> Any:
        try:
            msg = await batcher.run_in_engine(
                host.update_weights, body.model_path, body.weight_version
            )
        except ApiError as exc:
            return JSONResponse(
                status_code=exc.status,
                content={"success": False, "message": exc.message, "num_paused_requests": 0},
            )
        return {"success": True, "message": msg, "num_paused_requests": 0}

    @app.post("/v1/completions", dependencies=auth)
    async def completions(body: CompletionBody) -> Any:
        model = _check_model(host, body.model)
        if body.stream:
            raise ApiError(400, "stream=true is not supported by gyre serve", "stream")
        if body.echo:
            raise ApiError(400, "echo=true is not supported by gyre serve", "echo")
        prompts = _prompts(host, body.prompt)
        params = _params(host, body, body.max_tokens or 16, body.logprobs or 0)
        for p in prompts:
            _check_length(host, p, params.max_new_tokens)
        reqs = [GenerationRequest(list(p)) for p in prompts for _ in range(body.n)]
        outs = await batcher.submit(model, reqs, params)
        choices = []
        for idx, (req, out) in enumerate(zip(reqs, outs, strict=True)):
            choice: dict[str, Any] = {
                "index": idx,
                "text": host.tokenizer.decode(
                    out.token_ids, skip_special_tokens=body.skip_special_tokens
                ),
                "logprobs": None,
                "finish_reason": out.finish_reason,
                "stop_reason": out.token_ids[-1] if out.finish_reason == "stop" else None,
            }
            if body.logprobs is not None:
                choice["logprobs"] = _completion_logprobs(host, out, body)
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = req.prompt_ids
            choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(reqs, outs),
        }

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(body: ChatBody) -> Any:
        model = _check_model(host, body.model)
        if body.stream:
            raise ApiError(400, "stream=true is not supported by gyre serve", "stream")
        prompt = _chat_prompt(host, body.messages)
        k = body.top_logprobs or 0
        if k and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        max_new = body.max_completion_tokens or body.max_tokens or 64
        params = _params(host, body, max_new, k)
        _check_length(host, prompt, params.max_new_tokens)
        reqs = [GenerationRequest(list(prompt)) for _ in range(body.n)]
        outs = await batcher.submit(model, reqs, params)
        choices = []
        for idx, out in enumerate(outs):
            text = host.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            choice: dict[str, Any] = {
                "index": idx,
                "message": {"role": "assistant", "content": text},
                "logprobs": _chat_logprobs(host, out, body) if body.logprobs else None,
                "finish_reason": out.finish_reason,
            }
            if body.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = prompt
            choices.append(choice)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": _usage(reqs, outs),
        }

    return app


def _check_model(host: ModelHost, name: str | None) -> str:
    if name is None or name == host.served_name:
        return host.served_name
    if name in host.adapters:
        return name
    known = ", ".join([host.served_name, *host.adapters])
    raise ApiError(404, f"The model `{name}` does not exist (served: {known}).", "model")


def _prompts(host: ModelHost, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids = host.tokenizer.encode(p, add_special_tokens=True)
        else:
            ids = list(p)
            bad = [t for t in ids if not 0 <= t < host.vocab_size]
            if bad:
                raise ApiError(
                    400,
                    f"prompt {i}: token id {bad[0]} is outside [0, {host.vocab_size})",
                    "prompt",
                )
        if not ids:
            raise ApiError(400, f"prompt {i} is empty", "prompt")
        out.append(ids)
    return out


def _chat_prompt(host: ModelHost, messages: list[ChatMessage]) -> list[int]:
    tok = host.tokenizer
    msgs = [{"role": m.role, "content": m.content} for m in messages]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    # No chat template (the tiny char model): BOS + the contents back to back, no role markers.
    text = "".join(m["content"] for m in msgs)
    ids = tok.encode(text, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + ids


def _params(host: ModelHost, body: Any, max_new: int, top_k: int) -> SamplingParams:
    """Sampling parameters from an OpenAI-style body or SGLang ``sampling_params``."""
    stop_ids = list(body.stop_token_ids or [])
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for s in stops:
        ids = host.tokenizer.encode(s, add_special_tokens=False)
        if len(ids) != 1:
            raise ApiError(
                400,
                f"stop string {s!r} is {len(ids)} tokens; gyre serve only stops on single-token "
                "strings (use stop_token_ids)",
                "stop",
            )
        stop_ids.append(ids[0])
    eos = host.tokenizer.eos_token_id
    if eos is not None and not body.ignore_eos:
        stop_ids.append(eos)  # like vLLM: EOS ends a completion unless ignore_eos
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_new_tokens=max_new,
        stop_token_ids=tuple(sorted(set(stop_ids))),
        seed=getattr(body, "seed", None),
        top_logprobs=top_k,
    )


def _check_length(host: ModelHost, prompt: list[int], max_new: int) -> None:
    if host.max_model_len and len(prompt) + max_new > host.max_model_len:
        raise ApiError(
            400,
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_new}) exceeds the model's "
            f"context length {host.max_model_len}",
            "max_tokens",
        )


def _token_str(host: ModelHost, tok: int, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{tok}"
    return host.tokenizer.decode([tok], skip_special_tokens=False)


def _completion_logprobs(host: ModelHost, out: Completion, body: CompletionBody) -> dict:
    as_ids = body.return_tokens_as_token_ids
    tokens = [_token_str(host, t, as_ids) for t in out.token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = None
    if out.top_logprobs is not None:
        top = [{_token_str(host, t, as_ids): lp for t, lp in d.items()} for d in out.top_logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": out.logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(host: ModelHost, out: Completion, body: ChatBody) -> dict:
    as_ids = body.return_tokens_as_token_ids
    content = []
    for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        s = _token_str(host, t, as_ids)
        alts = []
        if out.top_logprobs is not None:
            for at, alp in out.top_logprobs[i].items():
                a = _token_str(host, at, as_ids)
                alts.append({"token": a, "logprob": alp, "bytes": list(a.encode())})
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
    return {"content": content}


def _usage(reqs: list[GenerationRequest], outs: list[Completion]) -> dict[str, int]:
    prompt = sum(len(r.prompt_ids) for r in reqs)
    gen = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}


def main(argv: list[str] | None = None) -> int:
    """``gyre serve MODEL_DIR [--host H] [--port N] [--api-key KEY] ...``"""
    parser = argparse.ArgumentParser(
        prog="gyre serve",
        description="OpenAI-compatible server (completions, chat, LoRA load/unload, "
        "update_weights_from_disk) around gyre's torch engine.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("GYRE_API_KEY", ""),
        help="require 'Authorization: Bearer KEY' (default: $GYRE_API_KEY, else none)",
    )
    parser.add_argument("--served-model-name", default="", help="model id (default MODEL_DIR)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--max-batch", type=int, default=64, help="prompts per engine batch")
    parser.add_argument(
        "--batch-wait-ms", type=float, default=5.0, help="how long to gather a batch"
    )
    ns = parser.parse_args(argv)
    _require_serve_extra()
    import uvicorn

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(max(1, ns.threads))
    try:
        host = ModelHost(
            ns.model_dir, ns.served_model_name or ns.model_dir, resolve_device(ns.device), ns.seed
        )
    except (FileNotFoundError, ValueError) as exc:
        print(f"gyre serve: error: {exc}", file=sys.stderr)
        return 1
    app = create_app(host, ns.api_key, ns.max_batch, ns.batch_wait_ms)
    print(f"gyre serve: {host.served_name} on http://{ns.host}:{ns.port}", flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
