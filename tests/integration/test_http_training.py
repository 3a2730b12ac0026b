"""LoRA GRPO with rollouts from ``gyre serve`` processes over HTTP, adapters synced through a
shared directory; recovery from a killed server; export of the trained policy.

Every run: arithmetic with answers 0..4, a 2-layer 32-wide model warm-started by a short SFT (so
rewards are sparse but not all zero), rank-4 LoRA, one thread.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from gyre.cli import main
from gyre.commands.export import export_run
from gyre.config import load_config
from gyre.engines.http_engine import HttpEngine
from gyre.models.lora import load_adapter_into
from gyre.runners import train
from gyre.telemetry import MetricsSink
from gyre.types import GenerationRequest, SamplingParams
from serve_helpers import start_server

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "log.console=off",
    "run.threads=1",
    "env.name=arithmetic",
    "env.arithmetic.max_operand=2",
    "env.arithmetic.ops=+",
]
GRPO = [
    "sft.steps=0",
    "train.tasks_per_step=8",
    "train.group_size=4",
    "train.lr=0.05",
    "train.mini_batches=1",
    "train.kl_coef=0.01",
    "train.algo.skip_zero_advantage=false",  # unseeded samples may tie: score every row
    "train.sampling.max_new_tokens=4",
    "eval.episodes=4",
    "eval.every=0",
    "checkpoint.every=0",
    "model.lora={rank: 4, alpha: 8}",
    "engine.kind=http",
    "engine.health_interval_s=0.2",
    "engine.timeout_s=60",
    "engine.sync_keep=2",
]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("sft") / "run"
    sft = ["sft.steps=5", "sft.demos=20", "sft.batch_size=8", "sft.lr=0.02"]
    sft += ["sft.warmup_steps=0", "sft.noise=0.25"]
    assert main(["sft", *TINY, *sft, f"run.dir={run}"]) == 0
    return run / "sft"


@pytest.fixture(scope="module")
def http_run(sft_dir, tmp_path_factory):
    """4 LoRA GRPO steps whose rollouts all come from one ``gyre serve`` process.

    HTTP rollouts are not seeded (the servers own the RNG), so 8 tasks x 4 samples a step keep
    the chance that no step before the last has a learning signal below 1e-3.
    """
    root = tmp_path_factory.mktemp("http")
    srv = start_server(sft_dir, root)
    shared = root / "shared"
    run_dir = root / "run"
    cfg = load_config(
        None,
        [
            *TINY,
            *GRPO,
            f"model.path={sft_dir}",
            f"run.dir={run_dir}",
            "train.steps=4",
            f'engine.urls=["{srv.url}"]',
            f"engine.sync_dir={shared}",
        ],
    )
    try:
        train(cfg)
        yield srv, run_dir, shared
    finally:
        srv.stop()


def _local_logprobs(model, prompt, ids):
    x = torch.tensor([prompt + ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
    return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(ids)]


def test_lora_grpo_over_http_syncs_adapters(http_run, sft_dir, tokenizer):
    srv, run_dir, shared = http_run
    train_recs = [r for r in _records(run_dir) if "train/loss" in r]
    assert [r["step"] for r in train_recs] == [1, 2, 3, 4]
    assert any(r["train/grad_norm"] > 0 for r in train_recs[:3]), "no learning: vacuous"
    for r in train_recs:
        assert r["sync/bytes"] > 0 and r["sync/acks"] == 1.0
        assert r["policy_version"] == r["step"]
        # mini_batches=1: the trainer scores the rollout before updating, so its logprobs and
        # the server's agree only if the server sampled from the adapter of the previous step
        assert r["train/logprob_gap"] < 1e-4, r
    # old versions cleaned up, the last sync_keep=2 kept, each in peft format
    assert sorted(p.name for p in shared.iterdir()) == ["v3", "v4"]
    assert {p.name for p in (shared / "v4").iterdir()} >= {
        "adapter_model.safetensors",
        "adapter_config.json",
    }
    # the server holds exactly the newest adapter
    models = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert sorted(m["id"] for m in models) == ["gyre-v4", "tiny"]

    # After the last sync the server samples from the new adapter: its logprobs are those of
    # base + final adapter and differ from the base model's.
    base = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32).eval()
    policy = load_adapter_into(
        AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32), run_dir / "final", "p"
    ).eval()
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("1+2=", add_special_tokens=False)]
    body = {"prompt": prompt, "max_tokens": 4, "logprobs": 0, "return_token_ids": True}
    got_ids, got_lp = [], []
    for seed in range(4):
        out = httpx.post(
            f"{srv.url}/v1/completions", json={**body, "model": "gyre-v4", "seed": seed}
        ).json()["choices"][0]
        got_ids.append(out["token_ids"])
        got_lp.append(out["logprobs"]["token_logprobs"])
    diffs = []
    for ids, lps in zip(got_ids, got_lp, strict=True):
        assert lps == pytest.approx(_local_logprobs(policy, prompt, ids), abs=1e-4)
        diffs += [abs(a - b) for a, b in zip(lps, _local_logprobs(base, prompt, ids), strict=True)]
    assert max(diffs) > 1e-3


def test_export_gives_the_trained_policys_logits(http_run, sft_dir, tmp_path):
    _, run_dir, _ = http_run
    out = export_run(run_dir, tmp_path / "exported")
    assert not (out / "adapter_config.json").exists()
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    policy = load_adapter_into(
        AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32), run_dir / "final", "p"
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32).eval()
    x = torch.randint(4, 60, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = exported(input_ids=x).logits, policy(input_ids=x).logits, base(input_ids=x).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (a - c).abs().max() > 1e-3  # the adapter is in there
    # the CLI writes the same folder
    assert main(["export", str(run_dir), "--out", str(tmp_path / "cli")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "cli", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=x).logits, a)


class _KillAfterFirstStep(MetricsSink):
    def __init__(self, victim) -> None:
        self.victim = victim
        self.killed_at: int | None = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if self.killed_at is None and "train/loss" in metrics:
            self.victim.stop()
            self.killed_at = step

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_killed_server_is_taken_out_and_the_other_carries_the_load(sft_dir, tmp_path):
    a = start_server(sft_dir, tmp_path)
    b = start_server(sft_dir, tmp_path)
    try:
        run_dir = tmp_path / "run"
        cfg = load_config(
            None,
            [
                *TINY,
                *GRPO,
                f"model.path={sft_dir}",
                f"run.dir={run_dir}",
                "train.steps=3",
                f'engine.urls=["{a.url}", "{b.url}"]',
                f"engine.sync_dir={tmp_path / 'shared'}",
            ],
        )
        killer = _KillAfterFirstStep(a)
        b_before = httpx.get(f"{b.url}/stats").json()["prompts"]
        train(cfg, sink=killer)
        assert killer.killed_at == 1
        recs = [r for r in _records(run_dir) if "train/loss" in r]
        assert [r["step"] for r in recs] == [1, 2, 3]  # the run completed
        assert recs[0]["sync/acks"] == 2.0
        assert [r["engine/servers_alive"] for r in recs[1:]] == [1.0, 1.0]
        assert all(r["sync/acks"] == 1.0 for r in recs[1:])
        # every episode of steps 2-3 and the final eval was generated by server b
        per_step = 8 * 4
        b_prompts = httpx.get(f"{b.url}/stats").json()["prompts"] - b_before
        assert b_prompts >= per_step * 2 + 4
        assert all(r["train/logprob_gap"] < 1e-4 for r in recs)
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3
    finally:
        a.stop()
        b.stop()


@pytest.mark.slow  # ~27 s; a killed server taken out of rotation stays in the default suite
def test_dead_server_comes_back_resynced(sft_dir, tmp_path, tokenizer):
    """Kill one of two servers mid-use, restart it on its port: it is put back, with the
    current adapter loaded before it gets any request."""
    import peft

    a = start_server(sft_dir, tmp_path)
    b = start_server(sft_dir, tmp_path)
    engine = HttpEngine([a.url, b.url], timeout_s=60, health_interval_s=0.2)
    try:
        base = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.float32)
        pm = peft.get_peft_model(
            base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        )
        pm.save_pretrained(tmp_path / "v7")
        assert engine.load_adapter(tmp_path / "v7", 7) == 2
        prompt = [tokenizer.bos_token_id, *tokenizer.encode("2+2=", add_special_tokens=False)]
        params = SamplingParams(temperature=1.0, max_new_tokens=3, stop_token_ids=(4,))
        reqs = [GenerationRequest(list(prompt)) for _ in range(12)]
        assert len(engine.generate(reqs, params)) == 12
        assert all(s.served > 0 for s in engine.servers)

        # kill a while a long batch is in flight on both servers: nothing is lost
        long = SamplingParams(temperature=1.0, max_new_tokens=400)
        many = [GenerationRequest(list(prompt)) for _ in range(24)]

        def kill_when_busy() -> None:
            while engine.servers[0].inflight == 0:
                time.sleep(0.005)
            time.sleep(0.1)  # requests are in a's batch (400 decode steps take far longer)
            a.stop()

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        outs = engine.generate(many, long)
        killer.join()
        assert len(outs) == 24 and all(len(o.token_ids) == 400 for o in outs)
        assert all(len(o.logprobs) == 400 for o in outs)
        assert engine.stats["retries"] >= 1  # requests in flight on a were redone on b
        assert [s.alive for s in engine.servers] == [False, True]
        assert engine.stats["servers_taken_out"] >= 1

        a2 = start_server(sft_dir, tmp_path, port=a.port)
        try:
            deadline = time.monotonic() + 60
            while not engine.servers[0].alive:
                assert time.monotonic() < deadline, "server never put back"
                time.sleep(0.1)
            ids = [m["id"] for m in httpx.get(f"{a2.url}/v1/models").json()["data"]]
            assert "gyre-v7" in ids  # resynced before taking requests
            served_before = engine.servers[0].served
            engine.generate(reqs, params)
            assert engine.servers[0].served > served_before
        finally:
            a2.stop()
    finally:
        engine.close()
        a.stop()
        b.stop()


def test_sft_in_the_same_run_is_pushed_to_the_server_first(tmp_path):
    """The server starts on the untrained init weights; the run's SFT output reaches it through
    update_weights_from_disk before the first rollout, so step 1's logprobs already match."""
    from gyre.config import ModelConfig
    from gyre.models.build import create_tiny_checkpoint

    run_dir = tmp_path / "run"
    dims = ModelConfig(hidden_size=32, num_layers=2, intermediate_size=64)
    create_tiny_checkpoint(dims, run_dir / "init", seed=0)  # what the run itself would build
    srv = start_server(run_dir / "init", tmp_path)
    try:
        sft = ["sft.steps=5", "sft.demos=20", "sft.batch_size=8", "sft.lr=0.02"]
        cfg = load_config(
            None,
            [
                *TINY,
                *GRPO,
                *sft,
                f"run.dir={run_dir}",
                "train.steps=1",
                f'engine.urls=["{srv.url}"]',
                f"engine.sync_dir={tmp_path / 'shared'}",
            ],
        )
        train(cfg)
        (rec,) = [r for r in _records(run_dir) if "train/loss" in r]
        assert rec["train/logprob_gap"] < 1e-4
        stats = httpx.get(f"{srv.url}/stats").json()
        assert stats["weight_version"] == "0" and stats["engine_version"] >= 1
    finally:
        srv.stop()
