"""An engine over OpenAI-compatible servers: vLLM, SGLang or ``gyre serve``.

Token-in/token-out: every request sends the prompt as a list of token ids and asks for the
sampled ids back (``return_token_ids`` and ``return_tokens_as_token_ids``, vLLM's fields), with
``logprobs`` for each sampled token. Text is never re-tokenised, so the trainer scores exactly
the tokens the server sampled.

Load balancing: each request goes to the live server with the fewest requests in flight. A
request that fails on a server (connection refused or reset, timeout, 5xx, or 404 for a model it
should hold) takes that server out and is retried on another one, so no episode is lost while
any server lives. A background thread probes ``/health`` of servers that are out; one that
answers again is first brought up to the current policy (adapter or full weights) and only then
put back.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from gyre.deadlines import BadAnswer, PeerFault
from gyre.engines.base import EngineFeatures
from gyre.types import Completion, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)


APIS = ("openai", "sglang")


class ServerError(BadAnswer):
    """A server answered, but not usefully (bad status, malformed body): an engine fault."""

    kind = "engine"


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


class HttpEngine:
    """Engine over a set of OpenAI-compatible completion servers. A request's own
    ``temperature`` is sent in its body in place of the batch's."""

    features = EngineFeatures(per_request_temperature=True, remote=True)

    def __init__(
        self,
        urls: list[str],
        api_key: str = "",
        model: str = "",
        timeout_s: float = 120.0,
        max_retries: int = 8,
        health_interval_s: float = 1.0,
        max_concurrency: int = 64,
        adapter_prefix: str = "gyre",
        api: str = "openai",
    ) -> None:
        if not urls:
            raise ValueError("HttpEngine needs at least one server URL (engine.urls)")
        if api not in APIS:
            raise ValueError(f"engine.api={api!r}; valid: {', '.join(APIS)}")
        self.api = api
        httpx = _httpx()
        self._httpx = httpx
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(5.0, timeout_s)),
            limits=httpx.Limits(max_connections=max_concurrency + 4),
        )
        self.servers = [ServerState(u.rstrip("/")) for u in urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.health_interval_s = health_interval_s
        self.adapter_prefix = adapter_prefix
        self.version = 0
        self.stats = {"requests": 0, "retries": 0, "servers_taken_out": 0, "servers_put_back": 0}
        self._base_model = model
        self._adapter: tuple[str, str] | None = None  # (served name, path) of the current policy
        self._weights_path: str | None = None  # last full-weight sync folder
        self.probe: tuple[list[int], list[float], float] | None = None  # the sync check's
        self._cond = threading.Condition()
        self._sync_lock = threading.RLock()  # sync and put-back never interleave
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="gyre-http")
        self._stop = threading.Event()
        self._rr = 0
        self._health = threading.Thread(target=self._health_loop, daemon=True, name="gyre-health")
        self._health.start()

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
        uris = _image_uris(requests)
        futures = [
            self._pool.submit(self._complete, r.prompt_ids, _own_temperature(params, r), i, uris[i])
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
            self._base_model = self._discover_base()
        return self._base_model

    def alive_count(self) -> int:
        return sum(s.alive for s in self.servers)

    def close(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

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
                r = self._client.post(f"{s.url}/generate", json=body)
                parse = parse_sglang_prompt_logprobs
            else:
                body = openai_probe_body(ids, self.model_name)
                r = self._client.post(f"{s.url}/v1/completions", json=body)
                parse = parse_openai_prompt_logprobs
        except self._httpx.TransportError as exc:
            self._take_out(s, f"sync check: {exc!r}")
            return None
        if r.status_code != 200:
            raise ServerError(f"{s.url} refused the sync check: {_error_text(r)}")
        try:
            return parse(r.json(), ids)
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ServerError(f"{s.url} answered the sync check without prompt log-probs: "
                              f"{exc}") from exc  # fmt: skip

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
            r = self._client.post(
                f"{s.url}{self._lora_route('load')}", json={"lora_name": name, "lora_path": path}
            )
            if r.status_code != 200 and "already" not in r.text:
                raise ServerError(
                    f"{s.url} refused adapter {name} from {path}: {r.status_code} {r.text[:300]}"
                )
            if self.api == "openai":
                ok = name in self._list_models(s)  # the acknowledgement: it serves the name
            else:
                body = r.json() if r.status_code == 200 else {}
                ok = bool(body.get("success")) and name in (body.get("loaded_adapters") or {name})
            if not ok:
                raise ServerError(f"{s.url} does not acknowledge adapter {name}: {r.text[:300]}")
            if old and old != name:
                self._client.post(f"{s.url}{self._lora_route('unload')}", json={"lora_name": old})
            return True
        except self._httpx.TransportError as exc:
            self._take_out(s, f"adapter sync: {exc!r}")
            return False

    def _push_weights(self, s: ServerState, path: str, version: int, old: str | None) -> bool:
        try:
            if old:
                self._client.post(f"{s.url}{self._lora_route('unload')}", json={"lora_name": old})
            r = self._client.post(
                f"{s.url}/update_weights_from_disk",
                json={"model_path": path, "weight_version": str(version)},
            )
            is_json = r.headers.get("content-type", "").startswith("application/json")
            body = r.json() if is_json else {}
            if r.status_code != 200 or not body.get("success", False):
                raise ServerError(f"{s.url} failed to load weights from {path}: {r.text[:300]}")
            return True
        except self._httpx.TransportError as exc:
            self._take_out(s, f"weight sync: {exc!r}")
            return False

    def _list_models(self, s: ServerState) -> list[str]:
        r = self._client.get(f"{s.url}/v1/models")
        if r.status_code != 200:
            raise ServerError(f"{s.url}/v1/models answered {r.status_code}: {r.text[:200]}")
        return [m["id"] for m in r.json().get("data", [])]

    def _discover_base(self) -> str:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for s in self.servers:
                if not s.alive:
                    continue
                try:
                    r = self._client.get(f"{s.url}/v1/models")
                    if r.status_code == 200:
                        data = r.json().get("data", [])
                        bases = [m["id"] for m in data if not m.get("parent")]
                        if bases:
                            return bases[0]
                except self._httpx.TransportError as exc:
                    self._take_out(s, repr(exc))
            self._wait_for_server(deadline)
        raise NoServerError(
            "start-up (GET /v1/models)", self.servers, self.timeout_s, "engine.timeout_s"
        )

    # -- one request ------------------------------------------------------------------------
    def _body(
        self, prompt: list[int], params: SamplingParams, index: int, images: list[str]
    ) -> dict[str, Any]:
        if self.api == "sglang":  # SGLang's native /generate: ids in, ids + logprobs out
            image_data = {"image_data": images} if images else {}
            return {
                **image_data,
                "input_ids": list(prompt),
                "sampling_params": {
                    "max_new_tokens": params.max_new_tokens,
                    "temperature": params.temperature,
                    "top_p": params.top_p,
                    "stop_token_ids": list(params.stop_token_ids),
                    "ignore_eos": True,
                    "skip_special_tokens": False,
                },
                "return_logprob": True,
                "top_logprobs_num": params.top_logprobs,
                "lora_path": self._adapter[0] if self._adapter else None,
            }
        body: dict[str, Any] = {
            "model": self.model_name,
            "prompt": list(prompt),
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": 1,
            "logprobs": params.top_logprobs,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "ignore_eos": True,  # stop exactly on stop_token_ids, as the in-process engine does
            "stop_token_ids": list(params.stop_token_ids),
        }
        # No per-request ``seed``: a seeded request cannot share a batch on gyre serve, and the
        # sampling RNG lives in the servers anyway (HTTP rollouts are not bit-reproducible).
        return body

    def _complete(
        self, prompt: list[int], params: SamplingParams, index: int, images: list[str]
    ) -> Completion:
        deadline = time.monotonic() + self.timeout_s
        attempts = 0
        while True:
            s = self._pick(deadline)
            body = self._body(prompt, params, index, images)
            try:
                route = "/v1/completions" if self.api == "openai" else "/generate"
                r = self._client.post(f"{s.url}{route}", json=body)
            except self._httpx.TransportError as exc:
                self._done(s, ok=False)
                self._take_out(s, repr(exc))
            else:
                self._done(s, ok=r.status_code == 200)
                if r.status_code == 200:
                    if self.api == "sglang":
                        return _parse_generate(r.json(), s.url, len(prompt) if images else None)
                    return _parse_completion(r.json(), s.url)
                if r.status_code >= 500 or r.status_code == 404:
                    # 404: the server lacks the current adapter (e.g. restarted): resync first.
                    self._take_out(s, f"{r.status_code}: {r.text[:200]}")
                else:
                    raise ServerError(f"{s.url} rejected a completion: {_error_text(r)}")
            attempts += 1
            with self._cond:
                self.stats["retries"] += 1
            if attempts > self.max_retries:
                waited = time.monotonic() - deadline + self.timeout_s
                key = f"engine.max_retries={self.max_retries}, engine.timeout_s={self.timeout_s:g}"
                raise NoServerError(f"completion (failed {attempts} times)", self.servers,
                                    waited, key)  # fmt: skip

    def _pick(self, deadline: float) -> ServerState:
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
                    raise NoServerError("completion (no live server)", self.servers,
                                        self.timeout_s, key)  # fmt: skip
                self._cond.wait(min(left, self.health_interval_s))

    def _wait_for_server(self, deadline: float) -> None:
        with self._cond:
            if not any(s.alive for s in self.servers):
                self._cond.wait(max(0.0, min(deadline - time.monotonic(), self.health_interval_s)))

    def _done(self, s: ServerState, ok: bool) -> None:
        with self._cond:
            s.inflight -= 1
            if ok:
                s.served += 1
                self.stats["requests"] += 1

    def _take_out(self, s: ServerState, why: str) -> None:
        with self._cond:
            s.last_error = why
            s.failures += 1
            if s.alive:
                s.alive = False
                self.stats["servers_taken_out"] += 1
                log.warning("gyre: server %s taken out: %s", s.url, why)

    # -- health -----------------------------------------------------------------------------
    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            for s in self.servers:
                if s.alive or self._stop.is_set():
                    continue
                try:
                    r = self._client.get(f"{s.url}/health", timeout=2.0)
                    if r.status_code != 200:
                        continue
                    self._put_back(s)
                except Exception as exc:  # a probe must never kill the health thread
                    s.last_error = repr(exc)

    def _put_back(self, s: ServerState) -> None:
        """Bring a recovered server to the current policy, then let it take requests."""
        with self._sync_lock:
            if self._weights_path is not None:
                if not self._push_weights(s, self._weights_path, self.version, None):
                    return
            if self._adapter is not None:
                name, path = self._adapter
                if self.api != "openai" or name not in self._list_models(s):
                    if not self._push_adapter(s, name, path, None):
                        return
            if not self._serves_policy(s):
                return
            with self._cond:
                s.alive = True
                s.last_error = ""
                self.stats["servers_put_back"] += 1
                self._cond.notify_all()
            log.warning("gyre: server %s put back at policy version %d", s.url, self.version)


def _error_text(r: Any) -> str:
    """A refusal in one line: the status and the server's message (OpenAI / SGLang JSON)."""
    try:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        msg = msg or (body.get("message") or body.get("error_message") or body.get("detail"))
    except ValueError:
        msg = None
    text = str(msg) if msg else r.text[:300]
    if r.status_code == 413:
        text += " (a prompt this large needs a larger body limit, e.g. gyre serve --max-body-mb)"
    return f"{r.status_code} {text}"


def _parse_completion(data: dict[str, Any], url: str) -> Completion:
    try:
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        ids = choice.get("token_ids")
        if ids is None and lp.get("tokens") is not None:
            ids = [_token_id(t) for t in lp["tokens"]]
        if ids is None or logprobs is None:
            raise ServerError(
                f"{url} returned no token ids/logprobs: it must accept vLLM's "
                "return_token_ids / return_tokens_as_token_ids and logprobs fields"
            )
        if len(ids) != len(logprobs):
            raise ServerError(f"{url} returned {len(ids)} token ids but {len(logprobs)} logprobs")
        top = None
        if lp.get("top_logprobs"):
            top = [{_token_id(k): float(v) for k, v in d.items()} for d in lp["top_logprobs"]]
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion([int(t) for t in ids], [float(x) for x in logprobs], reason, top)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{url} returned a malformed completion: {exc!r}") from exc


def _own_temperature(params: SamplingParams, req: GenerationRequest) -> SamplingParams:
    """``params`` with the request's own temperature, where it sets one."""
    return params if req.temperature is None else replace(params, temperature=req.temperature)


def _image_uris(requests: list[GenerationRequest]) -> list[list[str]]:
    """Each request's images as PNG data URIs, each distinct image encoded once."""
    if not any(r.images for r in requests):
        return [[] for _ in requests]
    from gyre.models.vision import image_data_uri, image_key

    done: dict[bytes, str] = {}
    out = []
    for r in requests:
        row = []
        for img in r.images:
            key = image_key(img)
            if key not in done:
                done[key] = image_data_uri(img)
            row.append(done[key])
        out.append(row)
    return out


def _parse_generate(data: dict[str, Any], url: str, prompt_len: int | None = None) -> Completion:
    """SGLang's /generate answer: ``meta_info.output_token_logprobs`` = [[logprob, id, text]].

    ``prompt_len`` (a request with images): the server re-runs its processor on the prompt, so
    it must report running exactly that many prompt tokens (``meta_info.prompt_tokens``), or
    its placeholder expansion differs from the one the trainer scores (docs/vision.md)."""
    try:
        meta = data["meta_info"]
        ran = meta.get("prompt_tokens")
        if prompt_len is not None and ran is None:
            raise ServerError(f"{url} returned no meta_info.prompt_tokens for a prompt with "
                              "images: its placeholder expansion cannot be checked")  # fmt: skip
        if prompt_len is not None and ran != prompt_len:
            raise ServerError(
                f"{url} ran {ran} prompt tokens for a prompt of {prompt_len} ids with images: "
                "its image placeholder expansion differs from gyre's (docs/vision.md)"
            )
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise ServerError(f"{url} returned no output_token_logprobs (send return_logprob)")
        ids = [int(p[1]) for p in pairs]
        if data.get("output_ids") is not None and list(data["output_ids"])[-len(ids) :] != ids:
            raise ServerError(f"{url}: output_ids and output_token_logprobs disagree")
        top = None
        if meta.get("output_top_logprobs"):
            top = [{int(t[1]): float(t[0]) for t in step} for step in meta["output_top_logprobs"]]
        fr = meta.get("finish_reason") or {}
        reason = "stop" if (fr.get("type") if isinstance(fr, dict) else fr) == "stop" else "length"
        return Completion(ids, [float(p[0]) for p in pairs], reason, top)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{url} returned a malformed /generate answer: {exc!r}") from exc


def _token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not 'token_id:N' (send return_tokens_as_token_ids)")
    return int(token.split(":", 1)[1])
