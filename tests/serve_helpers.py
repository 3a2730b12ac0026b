"""Start and stop ``gyre serve`` subprocesses on free loopback ports (for HTTP tests)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    port: int
    model_dir: Path
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def start_server(
    model_dir: Path,
    log_dir: Path,
    api_key: str = "",
    port: int | None = None,
    name: str = "tiny",
    timeout_s: float = 120.0,
    extra_args: tuple[str, ...] = (),
) -> Served:
    """``gyre serve`` in a child process; returns once ``/health`` answers.

    The key goes through ``$GYRE_API_KEY``, never the command line (where ``ps`` shows it).
    """
    port = port or free_port()
    log = log_dir / f"serve-{port}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", "gyre.cli", "serve", str(model_dir), "--port", str(port)]
    cmd += ["--served-model-name", name, *extra_args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("GYRE_API_KEY", None)
    if api_key:
        env["GYRE_API_KEY"] = api_key
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    served = Served(proc, f"http://127.0.0.1:{port}", port, model_dir, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gyre serve exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{served.url}/health", timeout=1.0).status_code == 200:
                return served
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    served.stop()
    raise RuntimeError(f"gyre serve did not come up in {timeout_s}s:\n{log.read_text()}")
