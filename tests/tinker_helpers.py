"""A ``gyre tinker-serve`` on a free loopback port for the official-SDK tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from serve_helpers import free_port


@dataclass
class LocalTinker:
    url: str
    service: object
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.service.close()


def start_in_process(state_dir: Path, **overrides: object) -> LocalTinker:
    """The server in a thread of this process (one import of torch, one tiny model)."""
    import uvicorn

    from gyre.tinker.config import TinkerServeConfig
    from gyre.tinker.server import build_service, create_app

    cfg = TinkerServeConfig(state_dir=str(state_dir), long_poll_s=2.0, **overrides)
    service = build_service(cfg)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(service), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                return LocalTinker(url, service, server, thread)
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("tinker-serve did not come up")


def sl_data(tok, reps: int = 1) -> list:
    """Three short prompt -> answer data (``reps`` times) for cross-entropy: loss weights on the
    answer tokens only."""
    from tinker import types

    out = []
    for prompt, answer in [("2+2=", "4"), ("3+3=", "6"), ("hi ", "there")] * reps:
        full = tok.encode(prompt + answer, add_special_tokens=False)
        n = len(tok.encode(prompt, add_special_tokens=False))
        weights = [0.0] * (n - 1) + [1.0] * (len(full) - n)
        out.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(full[:-1]),
                loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
            )
        )
    return out
