"""``gyre serve`` /v1/chat/completions for a model with a chat template: a tiny Qwen2 with a
byte-level BPE + ChatML tokenizer (tests/helpers.py), in process (FastAPI's TestClient), driven
by the official ``openai`` client.

Under transformers 5 ``apply_chat_template(tokenize=True)`` returns a ``BatchEncoding``; the
server listed its keys as the prompt and answered 500. ``tools`` were dropped, and list
``content`` got a 400.
"""

from __future__ import annotations

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from gyre.models.build import load_tokenizer
from gyre.serve.server import ModelHost, create_app
from helpers import save_qwen2_bpe

TOOL = {
    "type": "function",
    "function": {
        "name": "add_numbers",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = save_qwen2_bpe(tmp_path_factory.mktemp("qwen") / "model", seed=1)
    host = ModelHost(path, "tiny", torch.device("cpu"))
    with TestClient(create_app(host), raise_server_exceptions=False) as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0
        )
        yield http, client, load_tokenizer(path)


def _template_ids(tok, messages, tools=None):
    out = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"])


def test_chat_completion_uses_the_chat_template(served):
    _, client, tok = served
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=4, seed=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.prompt_token_ids == _template_ids(tok, msgs)
    text = tok.decode(choice.prompt_token_ids)
    assert text == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n" \
        "<|im_start|>assistant\n"  # fmt: skip
    assert 1 <= len(choice.token_ids) <= 4


def test_tools_reach_the_template(served):
    _, client, tok = served
    msgs = [{"role": "user", "content": "add 1 and 2"}]
    r = client.chat.completions.create(
        model="tiny", messages=msgs, tools=[TOOL], max_tokens=2, seed=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompt = r.choices[0].prompt_token_ids
    assert prompt == _template_ids(tok, msgs, [TOOL])
    assert '"name": "add_numbers"' in tok.decode(prompt)


def test_list_content_text_parts_are_joined(served):
    _, client, tok = served
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "there"}]
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2, seed=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    want = _template_ids(tok, [{"role": "user", "content": "hello\nthere"}])
    assert r.choices[0].prompt_token_ids == want


def test_non_text_parts_are_a_400_naming_the_field(served):
    http, _, _ = served
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    r = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [image]}], "max_tokens": 1},
    )
    assert r.status_code == 400, r.text
    assert "messages.0.content" in r.json()["error"]["message"]


def test_tools_without_a_chat_template_are_refused(tmp_path, make_tiny_model, tokenizer):
    model = make_tiny_model(seed=0)
    model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    host = ModelHost(tmp_path / "m", "tiny", torch.device("cpu"))
    with TestClient(create_app(host), raise_server_exceptions=False) as http:
        r = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "1"}], "tools": [TOOL]},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
