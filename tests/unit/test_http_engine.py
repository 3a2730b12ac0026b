"""HttpEngine without servers: reply parsing (both dialects) and failing with a clear error."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gyre.engines.http_engine import (
    HttpEngine,
    NoServerError,
    ServerError,
)
from gyre.engines.http_wire import parse_completion, parse_generate
from gyre.types import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serve_helpers import free_port


def test_http_completion_parsing():
    ok = {
        "choices": [
            {
                "finish_reason": "stop",
                "logprobs": {
                    "tokens": ["token_id:7", "token_id:4"],
                    "token_logprobs": [-0.5, -0.25],
                    "top_logprobs": [{"token_id:7": -0.5}, {"token_id:4": -0.25}],
                },
            }
        ]
    }
    c = parse_completion(ok, "u")
    assert c.token_ids == [7, 4] and c.logprobs == [-0.5, -0.25] and c.finish_reason == "stop"
    assert c.top_logprobs == [{7: -0.5}, {4: -0.25}]
    ok["choices"][0]["token_ids"] = [7, 4]  # vLLM's return_token_ids wins when present
    assert parse_completion(ok, "u").token_ids == [7, 4]
    bad = {"choices": [{"finish_reason": "length", "token_ids": [1, 2], "logprobs": None}]}
    with pytest.raises(ServerError, match="logprobs"):
        parse_completion(bad, "http://x")
    short = {
        "choices": [
            {"finish_reason": "length", "token_ids": [1, 2], "logprobs": {"token_logprobs": [0.0]}}
        ]
    }
    with pytest.raises(ServerError, match="2 token ids but 1 logprobs"):
        parse_completion(short, "http://x")
    text_tokens = {
        "choices": [
            {"finish_reason": "length", "logprobs": {"tokens": ["a"], "token_logprobs": [0.0]}}
        ]
    }
    with pytest.raises(ServerError, match="token_id"):
        parse_completion(text_tokens, "http://x")


def test_sglang_generate_parsing():
    data = {
        "output_ids": [9, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "output_token_logprobs": [[-1.0, 9, None], [-0.5, 2, None]],
        },
    }
    c = parse_generate(data, "u")
    assert c.token_ids == [9, 2] and c.logprobs == [-1.0, -0.5] and c.finish_reason == "stop"
    data["output_ids"] = [9, 3]
    with pytest.raises(ServerError, match="disagree"):
        parse_generate(data, "u")
    with pytest.raises(ServerError, match="output_token_logprobs"):
        parse_generate({"meta_info": {}}, "u")


def test_image_requests_send_image_data_and_check_the_prompt_length():
    """engine.api=sglang: the ids as they are + the images as PNG data URIs; an answer whose
    prompt length differs (the server expanded the placeholders otherwise) is an error."""
    import numpy as np

    from gyre.engines.http_wire import image_uris
    from gyre.models.vision import image_from_uri

    engine = HttpEngine(["http://127.0.0.1:9"], model="m", api="sglang")
    img = np.zeros((4, 6, 3), np.uint8)
    img[1, 2] = (1, 2, 3)
    reqs = [GenerationRequest([5, 6], images=[img, img]), GenerationRequest([5])]
    uris = image_uris(reqs)
    assert uris[1] == [] and uris[0][0] == uris[0][1]
    body = engine._body([5, 6], SamplingParams(), uris[0])
    assert body["input_ids"] == [5, 6] and len(body["image_data"]) == 2
    assert np.array_equal(image_from_uri(body["image_data"][0], "x"), img)
    assert "image_data" not in engine._body([5], SamplingParams(), [])
    engine.close()
    answer = {"meta_info": {"prompt_tokens": 10, "output_token_logprobs": [[-0.5, 7, None]]}}
    assert parse_generate(answer, "http://s", 10).token_ids == [7]
    with pytest.raises(ServerError, match="ran 10 prompt tokens for a prompt of 13 ids"):
        parse_generate(answer, "http://s", 13)
    with pytest.raises(ServerError, match=r"no meta_info\.prompt_tokens"):
        parse_generate({"meta_info": {"output_token_logprobs": []}}, "http://s", 3)


def test_no_live_server_fails_clearly_after_the_timeout():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    engine = HttpEngine([url], model="m", timeout_s=1.0, health_interval_s=0.1, max_retries=2)
    try:
        with pytest.raises(NoServerError, match=url.split("//")[1]):
            engine.generate([GenerationRequest([1, 2])], SamplingParams(max_new_tokens=2))
        assert engine.alive_count() == 0
    finally:
        engine.close()


def test_bad_api_and_no_urls_are_refused():
    with pytest.raises(ValueError, match=r"engine\.api"):
        HttpEngine(["http://127.0.0.1:1"], api="grpc")
    with pytest.raises(ValueError, match=r"engine\.urls"):
        HttpEngine([])


def test_refusals_read_the_servers_json_message():
    import httpx

    from gyre.engines.http_wire import error_text

    err = {"error": {"message": "invalid request: seed: too big", "param": "seed", "code": 400}}
    assert error_text(httpx.Response(400, json=err)) == "400 invalid request: seed: too big"
    big = {"error": {"message": "request body is larger than this server's limit", "code": 413}}
    assert "--max-body-mb" in error_text(httpx.Response(413, json=big))
    sglang = {"success": False, "message": "model_path '/x' is not a directory"}
    assert error_text(httpx.Response(400, json=sglang)).endswith("is not a directory")
    assert error_text(httpx.Response(400, text="plain words")) == "400 plain words"
