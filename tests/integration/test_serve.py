"""``gyre serve`` in a subprocess, driven by the official ``openai`` client and raw HTTP.

The model is a 2-layer, 32-wide Llama with sharpened weights, so sampled logprobs are far from
uniform and a wrong model or adapter would show in them.
"""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
import torch

from gyre.models.lora import load_adapter_into
from serve_helpers import start_server

KEY = "sk-test-key"


def _sharp_model(make_tiny_model, tokenizer, path, seed):
    model = make_tiny_model(seed=seed, sharp=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_tiny_model, tokenizer):
    root = tmp_path_factory.mktemp("serve")
    model = _sharp_model(make_tiny_model, tokenizer, root / "model", seed=3)
    srv = start_server(root / "model", root, api_key=KEY)
    yield srv, model, root
    srv.stop()


@pytest.fixture()
def client(served):
    srv, _, _ = served
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)


def _local_logprobs(model, prompt_ids, completion_ids):
    """log p(completion token | prefix) under the model at temperature 1."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    n = len(prompt_ids)
    return [float(logp[n - 1 + i, t]) for i, t in enumerate(completion_ids)]


def test_models_and_health(served, client):
    srv, _, _ = served
    assert httpx.get(f"{srv.url}/health").status_code == 200
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]


def test_completion_token_ids_and_logprobs(served, client, tokenizer):
    _, model, _ = served
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("12+7=", add_special_tokens=False)]
    r = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=1.0,
        logprobs=2,
        seed=5,
        extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
    )
    choice = r.choices[0]
    ids = choice.token_ids
    assert choice.prompt_token_ids == prompt
    assert 1 <= len(ids) <= 6
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    # the logprobs are the model's, token for token
    want = _local_logprobs(model, prompt, ids)
    assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    # top-2 alternatives are the two most likely tokens, best first
    for top in choice.logprobs.top_logprobs:
        assert len(top) == 2
        a, b = list(top.values())
        assert a >= b
    assert r.usage.completion_tokens == len(ids)
    assert r.usage.prompt_tokens == len(prompt)


def test_text_prompt_and_several_prompts(client, tokenizer):
    r = client.completions.create(model="tiny", prompt=["1+1=", "2+2="], max_tokens=3, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.logprobs is None for c in r.choices)
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def test_chat_with_logprobs(served, client, tokenizer):
    _, model, _ = served
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "3+4="}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_token_ids": True},
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    content = choice.logprobs.content
    ids = choice.token_ids
    assert len(content) == len(ids) >= 1
    # no chat template: the prompt is BOS + the message text
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("3+4=", add_special_tokens=False)]
    want = _local_logprobs(model, prompt, ids)
    assert [c.logprob for c in content] == pytest.approx(want, abs=1e-4)
    assert all(len(c.top_logprobs) == 1 for c in content)


def test_wrong_or_missing_api_key_is_refused(served):
    srv, _, _ = served
    bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="1+1=", max_tokens=2)
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": "1"})
    assert r.status_code == 401
    assert "API key" in r.json()["error"]["message"]


def test_malformed_requests_get_clear_4xx(served, client):
    srv, _, _ = served
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="1+1=", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="1+1=", temperature=-2)
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="1+1=")
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny"}, headers=headers)
    assert r.status_code == 400
    assert "prompt: Field required" in r.json()["error"]["message"]
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 99999]}, headers=headers)
    assert r.status_code == 400 and "99999" in r.json()["error"]["message"]
    r = httpx.post(
        f"{srv.url}/v1/completions",
        content=b"{not json",
        headers={**headers, "content-type": "application/json"},
    )
    assert r.status_code == 400
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"messages": []}, headers=headers)
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_concurrent_requests_are_batched(served):
    srv, _, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    before = httpx.get(f"{srv.url}/stats", headers=headers).json()
    barrier = threading.Barrier(8)
    codes = []

    def one():
        barrier.wait()
        r = httpx.post(
            f"{srv.url}/v1/completions",
            json={"prompt": "5+5=", "max_tokens": 8, "temperature": 1.0},
            headers=headers,
            timeout=60,
        )
        codes.append(r.status_code)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = httpx.get(f"{srv.url}/stats", headers=headers).json()
    assert codes == [200] * 8
    assert after["requests"] - before["requests"] == 8
    # 8 requests ran in fewer engine batches than requests: they were batched together
    assert after["batches"] - before["batches"] < 8
    assert after["max_batch_prompts"] >= 2


def test_lora_adapter_load_use_unload(served, client, tokenizer, tmp_path):
    import peft

    srv, model, _root = served
    base = type(model).from_pretrained(srv.model_dir).eval()
    lcfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    pm = peft.get_peft_model(base, lcfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    pm.save_pretrained(tmp_path / "ad")
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(
        f"{srv.url}/v1/load_lora_adapter",
        json={"lora_name": "ad1", "lora_path": str(tmp_path / "ad")},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    again = httpx.post(
        f"{srv.url}/v1/load_lora_adapter",
        json={"lora_name": "ad1", "lora_path": str(tmp_path / "ad")},
        headers=headers,
    )
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "ad1"}

    prompt = [tokenizer.bos_token_id, *tokenizer.encode("8+1=", add_special_tokens=False)]
    extra = {"return_token_ids": True}
    r_ad = client.completions.create(
        model="ad1", prompt=prompt, max_tokens=5, logprobs=0, extra_body=extra
    )
    ids = r_ad.choices[0].token_ids
    adapted = load_adapter_into(type(model).from_pretrained(srv.model_dir), tmp_path / "ad", "a")
    want = _local_logprobs(adapted.eval(), prompt, ids)
    got = r_ad.choices[0].logprobs.token_logprobs
    assert got == pytest.approx(want, abs=1e-4)
    plain = _local_logprobs(model, prompt, ids)
    assert max(abs(a - b) for a, b in zip(got, plain, strict=True)) > 1e-2
    # the base model is still served unchanged next to the adapter
    r_base = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, logprobs=0, extra_body=extra
    )
    ids_b = r_base.choices[0].token_ids
    assert r_base.choices[0].logprobs.token_logprobs == pytest.approx(
        _local_logprobs(model, prompt, ids_b), abs=1e-4
    )

    r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "ad1"}, headers=headers)
    assert r.status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="ad1", prompt=prompt, max_tokens=2)
    r = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "ad1"}, headers=headers)
    assert r.status_code == 404


def test_update_weights_from_disk(served, client, make_tiny_model, tokenizer, tmp_path):
    srv, _model, _root = served
    headers = {"Authorization": f"Bearer {KEY}"}
    other = _sharp_model(make_tiny_model, tokenizer, tmp_path / "other", seed=11)
    r = httpx.post(
        f"{srv.url}/update_weights_from_disk",
        json={"model_path": str(tmp_path / "other"), "weight_version": "7"},
        headers=headers,
    )
    assert r.status_code == 200 and r.json()["success"] is True
    try:
        prompt = [tokenizer.bos_token_id, *tokenizer.encode("6+6=", add_special_tokens=False)]
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=5,
            logprobs=0,
            extra_body={"return_token_ids": True},
        )
        ids = out.choices[0].token_ids
        got = out.choices[0].logprobs.token_logprobs
        assert got == pytest.approx(_local_logprobs(other, prompt, ids), abs=1e-4)
        bad = httpx.post(
            f"{srv.url}/update_weights_from_disk",
            json={"model_path": str(tmp_path / "nowhere")},
            headers=headers,
        )
        assert bad.status_code == 400 and bad.json()["success"] is False
    finally:  # put the module's model back for the other tests
        httpx.post(
            f"{srv.url}/update_weights_from_disk",
            json={"model_path": str(srv.model_dir)},
            headers=headers,
        )


def test_multi_turn_maze_rollout_over_http_is_token_exact(served, tokenizer):
    """Maze episodes through HttpEngine -> gyre serve: the trainer's logprobs of the assembled
    trajectories equal the server's sampled logprobs on every policy token, across turns."""
    from gyre.config import EnvConfig
    from gyre.engines.http_engine import HttpEngine
    from gyre.envs import env_factory
    from gyre.rollout.episodes import run_episodes, stop_ids
    from gyre.trainer.batch import collate, token_logprobs
    from gyre.types import SamplingParams

    srv, model, _ = served
    engine = HttpEngine([srv.url], api_key=KEY, timeout_s=60)
    try:
        params = SamplingParams(1.0, 1.0, 4, stop_ids(tokenizer))
        trajs = run_episodes(env_factory(EnvConfig()), engine, tokenizer, [1, 2], 2, params)
    finally:
        engine.close()
    assert max(t.num_turns for t in trajs) >= 2  # really multi-turn
    batch = collate(trajs, tokenizer.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
    mask = batch.loss_mask.bool()
    assert mask.sum() > 8
    torch.testing.assert_close(logp[mask], batch.rollout_logprobs[mask], atol=1e-4, rtol=0)


def test_sglang_dialect_generate_and_adapters(served, tokenizer, tmp_path):
    """HttpEngine(api="sglang") drives /generate + /load_lora_adapter (SGLang's native shapes,
    as gyre serve implements them): token-exact logprobs, base and adapter."""
    import peft

    from gyre.engines.http_engine import HttpEngine
    from gyre.types import GenerationRequest, SamplingParams

    srv, model, _ = served
    headers = {"Authorization": f"Bearer {KEY}"}
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("4+4=", add_special_tokens=False)]
    raw = httpx.post(
        f"{srv.url}/generate",
        json={
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
            "return_logprob": True,
        },
        headers=headers,
    ).json()
    assert raw["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert [p[1] for p in raw["meta_info"]["output_token_logprobs"]] == raw["output_ids"]

    engine = HttpEngine([srv.url], api_key=KEY, api="sglang", timeout_s=60)
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=5)
        (out,) = engine.generate([GenerationRequest(list(prompt))], params)
        assert len(out.token_ids) == 5
        assert out.logprobs == pytest.approx(
            _local_logprobs(model, prompt, out.token_ids), abs=1e-4
        )
        base = type(model).from_pretrained(srv.model_dir).eval()
        pm = peft.get_peft_model(
            base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.5)
        pm.save_pretrained(tmp_path / "ad")
        assert engine.load_adapter(tmp_path / "ad", 5) == 1
        (out,) = engine.generate([GenerationRequest(list(prompt))], params)
        adapted = load_adapter_into(
            type(model).from_pretrained(srv.model_dir), tmp_path / "ad", "x"
        )
        want = _local_logprobs(adapted.eval(), prompt, out.token_ids)
        assert out.logprobs == pytest.approx(want, abs=1e-4)
    finally:
        engine.close()
        httpx.post(f"{srv.url}/unload_lora_adapter", json={"lora_name": "gyre-v5"}, headers=headers)
    assert httpx.get(f"{srv.url}/stats", headers=headers).json()["adapters"] == {}


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_top_k_reaches_the_server_in_both_dialects(served, tokenizer, api):
    """HttpEngine sends ``top_k`` as vLLM and SGLang take it; gyre serve samples with it: k=1
    is greedy, k=2 draws among the 2 most likely with the truncated distribution's logprobs."""
    from dataclasses import replace

    from gyre.engines.http_engine import HttpEngine
    from gyre.models.sampling import sampling_logprobs
    from gyre.types import GenerationRequest, SamplingParams

    srv, model, _ = served
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("4+4=", add_special_tokens=False)]
    reqs = [GenerationRequest(list(prompt)) for _ in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    engine = HttpEngine([srv.url], api_key=KEY, api=api, timeout_s=60)
    try:
        greedy = engine.generate(reqs[:1], replace(params, temperature=0.0))[0].token_ids
        assert all(o.token_ids == greedy for o in engine.generate(reqs, replace(params, top_k=1)))
        outs = engine.generate(reqs, replace(params, top_k=2))
    finally:
        engine.close()
    for out in outs:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out.token_ids])).logits[0]
        steps = logits[len(prompt) - 1 : -1]
        logp = sampling_logprobs(steps, 1.0, 1.0, top_k=2)
        for t, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert tok in steps[t].topk(2).indices.tolist()
            assert lp == pytest.approx(logp[t, tok].item(), abs=1e-4)


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_engines_sleep_for_the_update_and_wake_for_rollout(served, api):
    """The hand-over of a colocated pool through the servers' own endpoints (vLLM's /sleep and
    /wake_up, SGLang's release/resume_memory_occupation), driven by gyre's HTTP client: asleep,
    generation is refused with a 503 naming /wake_up; awake, it answers again; the key is
    required."""
    from gyre.engines.handover import sleep_engines, wake_engines
    from gyre.engines.http_engine import HttpEngine

    srv, _, _ = served
    engine = HttpEngine([srv.url], api_key=KEY, model="tiny", api=api)
    try:
        m = sleep_engines(engine)
        assert m["handover/engine_sleep_s"] >= 0 and m["handover/engine_freed_bytes"] == 0  # CPU
        head = {"Authorization": f"Bearer {KEY}"}
        assert httpx.get(f"{srv.url}/is_sleeping", headers=head).json()["is_sleeping"] is True
        r = httpx.post(f"{srv.url}/v1/completions", headers=head,
                       json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 503 and "POST /wake_up" in r.json()["error"]["message"]
        assert httpx.post(f"{srv.url}/wake_up").status_code == 401  # no key
        m = wake_engines(engine)
        assert m["handover/engine_wake_s"] >= 0
        assert httpx.get(f"{srv.url}/is_sleeping", headers=head).json()["is_sleeping"] is False
        r = httpx.post(f"{srv.url}/v1/completions", headers=head,
                       json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})  # fmt: skip
        assert r.status_code == 200
        bad = httpx.post(f"{srv.url}/sleep?level=3", headers=head)
        assert bad.status_code == 400 and "level=3" in bad.text
    finally:
        wake_engines(engine)
        engine.close()
