"""The official ``tinker`` SDK, unmodified, against ``gyre tinker-serve`` on a tiny model."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from tinker_helpers import sl_data, start_in_process  # noqa: E402

KEY = "tml-local-test"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # a small micro-batch budget: the SL datums run as several forward/backward chunks
    local = start_in_process(tmp_path_factory.mktemp("tinker-state"), train_micro_tokens=16)
    yield local
    local.stop()


@pytest.fixture(scope="module")
def client(served):
    sc = tinker.ServiceClient(base_url=served.url, api_key=KEY)
    yield sc
    sc.close("success").result()


def _base(client) -> str:
    return client.get_server_capabilities().supported_models[0].model_name


def _steps(tc, data, n: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(n):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def _logprobs(tc, data) -> list[np.ndarray]:
    out = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    return [np.asarray(o["logprobs"].data) for o in out]


def test_sl_loop_loss_falls_and_sampler_sees_the_adapter(client):
    tc = client.create_lora_training_client(base_model=_base(client), rank=8, seed=1).result()
    tok = tc.get_tokenizer()
    data = sl_data(tok)
    losses = _steps(tc, data, 10)
    assert losses[-1] < 0.5 * losses[0], losses
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tok.encode("2+2=", add_special_tokens=False))
    res = sampler.sample(
        prompt,
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=3),
        include_prompt_logprobs=True,
    ).result()
    assert len(res.sequences) == 3 and all(len(s.tokens) <= 3 for s in res.sequences)
    assert all(len(s.logprobs) == len(s.tokens) for s in res.sequences)
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == prompt.length
    # the sampler's prompt logprobs are the trained model's: equal to a forward on the same ids
    ids = prompt.to_ints()
    fwd = tc.forward(
        [
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:]},
            )
        ],
        "cross_entropy",
    ).result()
    np.testing.assert_allclose(
        res.prompt_logprobs[1:], fwd.loss_fn_outputs[0]["logprobs"].data, rtol=1e-5, atol=1e-5
    )


def test_rl_loop_learns_to_answer_with_a_digit(client):
    """sample -> reward (1 for a digit) -> importance_sampling -> optim_step."""
    tc = client.create_lora_training_client(base_model=_base(client), rank=8, seed=2).result()
    tok = tc.get_tokenizer()
    prompt = tok.encode("n=", add_special_tokens=False)
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    rates = []
    for step in range(12):
        sampler = tc.save_weights_and_get_sampling_client().result()
        res = sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=32,
            sampling_params=types.SamplingParams(max_tokens=1, seed=step),
        ).result()
        rewards = np.array([float(s.tokens[0] in digits) for s in res.sequences])
        rates.append(rewards.mean())
        adv = rewards - rewards.mean()
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(prompt),
                loss_fn_inputs={
                    "target_tokens": prompt[1:] + s.tokens,
                    "logprobs": [0.0] * (len(prompt) - 1) + list(s.logprobs),
                    "advantages": [0.0] * (len(prompt) - 1) + [float(a)],
                },
            )
            for s, a in zip(res.sequences, adv, strict=True)
        ]
        tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert np.mean(rates[-3:]) > np.mean(rates[:3]) + 0.3, rates


def test_save_load_state_resumes_bit_exactly(client):
    base = _base(client)
    a = client.create_lora_training_client(base_model=base, rank=4, seed=3).result()
    data = sl_data(a.get_tokenizer())
    _steps(a, data, 2)
    path = a.save_state("after-2").result().path
    tail_a = _steps(a, data, 2)
    b = client.create_training_client_from_state_with_optimizer(path).result()
    tail_b = _steps(b, data, 2)
    assert tail_a == tail_b  # the same float losses, step for step
    for x, y in zip(_logprobs(a, data), _logprobs(b, data), strict=True):
        assert np.array_equal(x, y)
    listed = client.create_rest_client().list_checkpoints(a.model_id).result()
    assert path in [c.tinker_path for c in listed.checkpoints]
    # weights only (no optimizer state): a different continuation
    c = client.create_training_client_from_state(path).result()
    assert _steps(c, data, 2) != tail_a
    rest = client.create_rest_client()
    assert rest.get_weights_info_by_tinker_path(path).result().lora_rank == 4
    rest.delete_checkpoint_from_tinker_path(path).result()
    after = rest.list_checkpoints(a.model_id).result().checkpoints
    assert path not in [ck.tinker_path for ck in after]


def test_two_tenants_train_at_once_isolated(client):
    base = _base(client)
    alone = client.create_lora_training_client(base_model=base, rank=4, seed=5).result()
    tok = alone.get_tokenizer()
    data = sl_data(tok)
    other = [
        types.Datum(
            model_input=types.ModelInput.from_ints(tok.encode("zzzz")[:-1]),
            loss_fn_inputs={"target_tokens": tok.encode("zzzz")[1:]},
        )
    ]
    ref = _steps(alone, data, 3)
    a = client.create_lora_training_client(base_model=base, rank=4, seed=5).result()
    b = client.create_lora_training_client(base_model=base, rank=8, seed=6).result()
    got = []
    for _ in range(3):  # interleaved: a's and b's requests alternate on the server
        fa = a.forward_backward(data, "cross_entropy")
        fb = b.forward_backward(other, "cross_entropy")
        oa = a.optim_step(types.AdamParams(learning_rate=1e-2))
        ob = b.optim_step(types.AdamParams(learning_rate=5e-2))
        got.append(fa.result().metrics["loss:sum"])
        fb.result(), oa.result(), ob.result()
    assert got == ref  # b's adapter and optimizer never touched a's
    for x, y in zip(_logprobs(a, data), _logprobs(alone, data), strict=True):
        assert np.array_equal(x, y)


def test_bad_requests_name_the_field_and_the_server_survives(served, client):
    h = {"X-API-Key": KEY}
    r = httpx.post(
        f"{served.url}/api/v1/forward_backward",
        content=b"\xff\x00junk",
        headers={**h, "Content-Type": "application/x-protobuf"},
    )
    assert r.status_code == 400 and "body" in r.json()["detail"]
    r = httpx.post(
        f"{served.url}/api/v1/create_model",
        json={"session_id": "nope", "model_seq_id": 0, "base_model": "x"},
        headers=h,
    )
    assert r.status_code in (400, 404) and "session_id" in r.json()["detail"]
    r = httpx.post(f"{served.url}/api/v1/retrieve_future", json={"request_id": "x"}, headers=h)
    assert r.status_code == 404 and "request_id" in r.json()["detail"]
    base = _base(client)
    with pytest.raises(Exception, match="base_model"):
        client.create_lora_training_client(base_model="no/such-model", rank=4).result()
    tc = client.create_lora_training_client(base_model=base, rank=4).result()
    bad = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 10**6]},
        )
    ]
    with pytest.raises(tinker.RequestFailedError, match=r"target_tokens"):
        tc.forward_backward(bad, "cross_entropy").result()
    tc2 = client.create_lora_training_client(base_model=base, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match=r"advantages"):
        tc2.forward_backward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints([5, 6]),
                    loss_fn_inputs={"target_tokens": [6, 7], "logprobs": [0.0, 0.0]},
                )
            ],
            "ppo",
        ).result()
    # a client that vanishes mid-future: submit, then drop the connection mid long-poll
    sess = httpx.post(
        f"{served.url}/api/v1/create_session",
        headers=h,
        json={"tags": [], "user_metadata": None, "sdk_version": "x"},
    ).json()
    rid = httpx.post(
        f"{served.url}/api/v1/asample",
        headers=h,
        json={
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
            "sampling_params": {"max_tokens": 16},
            "base_model": base,
            "num_samples": 2,
        },
    ).json()["request_id"]
    # the client gives up after 50 ms, mid-future (a server that already finished answers
    # instead): either way the server must go on serving, which the calls below check
    with contextlib.suppress(httpx.TimeoutException):
        httpx.post(
            f"{served.url}/api/v1/retrieve_future",
            headers=h,
            json={"request_id": rid},
            timeout=0.05,
        )
    # ... and the abandoned work is not lost: asking again later gets the finished samples
    for _ in range(60):
        r = httpx.post(
            f"{served.url}/api/v1/retrieve_future", headers=h, json={"request_id": rid}, timeout=30
        )
        if "protobuf" in r.headers.get("content-type", ""):
            break
        assert r.json().get("type") == "try_again", r.text
    from tinker.proto.response_conv import deserialize_sample_response

    assert len(deserialize_sample_response(r.content).sequences) == 2
    assert sess["session_id"]
    assert (
        len(
            _steps(
                client.create_lora_training_client(base_model=base, rank=4).result(),
                sl_data(tc.get_tokenizer()),
                1,
            )
        )
        == 1
    )


def _kill_9(proc: subprocess.Popen) -> None:
    """SIGKILL to the server's process group (the server and the Ray it started, as when its
    machine or container dies)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 9)
    proc.wait(timeout=30)


@pytest.mark.slow  # two server start-ups in subprocesses: ~80 s on 2 busy cores
@pytest.mark.parametrize("runner", ["local", "ray"])
def test_kill_9_then_load_state_loses_nothing_acknowledged(tmp_path, runner):
    """A save the client saw acknowledged survives SIGKILL of the server; with ``runner=ray``
    the server (the real CLI) starts its own local Ray with the trainer and a sampler as
    actors, and the restarted server's new actors load the state."""
    from serve_helpers import free_port

    port, state = free_port(), tmp_path / "state"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}
    cmd = [
        sys.executable,
        "-m",
        "gyre.cli",
        "tinker-serve",
        "--port",
        str(port),
        f"state_dir={state}",
        "long_poll_s=2",
    ]
    if runner == "ray":
        cmd += ["runner=ray", "ray.num_cpus=2"]
    url = f"http://127.0.0.1:{port}"

    def up() -> subprocess.Popen:
        out = subprocess.DEVNULL  # its own process group: the Ray it started dies with it
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/api/v1/healthz", timeout=1).status_code == 200:
                    return proc
            except httpx.TransportError:
                time.sleep(0.2)
        _kill_9(proc)
        raise RuntimeError("server did not start")

    proc = up()
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=_base(sc), rank=4, seed=7).result()
        data = sl_data(tc.get_tokenizer())
        _steps(tc, data, 2)
        path = tc.save_state("acked").result().path
        sampler_path = tc.save_weights_for_sampler("acked-sampler").result().path
        prompt = data[0].model_input
        seen = sc.create_sampling_client(model_path=sampler_path).compute_logprobs(prompt).result()
        before = _logprobs(tc, data)
        tail = _steps(tc, data, 2)  # what training would have done next
        tc.load_state_with_optimizer(path).result()
        tc.forward_backward(data, "cross_entropy")  # in flight when the server dies
        _kill_9(proc)
        proc = up()
        sc2 = tinker.ServiceClient(base_url=url, api_key=KEY)
        back = sc2.create_training_client_from_state_with_optimizer(path).result()
        for x, y in zip(before, _logprobs(back, data), strict=True):
            assert np.array_equal(x, y)
        assert _steps(back, data, 2) == tail  # the optimizer state came back too
        again = sc2.create_sampling_client(model_path=sampler_path)
        assert again.compute_logprobs(prompt).result() == seen
        sc2.close("success").result()
    finally:
        _kill_9(proc)


@pytest.mark.slow  # SmolLM2-135M-Instruct on the CPU: a few minutes
def test_smollm2_sl_and_sampling(tmp_path):
    """The real pretrained model: LoRA SL on chat examples lowers the loss; sampling works."""
    real_model = pytest.importorskip("real_model")
    local = start_in_process(tmp_path / "state", model_path=str(real_model.smollm2_dir()))
    try:
        sc = tinker.ServiceClient(base_url=local.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=_base(sc), rank=8, seed=0).result()
        tok = tc.get_tokenizer()
        pairs = [("What is 2+2?", "4"), ("Capital of France?", "Paris"), ("Say hi.", "hi")]
        data = []
        for q, a in pairs:
            text = tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            )
            prompt = tok.encode(text, add_special_tokens=False)
            full = prompt + tok.encode(a + "<|im_end|>", add_special_tokens=False)
            w = [0.0] * (len(prompt) - 1) + [1.0] * (len(full) - len(prompt))
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": w},
                )
            )
        losses = _steps(tc, data, 6, lr=1e-3)
        assert losses[-1] < 0.5 * losses[0], losses
        sampler = tc.save_weights_and_get_sampling_client().result()
        res = sampler.sample(
            data[0].model_input, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8)
        ).result()
        assert all(0 < len(s.tokens) <= 8 for s in res.sequences)
        sc.close("success").result()
    finally:
        local.stop()


def test_api_key_is_required_when_configured(served):
    from fastapi.testclient import TestClient

    from gyre.tinker.server import create_app

    app = TestClient(create_app(served.service, api_key="tml-secret"))
    caps = "/api/v1/get_server_capabilities"
    assert app.get("/api/v1/healthz").status_code == 200  # probes need no key
    r = app.get(caps)
    assert r.status_code == 401 and "API key" in r.json()["detail"]
    assert app.get(caps, headers={"X-API-Key": "tml-wrong"}).status_code == 401
    assert app.get(caps, headers={"X-API-Key": "tml-secret"}).status_code == 200
    assert app.get(caps, headers={"Authorization": "Bearer tml-secret"}).status_code == 200
