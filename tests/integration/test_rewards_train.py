"""Reward functions in real (tiny) training runs through ``gyre.cli.main``: the dataset env
scored by math-verify plus a custom term, and sandboxed rewards that hang, allocate too much or
dial out — the run continues with the failures counted, or stops when there are too many."""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gyre.cli import main

TINY = {
    "model": {"hidden_size": 32, "num_layers": 2, "intermediate_size": 64},
    "sft": {"steps": 2, "demos": 8, "batch_size": 4},
    "train": {"steps": 2, "tasks_per_step": 2, "group_size": 2, "sampling": {"max_new_tokens": 4}},
    "eval": {"episodes": 2, "every": 0, "sampled": False},
    "checkpoint": {"every": 0},
    "log": {"console": "off"},
    "run": {"threads": 1},
}


def _netns() -> bool:
    code = (
        "from gyre.rewards._worker import isolate_network as f; raise SystemExit(f() is not None)"
    )
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


NETNS = _netns()


def _dataset(tmp_path: Path) -> str:
    rows = [
        {"prompt": f"{a}+{b}=", "answer": a + b, "id": a * 3 + b}
        for a in range(3)
        for b in range(3)
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(tmp_path: Path, reward: dict, **extra) -> tuple[int, Path]:
    cfg = {
        **TINY,
        "env": {"name": "dataset", "dataset": {"path": _dataset(tmp_path), "eval_rows": 2}},
        "reward": reward,
        **extra,
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    return main(["train", str(tmp_path / "cfg.yaml"), f"run.dir={run_dir}"]), run_dir


def _train_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "train/loss" in r]


def test_dataset_env_with_math_verify_and_a_custom_term(tmp_path):
    pytest.importorskip("math_verify")
    reward = {
        "env_weight": 0.0,
        "functions": [
            {"fn": "gyre.rewards.math_answer:math_answer"},
            {"fn": "reward_fixtures:length", "name": "len", "weight": -0.1},
        ],
    }
    rc, run_dir = _run(tmp_path, reward)
    assert rc == 0
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        for key in (
            "reward/env_mean",
            "reward/math_answer_mean",
            "reward/len_mean",
            "reward/total_mean",
            "reward/total_std",
            "time/reward_s",
        ):
            assert math.isfinite(r[key]), key
        # the total the advantages see is the weighted sum (env weight 0)
        expected = r["reward/math_answer_mean"] - 0.1 * r["reward/len_mean"]
        assert r["reward/total_mean"] == pytest.approx(expected)
        assert r["rollout/reward_mean"] == pytest.approx(r["reward/total_mean"])
        assert 0.0 <= r["reward/math_answer_mean"] <= 1.0 and r["reward/len_mean"] > 0
    assert not (run_dir / "reward_failures.jsonl").exists()
    # the held-out evaluation scores with the same reward as training, term by term
    evals = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    evals = [r for r in evals if "eval/reward_greedy" in r]
    assert evals
    for r in evals:
        expected = r["eval/reward_math_answer_greedy"] - 0.1 * r["eval/reward_len_greedy"]
        assert r["eval/reward_greedy"] == pytest.approx(expected)
        assert r["eval/reward_len_greedy"] > 0 and r["eval/reward_env_greedy"] >= 0


@pytest.fixture
def listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


def _misbehaving(port: int, max_frac: float) -> dict:
    bad = {"when": "even"}  # every sample of the step's first task (of 2) misbehaves
    return {
        "functions": [
            {"fn": "reward_fixtures:sleeper", "sandbox": True, "kwargs": bad},
            {"fn": "reward_fixtures:hog", "sandbox": True, "kwargs": bad},
            {"fn": "reward_fixtures:dialer", "sandbox": True, "kwargs": {**bad, "port": port}},
        ],
        "sandbox": {
            "timeout_s": 2.0,
            "memory_mb": 512,
            "workers": 2,
            "failure_reward": 0.0,
            "max_failure_frac": max_frac,
            "network": "deny" if NETNS else "allow",
        },
    }


def test_run_continues_through_hung_oom_and_network_rewards(tmp_path, listener):
    rc, run_dir = _run(tmp_path, _misbehaving(listener, max_frac=0.6))
    assert rc == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    net_failures = 2 if NETNS else 0
    for r in records:
        assert r["reward/sandbox_calls"] == 12  # 3 terms x 4 samples
        assert r["reward/sandbox_timeout"] == 2
        assert r["reward/sandbox_memory"] == 2
        assert r["reward/sandbox_exception"] == net_failures
        assert r["reward/sandbox_failures"] == 4 + net_failures
        # the well-behaved half scores 1 on each term, the failed half the failure reward 0
        assert r["reward/sleeper_mean"] == r["reward/hog_mean"] == 0.5
        assert math.isfinite(r["train/loss"])
    # the held-out evaluation before GRPO is scored by the same sandboxed terms: one of its two
    # episodes misbehaves (sleeper and hog fail, and the dialer where the network is isolated)
    evaluation = 2 + net_failures // 2
    assert records[-1]["reward/sandbox_failures_total"] == 2 * (4 + net_failures) + evaluation
    logged = [json.loads(x) for x in (run_dir / "reward_failures.jsonl").read_text().splitlines()]
    # two training steps, and the evaluations before and after GRPO (logged as step 0)
    assert len([x for x in logged if x["step"] > 0]) == 2 * (4 + net_failures)
    assert len([x for x in logged if x["step"] == 0]) == 2 * evaluation
    kinds = {x["kind"] for x in logged}
    assert {"timeout", "memory"} <= kinds
    if NETNS:
        dial = [x for x in logged if x["term"] == "dialer"]
        assert dial and all("Network is unreachable" in x["error"] for x in dial)


def test_too_many_sandbox_failures_stop_the_run_clearly(tmp_path, listener, capsys):
    rc, run_dir = _run(
        tmp_path, _misbehaving(listener, max_frac=0.2), train={**TINY["train"], "steps": 1}
    )
    assert rc != 0
    err = capsys.readouterr().err
    assert "reward.sandbox.max_failure_frac=0.2" in err and "reward_failures.jsonl" in err
    assert not (run_dir / "summary.json").exists()


def test_dynamic_sampling_filters_on_the_final_reward(tmp_path):
    # The env reward is mostly 0 for an untrained model (zero-variance groups), but the reward
    # function gives every group variance: DAPO must see the function's reward, drop nothing,
    # and train on the function's reward.
    reward = {"env_weight": 0.0, "functions": [{"fn": "reward_fixtures:first_of_group"}]}
    train = {**TINY["train"], "dapo": {"dynamic_sampling": True, "max_rounds": 3}}
    rc, run_dir = _run(tmp_path, reward, train=train)
    assert rc == 0
    records = _train_records(run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["rollout/frac_groups_dropped"] == 0.0
        assert r["rollout/sampling_rounds"] == 1.0
        assert r["reward/total_mean"] == pytest.approx(0.5)
