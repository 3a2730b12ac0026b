"""Servers that fail on purpose: ``gyre serve`` in a thread, and a lying proxy in front of it.

:class:`LyingProxy` forwards every request to a real server except what its ``mode`` fakes:

- ``honest``: nothing (a plain proxy);
- ``weights``: acknowledges ``/update_weights_from_disk`` with ``{"success": true}`` and does not
  forward it (the server keeps its old weights);
- ``lora``: acknowledges adapter loads (vLLM's and SGLang's routes) without forwarding them,
  lists the acknowledged adapters in ``/v1/models``, and sends every request that names one of
  them to the base model instead;
- ``wedge``: accepts connections and never answers, after ``wedge_after`` completions answered.

Both run in this process on free loopback ports (no child process: seconds of imports saved).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import torch

from serve_helpers import free_port

MODES = ("honest", "weights", "lora", "wedge")
_COMPLETION_ROUTES = ("/v1/completions", "/generate", "/v1/chat/completions")


class ThreadServer:
    """``gyre serve``'s app for ``model_dir`` under uvicorn in a daemon thread."""

    def __init__(self, model_dir: Path, name: str = "tiny") -> None:
        import uvicorn

        from gyre.serve.server import ModelHost, create_app

        self.host = ModelHost(model_dir, name, torch.device("cpu"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(self.host, batch_wait_ms=1.0), host="127.0.0.1", port=self.port,
            log_level="warning",
        )  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="serve")
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("gyre serve did not start in its thread")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class LyingProxy:
    """A proxy to ``upstream`` that fakes what ``mode`` says (module docstring)."""

    def __init__(self, upstream: str, mode: str = "honest", wedge_after: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}; valid: {', '.join(MODES)}")
        self.upstream, self.mode, self.wedge_after = upstream, mode, wedge_after
        self.faked: dict[str, str] = {}  # adapters acknowledged and never loaded
        self.completions = 0
        self.counts: dict[str, int] = {}
        self.release = threading.Event()  # wedge: set to let the hung handlers go
        self._client = httpx.Client(timeout=60.0)
        self._lock = threading.Lock()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._http = _QuietServer(("127.0.0.1", self.port), _handler(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.release.set()
        self._http.shutdown()
        self._http.server_close()
        self._client.close()

    # -- what the handler asks ------------------------------------------------------------------
    def answer(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        """(status, content type, body) for one request."""
        with self._lock:
            self.counts[path] = self.counts.get(path, 0) + 1
            if path in _COMPLETION_ROUTES:
                self.completions += 1
            wedged = self.mode == "wedge" and self.completions > self.wedge_after
        if wedged:
            self.release.wait()  # never answers while the test runs
            return 503, "text/plain", b"released"
        data = json.loads(body) if body else None
        if self.mode == "weights" and path == "/update_weights_from_disk":
            return _json({"success": True, "message": "ok", "num_paused_requests": 0})
        if self.mode == "lora":
            faked = self._fake_lora(path, data)
            if faked is not None:
                return faked
            data = self._to_base(path, data)
        r = self._client.request(
            method, f"{self.upstream}{path}", content=None if data is None else json.dumps(data),
            headers={"content-type": "application/json"},
        )  # fmt: skip
        content = r.content
        if self.mode == "lora" and path == "/v1/models" and r.status_code == 200:
            listing = r.json()
            base = listing["data"][0]["id"]
            for name, root in self.faked.items():
                listing["data"].append({"id": name, "object": "model", "root": root,
                                        "parent": base})  # fmt: skip
            content = json.dumps(listing).encode()
        return r.status_code, r.headers.get("content-type", "application/json"), content

    def _fake_lora(self, path: str, data: Any) -> tuple[int, str, bytes] | None:
        if path in ("/v1/load_lora_adapter", "/load_lora_adapter"):
            self.faked[data["lora_name"]] = data["lora_path"]
            if path.startswith("/v1"):
                return 200, "text/plain", b"Success: LoRA adapter added successfully."
            return _json({"success": True, "error_message": "", "loaded_adapters": self.faked})
        if path in ("/v1/unload_lora_adapter", "/unload_lora_adapter"):
            self.faked.pop(data["lora_name"], None)
            if path.startswith("/v1"):
                return 200, "text/plain", b"Success: LoRA adapter removed successfully."
            return _json({"success": True, "error_message": "", "loaded_adapters": self.faked})
        return None

    def _to_base(self, path: str, data: Any) -> Any:
        """A request for a faked adapter goes to the base model."""
        if not isinstance(data, dict):
            return data
        if data.get("model") in self.faked:
            data = {**data, "model": None}
        if data.get("lora_path") in self.faked:
            data = {**data, "lora_path": None}
        return data


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up on a wedged answer: nothing to report."""


def _json(obj: Any) -> tuple[int, str, bytes]:
    return 200, "application/json", json.dumps(obj).encode()


def _handler(proxy: LyingProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:
            return

        def _serve(self, method: str) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                status, ctype, out = proxy.answer(method, self.path, body)
            except httpx.HTTPError as exc:
                status, ctype, out = 502, "text/plain", repr(exc).encode()
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

    return Handler
