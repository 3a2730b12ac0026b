"""Faults injected into a real ``gyre train`` over HTTP, each detected with a named cause.

A ``gyre serve`` app runs in a thread; :class:`fault_servers.LyingProxy` sits in front of it and
acknowledges weight or adapter syncs without applying them, or stops answering. Each run must
stop within seconds of the fault with its documented exit code and one line naming the engine.
"""

from __future__ import annotations

import json
import time

import pytest

from fault_servers import LyingProxy, ThreadServer
from gyre.checkpoint.store import write_model_dir
from gyre.cli import main

RUN = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "log.console=off",
    "run.threads=1",
    "env.name=arithmetic",
    "env.arithmetic.max_operand=2",
    "env.arithmetic.ops=+",
    "sft.steps=0",
    "train.steps=3",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "train.lr=0.05",
    "train.mini_batches=1",
    "train.algo.skip_zero_advantage=false",
    "train.algo.entropy_coef=0.5",  # a gradient at every step, even with equal rewards
    "train.sampling.max_new_tokens=4",
    "eval.episodes=0",
    "checkpoint.every=0",
    "engine.kind=http",
    "engine.health_interval_s=0.2",
    "engine.timeout_s=20",
]


@pytest.fixture(scope="module")
def base(tmp_path_factory, make_tiny_model, tokenizer):
    root = tmp_path_factory.mktemp("base")
    return write_model_dir(root / "m", make_tiny_model(seed=0), tokenizer)


def _train(tmp_path, base, urls: list[str], *extra: str) -> tuple[int, str, float]:
    listed = ", ".join(f'"{u}"' for u in urls)
    args = [*RUN, f"model.path={base}", f"run.dir={tmp_path / 'run'}", f"engine.urls=[{listed}]"]
    t0 = time.monotonic()
    rc = main(["train", *args, f"engine.sync_dir={tmp_path / 'sync'}", *extra])
    return rc, "", time.monotonic() - t0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_sync_acknowledged_and_not_applied_stops_the_run(tmp_path, base, capsys, lora):
    server = ThreadServer(base)
    proxy = LyingProxy(server.url, "lora" if lora else "weights")
    extra = ["model.lora={rank: 4, alpha: 8}", "train.lr=0.2"] if lora else []
    try:
        rc, _, took = _train(tmp_path, base, [proxy.url], *extra)
    finally:
        proxy.stop()
        server.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3, err
    assert err[-1].startswith(f"gyre: aborted: weight sync not applied: engine {proxy.url} ")
    assert "policy version 1" in err[-1] and "nats/token" in err[-1]
    assert took < 60
    assert not server.host.adapters  # the adapter never reached the server


def test_an_honest_server_trains_through_with_every_sync_verified(tmp_path, base):
    server = ThreadServer(base)
    proxy = LyingProxy(server.url, "honest")
    try:
        rc, _, _ = _train(tmp_path, base, [proxy.url])
    finally:
        proxy.stop()
        server.stop()
    assert rc == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/loss" in r]
    assert [r["sync/verified_engines"] for r in steps] == [1.0, 1.0, 1.0]
    assert all(r["sync/verify_gap"] < 1e-4 for r in steps)
    assert all(r["train/rollout_logprob_gap"] < 1e-4 for r in steps)


def test_without_the_sync_check_the_rollout_gap_guard_stops_the_run(tmp_path, base, capsys):
    server = ThreadServer(base)
    proxy = LyingProxy(server.url, "weights")
    try:
        rc, _, _ = _train(tmp_path, base, [proxy.url], "engine.verify_every=0")
    finally:
        proxy.stop()
        server.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 3, err
    assert err[-1].startswith("gyre: aborted: GRPO step 2: train/rollout_logprob_gap ")
    assert "faults.max_rollout_logprob_gap=0.15" in err[-1]


def test_a_wedged_engine_ends_the_run_as_a_named_engine_fault(tmp_path, base, capsys):
    """The server accepts connections and never answers (after 5 completions): the run stops
    within the deadline (a request's engine.timeout_s, then as long for a live server)."""
    server = ThreadServer(base)
    proxy = LyingProxy(server.url, "wedge", wedge_after=5)
    try:
        rc, _, took = _train(tmp_path, base, [proxy.url], "engine.timeout_s=1")
    finally:
        proxy.stop()
        server.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 69, err
    assert err[-1].startswith(f"gyre: engine fault: completion (no live server): no answer "
                              f"from {proxy.url} for 1 s (engine.timeout_s=1)")  # fmt: skip
    assert "ReadTimeout" in err[-1]
    assert took < 60


def test_a_wedged_engine_of_two_leaves_rotation_and_the_run_completes(tmp_path, base):
    a, b = ThreadServer(base), ThreadServer(base)
    wedged = LyingProxy(a.url, "wedge", wedge_after=3)
    try:
        rc, _, took = _train(tmp_path, base, [wedged.url, b.url], "engine.timeout_s=2")
    finally:
        wedged.stop()
        a.stop()
        b.stop()
    assert rc == 0
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[-1]["engine/servers_alive"] == 1.0
    assert all(r["sync/verify_gap"] < 1e-4 for r in steps)  # the live one is checked each step
    assert took < 60
