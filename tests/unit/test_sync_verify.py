"""Sync verification: every engine must serve the policy it was synced to, or the run stops.

The servers are real ``gyre serve`` apps (uvicorn in a thread, real sockets); the faults come
from :class:`fault_servers.LyingProxy`, which acknowledges a sync without applying it.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fault_servers import LyingProxy, ThreadServer
from gyre.checkpoint.store import write_model_dir
from gyre.config import EngineConfig, LoraConfig
from gyre.engines.http_engine import HttpEngine
from gyre.engines.sync import WeightSync
from gyre.engines.torch_engine import TorchEngine
from gyre.engines.verify import (
    SyncNotApplied,
    check_rollout_gap,
    model_prompt_logprobs,
    openai_probe_body,
    parse_openai_prompt_logprobs,
    parse_sglang_prompt_logprobs,
    probe_ids,
    sglang_probe_body,
)
from gyre.models.lora import apply_lora
from gyre.types import Trajectory


def _step(model: torch.nn.Module, seed: int, size: float = 0.05) -> None:
    """A stand-in for an optimizer step: every trainable weight moves a little."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * size)


@pytest.fixture(scope="module")
def served(tmp_path_factory, make_tiny_model, tokenizer):
    """Two in-process ``gyre serve`` apps on the same tiny model folder."""
    root = tmp_path_factory.mktemp("verify")
    base = write_model_dir(root / "base", make_tiny_model(seed=1, sharp=True), tokenizer)
    servers = [ThreadServer(base), ThreadServer(base)]
    yield base, servers
    for s in servers:
        s.stop()


def _policy(base):
    """The trainer's copy of the served model (trainable: loading an adapter into a server's
    model freezes its base weights in place)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base).eval()


def _reset(servers, base) -> None:
    """Every server back on the base weights, no adapters."""
    for s in servers:
        for name in list(s.host.adapters):
            s.host.unload_lora(name)
        s.host.update_weights(str(base), None)


def _syncer(urls, tokenizer, tmp_path, lora=False, api="openai"):
    cfg = EngineConfig(kind="http", urls=urls, api=api, timeout_s=20, health_interval_s=0.2)
    engine = HttpEngine(urls, timeout_s=20, health_interval_s=0.2, api=api, model="tiny")
    return engine, WeightSync(cfg, engine, tokenizer, tmp_path / "sync", lora=lora)


def test_probe_protocols_parse_the_real_shapes():
    ids = [5, 9, 7]
    body = openai_probe_body(ids, "m")
    assert body["prompt_logprobs"] == 0 and body["prompt"] == ids and body["max_tokens"] == 1
    vllm = {"choices": [{"prompt_logprobs": [
        None,
        {"9": {"logprob": -1.5, "rank": 2, "decoded_token": "a"},
         "3": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}},
        {"7": {"logprob": -2.0, "rank": 4, "decoded_token": "c"}},
    ]}]}  # fmt: skip
    assert parse_openai_prompt_logprobs(vllm, ids) == [-1.5, -2.0]
    body = sglang_probe_body(ids, "gyre-v3")
    assert body["logprob_start_len"] == 0 and body["return_logprob"] and body["lora_path"]
    sglang = {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.5, 9, None],
                                                     [-2.0, 7, None]]}}  # fmt: skip
    assert parse_sglang_prompt_logprobs(sglang, ids) == [-1.5, -2.0]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        parse_openai_prompt_logprobs({"choices": [{"text": ""}]}, ids)
    with pytest.raises(ValueError, match="names token 8"):
        parse_sglang_prompt_logprobs({"meta_info": {"input_token_logprobs": [
            [None, 5, None], [-1.5, 8, None], [-2.0, 7, None]]}}, ids)  # fmt: skip


def test_gyre_serve_answers_prompt_logprobs_in_both_protocols(served, tokenizer):
    import httpx

    base, servers = served
    _reset(servers, base)
    model = servers[0].host.engine.model
    ids = probe_ids(tokenizer, len(tokenizer), 12, seed=0)
    want = model_prompt_logprobs(model, ids)
    url = servers[0].url
    r = httpx.post(f"{url}/v1/completions", json={**openai_probe_body(ids, "tiny"),
                                                  "prompt_logprobs": 2})  # fmt: skip
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    assert 1 <= len(entries[1]) <= 3  # the prompt token + the 2 best
    assert all(e[str(t)]["rank"] >= 1 for e, t in zip(entries[1:], ids[1:], strict=True))
    torch.testing.assert_close(parse_openai_prompt_logprobs(r.json(), ids), want)
    r = httpx.post(f"{url}/generate", json=sglang_probe_body(ids, None))
    torch.testing.assert_close(parse_sglang_prompt_logprobs(r.json(), ids), want)
    r = httpx.post(f"{url}/generate", json={**sglang_probe_body(ids, None), "logprob_start_len": 3})
    assert len(r.json()["meta_info"]["input_token_logprobs"]) == len(ids) - 3


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_an_applied_full_sync_verifies(served, tokenizer, tmp_path, api):
    base, servers = served
    _reset(servers, base)
    policy = _policy(base)
    engine, sync = _syncer([s.url for s in servers], tokenizer, tmp_path, api=api)
    try:
        sync.remember(policy, 0)
        _step(policy, seed=1)
        m = sync.sync(policy, 1)
        assert m["sync/verified_engines"] == 2
        assert m["sync/verify_gap"] < 1e-4
    finally:
        engine.close()


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_a_full_sync_acknowledged_and_not_applied_stops_the_run(served, tokenizer, tmp_path, api):
    base, servers = served
    _reset(servers, base)
    proxy = LyingProxy(servers[0].url, "weights")
    policy = _policy(base)
    engine, sync = _syncer([proxy.url], tokenizer, tmp_path, api=api)
    try:
        sync.remember(policy, 0)
        _step(policy, seed=1)
        with pytest.raises(SyncNotApplied) as err:
            sync.sync(policy, 1)
        assert proxy.counts["/update_weights_from_disk"] == 1  # acknowledged, never forwarded
        msg = str(err.value)
        assert f"engine {proxy.url}" in msg and "policy version 1" in msg
        assert "nats/token" in msg and "\n" not in msg
    finally:
        engine.close()
        proxy.stop()


def test_a_small_step_not_applied_is_caught_below_the_tolerance(served, tokenizer, tmp_path):
    """A step that moves the policy less than engine.verify_tolerance: the engine is still
    twice as close to the previous version, so it is caught all the same."""
    base, servers = served
    _reset(servers, base)
    proxy = LyingProxy(servers[0].url, "weights")
    policy = _policy(base)
    engine, sync = _syncer([proxy.url], tokenizer, tmp_path)
    try:
        sync.remember(policy, 0)
        _step(policy, seed=1, size=0.0006)
        with pytest.raises(SyncNotApplied, match="previous version 0: not applied"):
            sync.sync(policy, 1)
        assert sync.verifier is not None
    finally:
        engine.close()
        proxy.stop()


@pytest.mark.parametrize("api", ["openai", "sglang"])
def test_an_adapter_acknowledged_but_sampling_the_base_is_caught(served, tokenizer, tmp_path, api):
    base, servers = served
    _reset(servers, base)
    proxy = LyingProxy(servers[0].url, "lora")
    policy = apply_lora(_policy(base), LoraConfig(rank=4))
    engine, sync = _syncer([proxy.url], tokenizer, tmp_path, lora=True, api=api)
    try:
        sync.remember(policy, 0)
        _step(policy, seed=2, size=0.2)  # the adapter's weights only (the base is frozen)
        with pytest.raises(SyncNotApplied, match="policy version 1"):
            sync.sync(policy, 1)
        assert engine.model_name == "gyre-v1" and "gyre-v1" in proxy.faked
        assert not servers[0].host.adapters  # never reached the server
    finally:
        engine.close()
        proxy.stop()


def test_an_honest_adapter_sync_verifies(served, tokenizer, tmp_path):
    base, servers = served
    _reset(servers, base)
    proxy = LyingProxy(servers[0].url, "honest")
    policy = apply_lora(_policy(base), LoraConfig(rank=4))
    engine, sync = _syncer([proxy.url], tokenizer, tmp_path, lora=True)
    try:
        sync.remember(policy, 0)
        for v in (1, 2):
            _step(policy, seed=v, size=0.2)
            assert sync.sync(policy, v)["sync/verify_gap"] < 1e-4
        assert list(servers[0].host.adapters) == ["gyre-v2"]
    finally:
        engine.close()
        proxy.stop()


def test_a_sync_applied_on_one_engine_of_two_names_the_other(served, tokenizer, tmp_path):
    base, servers = served
    _reset(servers, base)
    proxy = LyingProxy(servers[1].url, "weights")
    policy = _policy(base)
    engine, sync = _syncer([servers[0].url, proxy.url], tokenizer, tmp_path)
    try:
        sync.remember(policy, 0)
        _step(policy, seed=3)
        with pytest.raises(SyncNotApplied) as err:
            sync.sync(policy, 1)
        assert f"engine {proxy.url} " in str(err.value)
        assert servers[0].url not in str(err.value)
    finally:
        engine.close()
        proxy.stop()


def test_in_process_engines_are_verified_and_verify_every_bounds_the_checks(
    make_tiny_model, tokenizer, tmp_path
):
    policy = make_tiny_model(seed=0)
    engine = TorchEngine(copy.deepcopy(policy), tokenizer.pad_token_id)
    sync = WeightSync(EngineConfig(verify_every=2), engine, tokenizer, tmp_path, lora=False)
    sync.remember(policy, 0)
    _step(policy, seed=1)
    assert "sync/verify_gap" not in sync.sync(policy, 1)  # the 1st sync: not due
    _step(policy, seed=2)
    assert sync.sync(policy, 2)["sync/verify_gap"] < 1e-4
    engine.load_weights = lambda state, version: setattr(engine, "version", version)  # a no-op
    _step(policy, seed=3)
    sync.sync(policy, 3)
    _step(policy, seed=4)
    with pytest.raises(SyncNotApplied, match="in-process engine"):
        sync.sync(policy, 4)


def _traj(version: int, **info) -> Trajectory:
    return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], rollout_logprobs=[0.0, 0.0],
                      reward=0.0, group_id=0, policy_version=version, num_turns=1, success=False,
                      task_seed=0, info=dict(info))  # fmt: skip


def test_the_rollout_gap_guard_acts_on_on_policy_steps_only():
    m = {"train/rollout_logprob_gap": 0.4}
    with pytest.raises(SyncNotApplied, match=r"rollout_logprob_gap 0\.4 .*version 2"):
        check_rollout_gap(0.15, m, [_traj(2), _traj(2)], step=3)
    check_rollout_gap(0.15, m, [_traj(1), _traj(2)], step=3)  # a lagged sample: skipped
    check_rollout_gap(0.15, m, [_traj(2, greedy=True)], step=3)
    check_rollout_gap(0.15, {**m, "rollout/retried_turn_frac": 0.1}, [_traj(2)], step=3)
    check_rollout_gap(0.0, m, [_traj(2)], step=3)  # off
    check_rollout_gap(0.5, m, [_traj(2)], step=3)


def test_a_server_that_comes_back_serving_another_policy_stays_out(served, tokenizer, tmp_path):
    """A server restarted on its old weights whose reload is acknowledged and not applied is
    kept out of rotation by the put-back check; once the reload works it is put back."""
    import time

    base, servers = served
    _reset(servers, base)
    proxy = LyingProxy(servers[0].url, "honest")
    policy = _policy(base)
    engine, sync = _syncer([proxy.url, servers[1].url], tokenizer, tmp_path)
    try:
        sync.remember(policy, 0)
        _step(policy, seed=5)
        sync.sync(policy, 1)
        proxy.mode = "weights"
        servers[0].host.update_weights(str(base), None)  # a restart: back on the base weights
        engine.pool.take_out(engine.servers[0], "restarted")
        deadline = time.monotonic() + 10
        while "came back serving" not in engine.servers[0].last_error:
            assert time.monotonic() < deadline, engine.servers[0].last_error
            time.sleep(0.1)
        assert not engine.servers[0].alive
        proxy.mode = "honest"
        while not engine.servers[0].alive:
            assert time.monotonic() < deadline + 10
            time.sleep(0.1)
        assert sync.sync(policy, 1)["sync/verify_gap"] < 1e-4
    finally:
        engine.close()
        proxy.stop()
