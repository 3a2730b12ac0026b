"""Image episodes over HTTP: ``HttpEngine`` (``engine.api=sglang``: ids + ``image_data``) against a
``gyre serve`` process on the tiny Qwen2.5-VL samples what the in-process engine samples, turn
for turn; ``gyre train engine.kind=http`` on the coloured-square env syncs full VLM weights to
the server and scores the server's samples exactly.

One server for the module: the training test (last) changes its weights.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from gyre.config import load_config
from gyre.engines.http_engine import HttpEngine
from gyre.engines.torch_engine import TorchEngine
from gyre.models.vision import load_vlm, vision_of
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.episodes import run_episodes
from gyre.runners import train
from gyre.types import SamplingParams
from serve_helpers import start_server
from vision_helpers import ColourEnv, tiny_vlm

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    folder = tiny_vlm("qwen2_5_vl", tmp_path_factory.getbasetemp() / "vlms")
    srv = start_server(folder, tmp_path_factory.mktemp("serve"))
    try:
        yield srv, folder
    finally:
        srv.stop()


def _episodes(engine, tok, turns=3):
    tpl = ChatTemplate(tok)
    params = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=tpl.stop_ids())
    return run_episodes(lambda: ColourEnv(turns=turns), engine, tok, [0, 1, 2], 1, params,
                        chat=ChatMode(tpl))  # fmt: skip


def test_http_engine_matches_the_in_process_engine_on_visual_turns(vlm_server):
    srv, folder = vlm_server
    model, tok = load_vlm(folder, CPU)
    local = _episodes(TorchEngine(model.eval(), tok.pad_token_id, vision=vision_of(tok)), tok)
    engine = HttpEngine([srv.url], api="sglang", timeout_s=60)
    try:
        remote = _episodes(engine, tok)
    finally:
        engine.close()
    assert max(t.num_turns for t in local) == 3  # multi-turn: each later turn sends 2-3 images
    for a, b in zip(local, remote, strict=True):
        assert b.token_ids == a.token_ids and b.loss_mask == a.loss_mask
        assert len(b.images) == a.num_turns == b.num_turns
        assert np.allclose(b.rollout_logprobs, a.rollout_logprobs, atol=1e-4)
        assert b.reward == a.reward
    assert engine.stats["requests"] == sum(t.num_turns for t in local)


def _train_over_http(url: str, folder, tmp_path, *extra: str) -> list[dict]:
    run_dir = tmp_path / "run"
    cfg = load_config(None, [
        "run.threads=1", "log.console=off", "sft.steps=0", "train.steps=3",
        "train.tasks_per_step=2", "train.group_size=4", "train.lr=0.05", "train.mini_batches=1",
        "train.kl_coef=0", "train.sampling.max_new_tokens=6", "eval.episodes=2",
        "checkpoint.every=0", "env.name=vision_helpers:ColourEnv", "env.kwargs.turns=2",
        f"model.path={folder}", f"run.dir={run_dir}", "engine.kind=http", "engine.api=sglang",
        f'engine.urls=["{url}"]', f"engine.sync_dir={tmp_path / 'sync'}",
        "engine.timeout_s=60",
        "train.algo.skip_zero_advantage=false",  # unseeded samples may tie: score every row
        *extra,
    ])  # fmt: skip
    train(cfg)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # a later step sampled from changed weights: not vacuous (HTTP rollouts are unseeded, so a
    # step's groups may all tie; 3 steps x 2 groups of 4 make a signal all but certain)
    assert any(r["train/grad_norm"] > 0 for r in steps[:-1])
    for r in steps:
        assert r["sync/acks"] == 1.0 and r["policy_version"] == r["step"]
        assert r["train/rollout_logprob_gap"] < 1e-4, r
    return steps


def test_gyre_train_over_http_on_an_image_env(vlm_server, tmp_path):
    """3 GRPO steps, full-weight sync (update_weights_from_disk of a VLM folder): the trainer's
    log-probs of the server's samples equal the server's, so it sampled from the synced policy
    with the same pixels and placeholder runs. (A server that ignored the sync failed this:
    gap 0.56 at step 2.)"""
    srv, folder = vlm_server
    steps = _train_over_http(srv.url, folder, tmp_path)
    assert max(r["train/rollout_logprob_gap"] for r in steps) < 1e-4


@pytest.mark.slow
def test_lora_training_over_http_on_an_image_env(tmp_path):
    """The same with a LoRA adapter (on the language model only) loaded by the server each step;
    its own server, since the full-weight test changes the module's."""
    folder = tiny_vlm("qwen2_5_vl", tmp_path / "vlms")
    srv = start_server(folder, tmp_path)
    try:
        steps = _train_over_http(srv.url, folder, tmp_path, "model.lora={rank: 4, alpha: 8}")
        assert max(r["train/rollout_logprob_gap"] for r in steps) < 1e-4
    finally:
        srv.stop()
