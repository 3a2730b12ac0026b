"""``gyre serve`` against hostile requests, in process (FastAPI's TestClient, a tiny model).

Bounds on every sampling field, weight loads that refuse truncated / non-finite / tampered
files naming them, JSON errors everywhere (a 500 names its route), and a seeded fuzz of every
request body. The live-server checks (413 over a socket, /health latency, CLI refusals) are in
tests/integration/test_serve_limits.py.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from gyre.checkpoint.store import write_model_dir
from gyre.serve.requests import MIN_TEMPERATURE, ApiError
from gyre.serve.server import ModelHost, create_app


def _adapter(base_dir: Path, out: Path, fill: float | None = None) -> Path:
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    if fill is not None:
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.fill_(fill)
    pm.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory, make_tiny_model, tokenizer):
    """A served model folder with a manifest (``write_model_dir``, as ``final/`` is written),
    and broken variants of it."""
    root = tmp_path_factory.mktemp("hardening")
    final = write_model_dir(root / "final", make_tiny_model(seed=1), tokenizer)
    weights = final / "model.safetensors"
    # truncated weights (no manifest: the parse itself must fail cleanly)
    trunc = root / "trunc"
    shutil.copytree(final, trunc)
    (trunc / "manifest.json").unlink()
    (trunc / "model.safetensors").write_bytes(weights.read_bytes()[:1000])
    # one flipped byte in the tensor data, manifest kept: the hash must catch it
    flip = root / "flip"
    shutil.copytree(final, flip)
    data = bytearray((flip / "model.safetensors").read_bytes())
    data[-7] ^= 0x01
    (flip / "model.safetensors").write_bytes(bytes(data))
    # all-NaN weights in a plain save (no manifest)
    nan_model = make_tiny_model(seed=2)
    with torch.no_grad():
        for p in nan_model.parameters():
            p.fill_(float("nan"))
    nan_model.save_pretrained(root / "nan")
    tokenizer.save_pretrained(root / "nan")
    return {
        "root": root,
        "final": final,
        "trunc": trunc,
        "flip": flip,
        "nan": root / "nan",
        "adapter": _adapter(final, root / "adapter"),
        "nan_adapter": _adapter(final, root / "nan_adapter", fill=float("nan")),
    }


@pytest.fixture(scope="module")
def client(files):
    host = ModelHost(files["final"], "tiny", torch.device("cpu"))
    app = create_app(host, max_body_bytes=1 << 16)
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


def _err(r, status: int, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    if "error" in body:
        if param is not None:
            assert body["error"]["param"] == param, body
        return body["error"]["message"]
    assert body["success"] is False
    return body.get("message") or body["error_message"]


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("temperature", 1e-300, f">= {MIN_TEMPERATURE}"),
        ("temperature", 0.005, f">= {MIN_TEMPERATURE}"),
        ("temperature", -2.0, "greater than or equal to 0"),
        ("seed", 2**70, "less than or equal to 9223372036854775807"),
        ("seed", -1, "greater than or equal to 0"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("max_tokens", 0, "greater than or equal to 1"),
        ("max_tokens", 10**30, "less than or equal to"),
        ("n", 129, "less than or equal to 128"),
        ("logprobs", 21, "less than or equal to 20"),
    ],
)
def test_bad_sampling_values_are_400_naming_the_field(client, field, value, why):
    r = client.post("/v1/completions", json={"prompt": "1+1=", field: value})
    msg = _err(r, 400, field)
    assert why in msg and field in msg


def test_non_finite_floats_and_sglang_params_are_refused(client):
    for raw in (b'{"prompt": "1", "temperature": NaN}', b'{"prompt": "1", "top_p": Infinity}'):
        assert "finite" in _err(client.post("/v1/completions", content=raw), 400)
    r = client.post("/generate", json={"text": "1", "sampling_params": {"temperature": 1e-9}})
    assert "sampling_params.temperature" in _err(r, 400, "sampling_params.temperature")
    r = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "1"}], "seed": 2**64}
    )
    _err(r, 400, "seed")


def test_valid_edges_still_generate(client):
    for extra in ({"temperature": 0}, {"temperature": MIN_TEMPERATURE}, {"seed": 2**63 - 1}):
        r = client.post(
            "/v1/completions", json={"prompt": "1+1=", "max_tokens": 3, "logprobs": 0, **extra}
        )
        assert r.status_code == 200, r.text
        lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        assert len(lps) >= 1 and all(isinstance(x, float) for x in lps)  # finite: JSON numbers


def test_prompt_shapes_counts_and_context(client, tokenizer):
    assert "must be a string" in _err(client.post("/v1/completions", json={"prompt": 5}), 400)
    r = client.post("/v1/completions", json={"prompt": ["1"] * 40, "n": 128})
    assert "more than 4096 sequences" in _err(r, 400, "prompt")  # 40 x 128: too many
    ctx = client.get("/v1/models").json()["data"][0]["max_model_len"]
    r = client.post("/v1/completions", json={"prompt": "1" * ctx, "max_tokens": 8})
    assert "context length" in _err(r, 400, "max_tokens")
    r = client.post("/v1/completions", json={"prompt": [[1, 2], [len(tokenizer) + 5]]})
    assert "outside" in _err(r, 400, "prompt")


def test_bodies_with_too_many_json_containers_are_refused_before_parsing(client):
    r = client.post("/v1/completions", json={"prompt": [[1]] * 5000})
    assert "5002 JSON arrays/objects" in _err(r, 400, "body")
    # brackets inside strings are not containers: a bracket-heavy text prompt is served
    r = client.post("/v1/completions", json={"prompt": "[{" * 3000, "max_tokens": 1})
    assert "context length" in _err(r, 400, "max_tokens")  # parsed and tokenized: 6000 tokens
    r = client.post("/v1/completions", json={"prompt": ["[1]"] * 3000, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_body_over_the_limit_is_413_json(client):
    r = client.post("/v1/completions", json={"prompt": "x" * 70_000})
    assert "limit of 65536 bytes" in _err(r, 413)

    def chunks():  # no Content-Length: the streaming count must stop it
        for _ in range(40):
            yield b"x" * 4096

    assert "limit" in _err(client.post("/v1/completions", content=chunks()), 413)
    assert client.get("/health").json() == {"status": "ok"}


def test_unknown_route_method_and_bad_json_are_json(client):
    assert "Not Found" in _err(client.post("/v2/nothing", json={}), 404)
    assert "Method Not Allowed" in _err(client.get("/v1/completions"), 405)
    assert "Invalid JSON" in _err(client.post("/v1/completions", content=b"{nope"), 400)


def test_weight_files_are_checked_before_loading(client, files):
    cases = [
        ("trunc", "not a readable safetensors file"),
        ("flip", "model.safetensors sha256 mismatch"),
        ("nan", "has NaN or inf values"),
    ]
    for name, why in cases:
        r = client.post("/update_weights_from_disk", json={"model_path": str(files[name])})
        msg = _err(r, 400)
        assert why in msg and str(files[name]) in msg, msg
    msg = _err(client.post("/update_weights_from_disk", json={"model_path": "/no/such/dir"}), 400)
    assert "'/no/such/dir' is not a directory" in msg
    r = client.post("/update_weights_from_disk", json={"model_path": str(files["nan"])})
    nan = _err(r, 400)
    assert "tensor 'model." in nan  # names the tensor
    r = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(files["nan_adapter"])}
    )
    assert "lora_B" in _err(r, 400, "lora_path")
    r = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(files["final"])}
    )
    assert "not a peft adapter folder" in _err(r, 400, "lora_path")
    # none of the refusals changed what is served: a good adapter still loads, the base serves
    r = client.post(
        "/v1/load_lora_adapter", json={"lora_name": "good", "lora_path": str(files["adapter"])}
    )
    assert r.status_code == 200, r.text
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny", "good"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "good"}).status_code == 200
    r = client.post("/update_weights_from_disk", json={"model_path": str(files["final"])})
    assert r.status_code == 200 and r.json()["success"] is True


def test_serving_a_tampered_or_nan_folder_is_refused_at_load(files):
    with pytest.raises(ApiError, match=r"model\.safetensors sha256 mismatch"):
        ModelHost(files["flip"], "tiny", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"weight 'model\..*' has NaN or inf values"):
        ModelHost(files["nan"], "tiny", torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot load MODEL_DIR"):
        ModelHost(files["trunc"], "tiny", torch.device("cpu"))


def test_an_unexpected_exception_is_a_json_500_naming_the_route(files, monkeypatch):
    host = ModelHost(files["final"], "tiny", torch.device("cpu"))

    def boom(*_a, **_k):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(host, "generate", boom)
    with TestClient(create_app(host), raise_server_exceptions=False) as c:
        r = c.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 2})
    msg = _err(r, 500)
    assert msg == "internal error in POST /v1/completions: RuntimeError: engine exploded"


# -- fuzz -------------------------------------------------------------------------------------

FUZZ_PER_ROUTE = 200


def _pool(files: dict) -> list:
    paths = [str(files[k]) for k in ("final", "trunc", "flip", "nan", "adapter", "nan_adapter")]
    return [
        None,
        True,
        False,
        0,
        1,
        2,
        3,
        -1,
        2**31,
        2**63,
        2**70,
        -(2**70),
        0.0,
        -0.0,
        1e-300,
        0.5,
        1.0,
        1.5,
        1e308,
        -1e308,
        "",
        "1+1=",
        "\x00",
        "a" * 300,
        [],
        [1, 2],
        [[1], [2]],
        ["a", "b"],
        [1, "a"],
        [None],
        [-5],
        [10**20],
        {},
        {"a": 1},
        [{"role": "user"}],
        [{"role": "user", "content": "2+2="}],
        [{"role": "robot", "content": "x"}],
        "/no/such/path",
        *paths,
        "tiny",
        "good",
    ]


BASES = {
    "/v1/completions": {"prompt": "1+1=", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "1+"}], "max_tokens": 2},
    "/generate": {"text": "3+", "sampling_params": {"max_new_tokens": 2}},
    "/v1/load_lora_adapter": {"lora_name": "good", "lora_path": "/no/such/path"},
    "/v1/unload_lora_adapter": {"lora_name": "good"},
    "/load_lora_adapter": {"lora_name": "good", "lora_path": "/no/such/path"},
    "/unload_lora_adapter": {"lora_name": "good"},
    "/update_weights_from_disk": {"model_path": "/no/such/path"},
}
FIELDS = [
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "logprobs",
    "top_logprobs",
    "stop",
    "stop_token_ids",
    "seed",
    "stream",
    "echo",
    "model",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "top_logprobs_num",
    "lora_path",
    "lora_name",
    "model_path",
    "weight_version",
    "zzz_unknown",
]
SUB_FIELDS = ["max_new_tokens", "temperature", "top_p", "stop", "stop_token_ids", "ignore_eos"]


def _mutate(rng: random.Random, base: dict, pool: list) -> bytes:
    """One hostile body: a few field changes, or a wrong JSON type, or broken JSON."""
    roll = rng.random()
    if roll < 0.05:
        return json.dumps(base).encode()[: rng.randrange(1, 20)]  # truncated JSON
    if roll < 0.1:
        return json.dumps(rng.choice(pool)).encode()  # not an object at all
    body = json.loads(json.dumps(base))
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.2 and body:
            body.pop(rng.choice(list(body)))
        elif op < 0.35:
            sub = body.setdefault("sampling_params", {})
            if isinstance(sub, dict):
                sub[rng.choice(SUB_FIELDS)] = rng.choice(pool)
        else:
            body[rng.choice(FIELDS)] = rng.choice(pool)
    return json.dumps(body).encode()


def test_fuzzed_bodies_never_give_a_5xx_or_plain_text(client, files):
    """FUZZ_PER_ROUTE seeded bodies per route; every answer is a JSON 2xx/4xx (a plain-text
    200 is vLLM's answer to a successful LoRA load/unload, nothing else)."""
    rng = random.Random(1234)
    pool = _pool(files)
    seen: dict[int, int] = {}
    for route, base in BASES.items():
        for _ in range(FUZZ_PER_ROUTE):
            raw = _mutate(rng, base, pool)
            r = client.post(route, content=raw, headers={"content-type": "application/json"})
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (route, raw[:300], r.text[:500])
            if r.headers.get("content-type", "").startswith("text/plain"):
                assert r.status_code == 200 and route.startswith("/v1/") and "lora" in route
                assert r.text.startswith("Success:")
            else:
                r.json()
    # the fuzz reaches both sides: some bodies are served, most refused
    assert seen.get(200, 0) > 50 and seen.get(400, 0) > 500, seen
    assert client.get("/health").status_code == 200


# -- the command's auth rules -----------------------------------------------------------------


def _ns(*argv: str):
    from gyre.serve.server import _parser

    return _parser().parse_args(["MODEL", *argv])


def test_loopback_names():
    from gyre.serve.server import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "myhost.example"))


def test_api_key_sources(tmp_path, monkeypatch, capsys):
    from gyre.serve.server import _api_key

    monkeypatch.setenv("GYRE_API_KEY", "from-env")
    assert _api_key(_ns()) == "from-env"
    (tmp_path / "k").write_text("  from-file\n")
    assert _api_key(_ns("--api-key-file", str(tmp_path / "k"))) == "from-file"  # file wins
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match=r"--api-key-file .* is empty"):
        _api_key(_ns("--api-key-file", str(tmp_path / "empty")))
    with pytest.raises(ValueError, match=r"--api-key-file .* cannot be read"):
        _api_key(_ns("--api-key-file", str(tmp_path / "missing")))
    assert _api_key(_ns("--api-key", "flag")) == "flag"
    assert "process list" in capsys.readouterr().err
    monkeypatch.delenv("GYRE_API_KEY")
    assert _api_key(_ns()) == ""


def test_open_server_rules(capsys):
    from gyre.serve.server import _check_exposure

    _check_exposure(_ns("--host", "0.0.0.0"), "key")  # a key: any bind, no warning
    assert capsys.readouterr().err == ""
    _check_exposure(_ns(), "")  # loopback without a key: served, with a warning
    assert "warning: no API key" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--host 0\.0\.0\.0 .* --allow-open"):
        _check_exposure(_ns("--host", "0.0.0.0"), "")
    _check_exposure(_ns("--host", "0.0.0.0", "--allow-open"), "")
    assert "warning: no API key" in capsys.readouterr().err
