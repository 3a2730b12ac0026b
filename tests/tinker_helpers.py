"""A ``gyre tinker-serve`` on a free loopback port for the official-SDK tests."""

from __future__ import annotations

import argparse
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


def bench_args(doc: str | None) -> argparse.Namespace:
    """The SDK benches' shared flags: the model, the training batch and the sampling shape."""
    ap = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    ap.add_argument("--model-path", default="", help="a model folder (default: the tiny model)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per forward_backward")
    ap.add_argument("--length", type=int, default=64, help="tokens per training sequence")
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of the sample call")
    ap.add_argument("--samples", type=int, default=8, help="sequences per sample call")
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens each sample writes")
    ap.add_argument("--rounds", type=int, default=5)
    return ap.parse_args()


def random_sl_data(vocab: int, batch: int, length: int, g: object) -> tuple[list, list]:
    """``batch`` random token sequences of ``length`` and their cross-entropy data."""
    import torch
    from tinker import types

    seqs = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(batch)]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]}
        )
        for s in seqs
    ]
    return seqs, data
