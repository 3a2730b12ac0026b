"""An engine over OpenAI-compatible servers: vLLM, SGLang or ``gyre serve``.

Token-in/token-out: every request sends the prompt as a list of token ids and asks for the
sampled ids back, with ``logprobs`` for each sampled token (the wire format of both server
dialects is :mod:`gyre.engines.http_wire`). Text is never re-tokenised, so the trainer scores
exactly the tokens the server sampled.

Load balancing and failures (:mod:`gyre.engines.server_pool`): each request goes to the live
server with the fewest requests in flight. A request that fails on a server is retried on
another one, so no episode is lost while any server lives; a server that answers again is first
brought up to the current policy (adapter or full weights) and only then put back.

Images (a VLM's ``GenerationRequest.images``) go with ``engine.api=sglang`` only: the ids, which
already hold each image's expanded run of image tokens, plus ``image_data`` (PNG data URIs) to
``/generate``; the server's ``meta_info.prompt_tokens`` must equal the prompt's length.

Weight sync is through files on a filesystem every server can read (see
:mod:`gyre.engines.sync`): :meth:`HttpEngine.load_adapter` loads a peft adapter folder under the
name ``<prefix>-v<version>`` with ``/v1/load_lora_adapter`` and then requests use that name as
``model``; :meth:`HttpEngine.load_weights_from_disk` calls ``/update_weights_from_disk``.
After a sync, :meth:`HttpEngine.prompt_logprobs_each` scores the sync check's probe on every live
server (:mod:`gyre.engines.verify`); a server that comes back is scored on it before it is put
back. No live server within the deadline, or a server answering unusably, is an engine fault
(:class:`NoServerError`, :class:`ServerError`: exit 69, :mod:`gyre.deadlines`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gyre.engines.base import EngineFeatures
from gyre.engines.http_wire import (
    APIS,
    ServerError,
    completion_body,
    completion_route,
    error_text,
    image_uris,
    own_temperature,
    parse_answer,
)
from gyre.engines.server_pool import HttpSettings, NoServerError, ServerPool, ServerState
from gyre.types import Completion, GenerationRequest, SamplingParams

__all__ = ["APIS", "HttpEngine", "HttpSettings", "NoServerError", "ServerError", "ServerState"]

log = logging.getLogger(__name__)


class HttpEngine:
    """Engine over a set of OpenAI-compatible completion servers. A request's own
    ``temperature`` is sent in its body in place of the batch's.

    ``settings`` (:class:`HttpSettings`: key, timeouts, retries, concurrency) may also be given
    field by field (``HttpEngine(urls, timeout_s=60)``).
    """

    features = EngineFeatures(per_request_temperature=True, remote=True)

    def __init__(
        self,
        urls: list[str],
        model: str = "",
        api: str = "openai",
        adapter_prefix: str = "gyre",
        settings: HttpSettings | None = None,
        **knobs: Any,
    ) -> None:
        if not urls:
            raise ValueError("HttpEngine needs at least one server URL (engine.urls)")
        if api not in APIS:
            raise ValueError(f"engine.api={api!r}; valid: {', '.join(APIS)}")
        settings = replace(settings or HttpSettings(), **knobs)
        self.api = api
        self.pool = ServerPool(urls, settings)
        self.servers = self.pool.servers
        self.stats = self.pool.stats
        self.timeout_s = settings.timeout_s
        self.max_retries = settings.max_retries
        self.adapter_prefix = adapter_prefix
        self.version = 0
        self._base_model = model
        self._adapter: tuple[str, str] | None = None  # (served name, path) of the current policy
        self._weights_path: str | None = None  # last full-weight sync folder
        self.probe: tuple[list[int], list[float], float] | None = None  # the sync check's
        self._sync_lock = threading.RLock()  # sync and put-back never interleave
        self._workers = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="gyre-http")
        self.pool.start_health(self._bring_up)

    # -- protocol ---------------------------------------------------------------------------
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
            if r.images and self.api != "sglang":  # vLLM's /v1/completions would drop them
                raise ValueError(
                    f"request {i} has images: engine.api=openai sends token ids to "
                    "/v1/completions, which takes no images; set engine.api=sglang (SGLang or "
                    "gyre serve: ids + image_data, docs/vision.md)"
                )
        uris = image_uris(requests)
        futures = [
            self._workers.submit(self._complete, r.prompt_ids, own_temperature(params, r), uris[i])
            for i, r in enumerate(requests)
        ]
        # Each request ends within (max_retries + 1) attempts of timeout_s plus the wait for a
        # live server; the bound here only names a hang past that.
        bound = self.timeout_s * (self.max_retries + 3)
        try:
            return [f.result(timeout=bound) for f in futures]
        except TimeoutError:
            raise NoServerError("completion", self.servers, bound, "engine.timeout_s") from None

    def release(self, sessions: Iterable[Hashable]) -> None:
        """Nothing to free: servers keep their own prefix caches."""

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise TypeError(
            "HttpEngine cannot take tensors: weights reach servers through files "
            "(gyre.engines.sync.WeightSync, engine.sync_dir)"
        )

    @property
    def model_name(self) -> str:
        """What requests pass as ``model``: the current adapter, else the base model."""
        if self._adapter is not None:
            return self._adapter[0]
        return self.base_model

    @property
    def base_model(self) -> str:
        if not self._base_model:
            self._base_model = self.pool.discover_base()
        return self._base_model

    def alive_count(self) -> int:
        return self.pool.alive_count()

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.pool.close()

    # -- weight sync ------------------------------------------------------------------------
    def load_adapter(self, path: str | Path, version: int) -> int:
        """Load the adapter at ``path`` on every live server and wait for each to list it.

        Returns how many servers acknowledged. Servers that are out get it when they come back.
        """
        name = f"{self.adapter_prefix}-v{version}"
        path = str(Path(path).resolve())
        with self._sync_lock:
            old = self._adapter
            self._adapter = (name, path)  # any full-weight sync stays: it is the adapter's base
            acks = 0
            for s in self.servers:
                if s.alive and self._push_adapter(s, name, path, old[0] if old else None):
                    acks += 1
            self.version = version
        return acks

    def load_weights_from_disk(self, path: str | Path, version: int) -> int:
        """Full-weight sync: every live server reloads the HF folder at ``path``."""
        path = str(Path(path).resolve())
        with self._sync_lock:
            old = self._adapter
            self._weights_path = path
            self._adapter = None
            acks = 0
            for s in self.servers:
                if s.alive and self._push_weights(s, path, version, old[0] if old else None):
                    acks += 1
            self.version = version
        return acks

    def adopt(self, path: str | Path, version: int, lora: bool) -> None:
        """Another client of the same servers (a Ray trainer rank) loaded ``version`` from
        ``path`` on them: send this client's requests to it, without pushing it again."""
        path = str(Path(path).resolve())
        with self._sync_lock:
            if lora:
                self._adapter = (f"{self.adapter_prefix}-v{version}", path)
            else:
                self._weights_path, self._adapter = path, None
            self.version = version

    def prompt_logprobs_each(self, ids: list[int]) -> dict[str, list[float]]:
        """Each live server's log-probs of the prompt ``ids`` under the current policy (the
        adapter, if any): the sync check of :mod:`gyre.engines.verify`."""
        with self._sync_lock:
            got = {s.url: self._score(s, ids) for s in self.servers if s.alive}
        return {url: lp for url, lp in got.items() if lp is not None}

    def _score(self, s: ServerState, ids: list[int]) -> list[float] | None:
        """``ids``' prompt log-probs on server ``s`` (None: it did not answer, taken out)."""
        from gyre.engines.verify import (
            openai_probe_body,
            parse_openai_prompt_logprobs,
            parse_sglang_prompt_logprobs,
            sglang_probe_body,
        )

        try:
            if self.api == "sglang":
                body = sglang_probe_body(ids, self._adapter[0] if self._adapter else None)
                r = self.pool.client.post(f"{s.url}/generate", json=body)
                parse = parse_sglang_prompt_logprobs
            else:
                body = openai_probe_body(ids, self.model_name)
                r = self.pool.client.post(f"{s.url}/v1/completions", json=body)
                parse = parse_openai_prompt_logprobs
        except self.pool.httpx.TransportError as exc:
            self.pool.take_out(s, f"sync check: {exc!r}")
            return None
        if r.status_code != 200:
            raise ServerError(f"{s.url} refused the sync check: {error_text(r)}")
        try:
            return parse(r.json(), ids)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            why = f"{s.url} answered the sync check without prompt log-probs: {exc}"
            raise ServerError(why) from exc

    def _serves_policy(self, s: ServerState) -> bool:
        """A server coming back serves the last checked policy (``self.probe``, set by the sync
        check: probe ids, the trainer's log-probs, the tolerance); else it stays out."""
        if self.probe is None:
            return True
        from gyre.engines.verify import mean_gap

        ids, want, tol = self.probe
        got = self._score(s, ids)
        if got is None:
            return False
        gap = mean_gap(got, want)
        if gap > tol:
            s.last_error = (
                f"came back serving log-probs {gap:.4g} nats/token away from policy version "
                f"{self.version} (engine.verify_tolerance={tol:g})"
            )
            log.warning("gyre: server %s kept out: %s", s.url, s.last_error)
            return False
        return True

    def _lora_route(self, verb: str) -> str:
        # vLLM: /v1/load_lora_adapter; SGLang: /load_lora_adapter (same bodies)
        return f"/v1/{verb}_lora_adapter" if self.api == "openai" else f"/{verb}_lora_adapter"

    def _push_adapter(self, s: ServerState, name: str, path: str, old: str | None) -> bool:
        try:
            r = self.pool.client.post(
                f"{s.url}{self._lora_route('load')}", json={"lora_name": name, "lora_path": path}
            )
            if r.status_code != 200 and "already" not in r.text:
                raise ServerError(
                    f"{s.url} refused adapter {name} from {path}: {r.status_code} {r.text[:300]}"
                )
            if self.api == "openai":
                ok = name in self.pool.list_models(s)  # the acknowledgement: it serves the name
            else:
                body = r.json() if r.status_code == 200 else {}
                ok = bool(body.get("success")) and name in (body.get("loaded_adapters") or {name})
            if not ok:
                raise ServerError(f"{s.url} does not acknowledge adapter {name}: {r.text[:300]}")
            if old and old != name:
                self.pool.client.post(
                    f"{s.url}{self._lora_route('unload')}", json={"lora_name": old}
                )
            return True
        except self.pool.httpx.TransportError as exc:
            self.pool.take_out(s, f"adapter sync: {exc!r}")
            return False

    def _push_weights(self, s: ServerState, path: str, version: int, old: str | None) -> bool:
        try:
            if old:
                self.pool.client.post(
                    f"{s.url}{self._lora_route('unload')}", json={"lora_name": old}
                )
            r = self.pool.client.post(
                f"{s.url}/update_weights_from_disk",
                json={"model_path": path, "weight_version": str(version)},
            )
            is_json = r.headers.get("content-type", "").startswith("application/json")
            body = r.json() if is_json else {}
            if r.status_code != 200 or not body.get("success", False):
                raise ServerError(f"{s.url} failed to load weights from {path}: {r.text[:300]}")
            return True
        except self.pool.httpx.TransportError as exc:
            self.pool.take_out(s, f"weight sync: {exc!r}")
            return False

    # -- one request ------------------------------------------------------------------------
    def _body(self, prompt: list[int], params: SamplingParams, images: list[str]) -> dict[str, Any]:
        # SGLang names the adapter as ``lora_path`` (none: the base model); vLLM as ``model``
        if self.api == "sglang":
            name = self._adapter[0] if self._adapter else ""
        else:
            name = self.model_name
        return completion_body(self.api, name, prompt, params, images)

    def _complete(self, prompt: list[int], params: SamplingParams, images: list[str]) -> Completion:
        deadline = time.monotonic() + self.timeout_s
        attempts = 0
        while True:
            s = self.pool.pick(deadline)
            body = self._body(prompt, params, images)
            try:
                r = self.pool.client.post(f"{s.url}{completion_route(self.api)}", json=body)
            except self.pool.httpx.TransportError as exc:
                self.pool.done(s, ok=False)
                self.pool.take_out(s, repr(exc))
            else:
                self.pool.done(s, ok=r.status_code == 200)
                if r.status_code == 200:
                    return parse_answer(self.api, r.json(), s.url, len(prompt) if images else None)
                if r.status_code >= 500 or r.status_code == 404:
                    # 404: the server lacks the current adapter (e.g. restarted): resync first.
                    self.pool.take_out(s, f"{r.status_code}: {r.text[:200]}")
                else:
                    raise ServerError(f"{s.url} rejected a completion: {error_text(r)}")
            attempts += 1
            self.pool.count_retry()
            if attempts > self.max_retries:
                waited = time.monotonic() - deadline + self.timeout_s
                key = f"engine.max_retries={self.max_retries}, engine.timeout_s={self.timeout_s:g}"
                stage = f"completion (failed {attempts} times)"
                raise NoServerError(stage, self.servers, waited, key)

    # -- a server back from the dead --------------------------------------------------------
    def _bring_up(self, s: ServerState) -> None:
        """Bring a recovered server to the current policy, then let it take requests."""
        with self._sync_lock:
            if self._weights_path is not None:
                if not self._push_weights(s, self._weights_path, self.version, None):
                    return
            if self._adapter is not None:
                name, path = self._adapter
                if self.api != "openai" or name not in self.pool.list_models(s):
                    if not self._push_adapter(s, name, path, None):
                        return
            if not self._serves_policy(s):
                return
            self.pool.put_back(s)
            log.warning("gyre: server %s put back at policy version %d", s.url, self.version)
