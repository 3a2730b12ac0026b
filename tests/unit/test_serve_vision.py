"""``gyre serve`` with images, on the tiny Qwen2.5-VL, in process (FastAPI's TestClient): the
official ``openai`` client's chat ``image_url`` parts and SGLang's ``/generate`` ``input_ids`` +
``image_data`` give the ids the rollout builds and the in-process engine's tokens; bad image
input is a 400 naming the field."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from gyre.engines.torch_engine import TorchEngine
from gyre.models.vision import image_data_uri, image_from_uri, load_vlm, vision_of
from gyre.rollout.chat import ChatTemplate
from gyre.serve.server import ModelHost, create_app
from gyre.types import GenerationRequest, SamplingParams
from vision_helpers import square, tiny_vlm

CPU = torch.device("cpu")
QUESTION = "Which colour is the square?"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tiny_vlm("qwen2_5_vl", tmp_path_factory.getbasetemp() / "vlms")
    host = ModelHost(folder, "tiny", CPU)
    model, tok = load_vlm(folder, CPU)  # an independent copy for the in-process reference
    with TestClient(create_app(host), raise_server_exceptions=False) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )
        yield http, client, model.eval(), tok


def _chat(uri: str, text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}},
                                         {"type": "text", "text": text}]}]  # fmt: skip


def _local(model, tok, ids, images, max_new=4):
    """The in-process engine, greedy, no stop tokens: what the server must answer."""
    engine = TorchEngine(model, tok.pad_token_id, vision=vision_of(tok))
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new)
    return engine.generate([GenerationRequest(list(ids), images=list(images))], params)[0]


def test_data_uris_round_trip_the_pixels():
    img = square("blue", 3)
    assert np.array_equal(image_from_uri(image_data_uri(img), "x"), img)


def test_openai_client_sends_an_image_chat(served):
    _, client, model, tok = served
    img = square("red", 0)
    r = client.chat.completions.create(
        model="tiny", messages=_chat(image_data_uri(img)), max_tokens=4, temperature=0,
        logprobs=True, extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    choice = r.choices[0]
    # the prompt is the one the rollout builds for the same conversation (placeholder expanded
    # once, by the same VisionIO.expand)
    tpl = ChatTemplate(tok)
    hf = [{"role": "user", "content": [{"type": "image", "image": img},
                                       {"type": "text", "text": QUESTION}]}]  # fmt: skip
    want = tpl.encode_images(tpl.render(hf, True), [img], "test")
    vision = vision_of(tok)
    assert choice.prompt_token_ids == want
    assert want.count(vision.image_token_id) == vision.num_tokens(img) == 4
    local = _local(model, tok, want, [img])
    assert choice.token_ids == local.token_ids and len(local.token_ids) == 4
    got = [c.logprob for c in choice.logprobs.content]
    assert np.allclose(got, local.logprobs, atol=1e-4)
    # the pixels reach the model: another colour, the same ids, other log-probs
    other = _local(model, tok, want, [square("green", 0)])
    assert not np.allclose(other.logprobs, local.logprobs, atol=1e-6)


def test_multi_turn_chat_with_two_images(served):
    """A conversation with an assistant turn between two images: the whole rendering, each
    placeholder expanded for its own image, in order."""
    _, client, model, tok = served
    a, b = square("red", 1), square("blue", 2, size=64)  # two sizes: 4 and 16 image tokens
    msgs = [*_chat(image_data_uri(a)), {"role": "assistant", "content": "green"},
            {"role": "user", "content": [{"type": "text", "text": "No. Look again:"},
                                         {"type": "image_url",
                                          "image_url": {"url": image_data_uri(b)}}]}]  # fmt: skip
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=3, temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    hf = [{"role": "user", "content": [{"type": "image", "image": a},
                                       {"type": "text", "text": QUESTION}]},
          {"role": "assistant", "content": "green"},
          {"role": "user", "content": [{"type": "text", "text": "No. Look again:"},
                                       {"type": "image", "image": b}]}]  # fmt: skip
    tpl, vision = ChatTemplate(tok), vision_of(tok)
    want = tpl.encode_images(tpl.render(hf, True), [a, b], "test")
    assert r.choices[0].prompt_token_ids == want
    assert want.count(vision.image_token_id) == 4 + 16
    assert r.choices[0].token_ids == _local(model, tok, want, [a, b], max_new=3).token_ids


def test_generate_takes_expanded_or_placeholder_ids_with_image_data(served):
    http, _, model, tok = served
    tpl, vision = ChatTemplate(tok), vision_of(tok)
    img = square("yellow", 5)
    text = tpl.render(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}], True
    )
    expanded = vision.expand(text, [img])
    lone = tpl.encode(text)  # one <|image_pad|> per image: what a SGLang client sends
    assert lone.count(vision.image_token_id) == 1 < expanded.count(vision.image_token_id)
    local = _local(model, tok, expanded, [img], max_new=3)
    for ids in (expanded, lone):
        body = {
            "input_ids": ids,
            "image_data": [image_data_uri(img)],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        }
        r = http.post("/generate", json=body)  # fmt: skip
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["meta_info"]["prompt_tokens"] == len(expanded)
        assert out["output_ids"] == local.token_ids
        lps = [p[0] for p in out["meta_info"]["output_token_logprobs"]]
        assert np.allclose(lps, local.logprobs, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3_vl", "idefics3"])
def test_generate_with_images_on_the_other_tiny_vlms(tmp_path_factory, kind):
    folder = tiny_vlm(kind, tmp_path_factory.getbasetemp() / "vlms")
    model, tok = load_vlm(folder, CPU)
    tpl, vision = ChatTemplate(tok), vision_of(tok)
    imgs = [square("red", 1), square("blue", 2)]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"},
                                         {"type": "image"}]}]  # fmt: skip
    ids = vision.expand(tpl.render(msgs, True), imgs)
    local = _local(model.eval(), tok, ids, imgs, max_new=3)
    with TestClient(create_app(ModelHost(folder, "tiny", CPU))) as http:
        body = {
            "input_ids": ids,
            "image_data": [image_data_uri(i) for i in imgs],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        }
        out = http.post("/generate", json=body).json()  # fmt: skip
    assert out["output_ids"] == local.token_ids
    assert np.allclose([p[0] for p in out["meta_info"]["output_token_logprobs"]],
                       local.logprobs, atol=1e-4)  # fmt: skip


_PNG = image_data_uri(square("red", 0))
_NOT_PNG = "data:image/png;base64," + base64.b64encode(b"hello").decode()


@pytest.mark.parametrize(
    "uri, match",
    [
        ("http://example.com/a.png", "gyre fetches no URLs"),
        ("data:image/png;base64,!!!", "invalid base64"),
        (_NOT_PNG, "not a readable image"),
        ("data:image/png,abc", "must be base64"),
    ],
)
def test_bad_chat_images_are_a_400_naming_the_field(served, uri, match):
    http, _, _, _ = served
    body = {"model": "tiny", "messages": _chat(uri), "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.0.image_url.url" and match in err["message"]
    assert err["message"].startswith("messages.0.content.0.image_url.url: ")
    assert "\n" not in err["message"]


def test_bad_generate_images_are_a_400_naming_the_field(served):
    http, _, _, tok = served
    ids = tok("no image here", add_special_tokens=False)["input_ids"]
    cases = [
        ({"image_data": [_PNG]}, "image_data", "0 image tokens in the ids, but its 1 image"),
        ({"image_data": ["file:///etc/passwd"]}, "image_data.0", "gyre fetches no URLs"),
        ({"image_data": [_PNG, _NOT_PNG]}, "image_data.1", "not a readable image"),
    ]
    for extra, param, match in cases:
        r = http.post("/generate", json={"input_ids": ids, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and match in err["message"], err


def test_a_text_model_refuses_images(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    host = ModelHost(tmp_path / "m", "tiny", CPU)
    with TestClient(create_app(host), raise_server_exceptions=False) as http:
        r = http.post("/generate", json={"input_ids": [1, 2], "image_data": [_PNG]})
        assert r.status_code == 400 and "text-only" in r.json()["error"]["message"], r.text
        r = http.post("/v1/chat/completions", json={"messages": _chat(_PNG), "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content"


@pytest.mark.parametrize(
    "part, param",
    [
        ({"type": "image_url"}, "messages.0.content.0"),
        ({"type": "image_url", "image_url": {"url": 3}}, "messages.0.content.0.image_url.url"),
        ({"type": "video_url", "video_url": {"url": "x"}}, "messages.0.content.0.type"),
    ],
)
def test_malformed_parts_name_the_part(served, part, param):
    http, _, _, _ = served
    body = {"messages": [{"role": "user", "content": [part]}], "max_tokens": 1}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert f"{param}: " in r.json()["error"]["message"]
