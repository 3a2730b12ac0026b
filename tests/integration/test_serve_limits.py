"""A live ``gyre serve`` process under hostile requests: body limit over a real socket, /health
latency while a large prompt is tokenized, and the command's refusals (open bind, bad folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from gyre.checkpoint.store import write_model_dir
from serve_helpers import free_port, start_server

KEY = "sk-limits-key"
LIMIT_MB = 2


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_tiny_model, tokenizer):
    root = tmp_path_factory.mktemp("limits")
    final = write_model_dir(root / "final", make_tiny_model(seed=4), tokenizer)
    key_file = root / "key.txt"
    key_file.write_text(KEY + "\n")
    args = ("--api-key-file", str(key_file), "--max-body-mb", str(LIMIT_MB))
    srv = start_server(final, root, extra_args=args)
    yield srv, root
    srv.stop()


def _headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_key_file_is_required(served):
    srv, _ = served
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "1", "max_tokens": 1})
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    r = httpx.post(
        f"{srv.url}/v1/completions", json={"prompt": "1", "max_tokens": 1}, headers=_headers()
    )
    assert r.status_code == 200, r.text


def test_oversized_bodies_get_413_json_over_a_socket(served):
    srv, _ = served
    big = b'{"prompt": "' + b"x" * (LIMIT_MB * (1 << 20) + 10) + b'"}'
    r = httpx.post(f"{srv.url}/v1/completions", content=big, headers=_headers(), timeout=30)
    assert r.status_code == 413, r.text
    assert f"limit of {LIMIT_MB << 20} bytes" in r.json()["error"]["message"]

    def chunks():  # chunked transfer, no Content-Length: refused once the count passes
        for _ in range(LIMIT_MB * 16 + 1):
            yield b"x" * 65536

    r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), headers=_headers(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_health_answers_fast_while_a_large_prompt_is_tokenized(served):
    """The issue's explicit latency requirement: /health < 100 ms while a large request runs.

    A 1 MB text prompt (under the limit) takes seconds to tokenize on a 2-core machine and is
    then refused for the context length. Tokenization runs on the server's prep thread (the
    Rust tokenizer releases the GIL), so the event loop keeps answering. Robust to CI noise:
    the < 100 ms bound is on the best probe sent while the request was in flight (a busy
    machine can delay one probe, not all of them), and the bound that catches a blocked loop
    (a probe then waits for the whole tokenization, seconds) is a generous 1 s on the worst.
    """
    srv, _ = served
    text = "1+2=" * 250_000
    done: dict[str, object] = {}

    def big() -> None:
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={"prompt": text, "max_tokens": 1},
            headers=_headers(),
            timeout=300,
        )
        done["status"], done["body"], done["end"] = r.status_code, r.json(), time.monotonic()

    probes: list[tuple[float, float]] = []
    with httpx.Client(timeout=30) as client:
        client.get(f"{srv.url}/health")  # open the connection first: time the server, not TCP
        thread = threading.Thread(target=big)
        thread.start()
        while thread.is_alive() and len(probes) < 40:
            sent, t = time.monotonic(), time.perf_counter()
            assert client.get(f"{srv.url}/health").status_code == 200
            probes.append((time.perf_counter() - t, sent))
            time.sleep(0.05)
        thread.join()
    assert done["status"] == 400 and "context length" in str(done["body"]), done
    during = [lat for lat, sent in probes if sent < float(done["end"])]  # type: ignore[arg-type]
    assert len(during) >= 3, probes
    assert min(during) < 0.1, during
    assert max(during) < 1.0, during


def _serve_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "GYRE_API_KEY": "", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "gyre.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_open_bind_beyond_loopback_is_refused(served):
    _, root = served
    p = _serve_cli(str(root / "final"), "--host", "0.0.0.0", "--port", str(free_port()))
    assert p.returncode == 2, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("gyre serve: error:")]
    assert len(err) == 1 and "--host 0.0.0.0" in err[0] and "--allow-open" in err[0], p.stderr


def test_a_tampered_final_folder_is_refused_at_start(served):
    _, root = served
    flip = root / "flipped"
    shutil.copytree(root / "final", flip)
    data = bytearray((flip / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (flip / "model.safetensors").write_bytes(bytes(data))
    p = _serve_cli(str(flip), "--port", str(free_port()))
    assert p.returncode == 1, p.stderr
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("gyre serve: error:")]
    assert len(err) == 1 and "model.safetensors sha256 mismatch" in err[0], p.stderr
