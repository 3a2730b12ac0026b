"""telemetry.*: the Prometheus exporter's metrics, sampled episodes, the factory's errors."""

from __future__ import annotations

import json
import math
import re
import socket
import sys
import urllib.request

import numpy as np
import pytest

from gyre.config import ConfigError, TelemetryConfig, load_config
from gyre.envs.maze import MazeEnv
from gyre.telemetry.samples import SampleWriter, action_spans
from gyre.types import Trajectory

prometheus_client = pytest.importorskip("prometheus_client")
from gyre.telemetry.prometheus import (  # noqa: E402
    FAULT_COUNTERS,
    PrometheusExporter,
    metric_name,
)


def _samples(exporter: PrometheusExporter) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, parsed from the exposition text."""
    from prometheus_client.parser import text_string_to_metric_families

    text = prometheus_client.generate_latest(exporter.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metric_names():
    assert metric_name("rollout/reward_mean") == "gyre_rollout_reward_mean"
    assert metric_name("perf/rollout_tokens_per_s") == "gyre_perf_rollout_tokens_per_s"
    assert metric_name("a-b.c/d") == "gyre_a_b_c_d"


def test_exporter_maps_keys_to_gauges_phases_and_counters(tmp_path):
    exp = PrometheusExporter(tmp_path, 0, serve=False, total_steps=10)
    exp.log(0, {"eval/success_greedy": 0.25})
    exp.log(
        1,
        {
            "rollout/reward_mean": 0.5,
            "train/loss": 0.1,
            "train/tokens": 40.0,
            "time/rollout_s": 1.5,
            "time/train_s": 0.25,
            "flag": True,
            "nan": math.nan,
        },
    )
    exp.log(
        2,
        {
            "rollout/reward_mean": 0.75,
            "train/loss": 0.2,
            "train/tokens": 60.0,
            "time/rollout_s": 0.5,
        },
    )
    s = _samples(exp)
    assert s[("gyre_rollout_reward_mean", ())] == 0.75
    assert s[("gyre_eval_success_greedy", ())] == 0.25
    assert s[("gyre_step", ())] == 2 and s[("gyre_total_steps", ())] == 10
    assert s[("gyre_steps_total", ())] == 2  # the eval-only record is not a training step
    assert s[("gyre_train_tokens_total", ())] == 100
    assert s[("gyre_phase_seconds", (("phase", "rollout"),))] == 0.5
    assert s[("gyre_phase_duration_seconds_count", (("phase", "rollout"),))] == 2
    assert s[("gyre_phase_duration_seconds_sum", (("phase", "rollout"),))] == 2.0
    assert s[("gyre_phase_duration_seconds_sum", (("phase", "train"),))] == 0.25
    assert math.isnan(s[("gyre_nan", ())])
    assert ("gyre_flag", ()) not in s  # booleans are not metrics
    assert ("gyre_time_rollout_s", ()) not in s  # phases live under gyre_phase_*
    # no feature logged a fault count, so no fault counter is exposed (not a made-up 0)
    assert not any(
        name.startswith(("gyre_restarts", "gyre_skipped", "gyre_failures", "gyre_dropped"))
        for name, _ in s
    )


def test_fault_counters_follow_cumulative_and_per_step_keys(tmp_path):
    exp = PrometheusExporter(tmp_path, 0, serve=False)
    exp.log(1, {"recovery/trainer_restarts": 1.0, "faults/nonfinite_steps": 0.0})
    exp.log(
        2,
        {
            "recovery/trainer_restarts": 1.0,
            "faults/nonfinite_steps": 2.0,
            "rollout/failed_episodes": 3.0,
            "recovery/rollout_restarts": 0.0,
        },
    )
    exp.log(
        3,
        {
            "recovery/trainer_restarts": 3.0,
            "rollout/failed_episodes": 1.0,
            "async/dropped_total": 8.0,
            "faults/nonfinite_steps": math.nan,
        },
    )
    s = _samples(exp)
    # cumulative keys: the counter is the latest total; per-step keys: the sum
    assert s[("gyre_restarts_total", (("component", "trainer"),))] == 3
    assert s[("gyre_restarts_total", (("component", "rollout"),))] == 0
    assert s[("gyre_skipped_steps_total", ())] == 2
    assert s[("gyre_failures_total", (("kind", "episode"),))] == 4
    assert s[("gyre_dropped_samples_total", ())] == 8
    assert not FAULT_COUNTERS["rollout/failed_episodes"].cumulative
    assert ("gyre_rollout_failed_episodes", ()) not in s  # a counter, not also a gauge


def test_episode_histograms_and_staleness(tmp_path):
    exp = PrometheusExporter(tmp_path, 0, serve=False)
    trajs = [_traj(reward=r, turns=t, version=v) for r, t, v in ((1.0, 3, 4), (0.0, 8, 2))]
    exp.trajectories(5, trajs)
    s = _samples(exp)
    assert s[("gyre_episode_reward_count", ())] == 2
    assert s[("gyre_episode_reward_sum", ())] == 1.0
    assert s[("gyre_episode_turns_sum", ())] == 11
    assert s[("gyre_staleness_count", ())] == 0  # not passed: nothing observed
    exp.trajectories(5, trajs, trained_version=4)
    s = _samples(exp)
    assert s[("gyre_staleness_sum", ())] == 2.0
    assert s[("gyre_staleness_bucket", (("le", "0.0"),))] == 1


def test_checkpoint_age_is_read_from_the_newest_checkpoint(tmp_path):
    exp = PrometheusExporter(tmp_path, 0, serve=False)
    s = _samples(exp)
    assert math.isnan(s[("gyre_checkpoint_age_seconds", ())])
    for step in (2, 10):
        d = tmp_path / "checkpoints" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "state.json").write_text("{}")
        (d / "manifest.json").write_text("{}")  # written last: the checkpoint is complete
    import os
    import time

    old = time.time() - 100
    os.utime(tmp_path / "checkpoints" / "step_000010" / "manifest.json", (old, old))
    s = _samples(exp)
    assert s[("gyre_checkpoint_step", ())] == 10
    assert 99 <= s[("gyre_checkpoint_age_seconds", ())] < 200


def test_exporter_serves_http_on_loopback(tmp_path):
    exp = PrometheusExporter(tmp_path, 0)  # port 0: the OS picks a free one
    try:
        exp.log(1, {"rollout/reward_mean": 0.125, "train/loss": 0.0})
        assert exp.url.startswith("http://127.0.0.1:")
        body = urllib.request.urlopen(exp.url, timeout=5).read().decode()
        assert "gyre_rollout_reward_mean 0.125" in body
    finally:
        exp.close()


def _traj(reward=0.0, turns=1, version=0, ids=None, mask=None, seed=0, success=False):
    ids = ids or [1, 2, 3]
    mask = mask or [0, 1, 1]
    return Trajectory(ids, mask, [0.0] * len(ids), reward, 0, version, turns, success, seed)


def test_action_spans():
    assert action_spans([0, 0, 1, 1, 0, 1, 0, 0, 1]) == [(2, 4), (5, 6), (8, 9)]
    assert action_spans([0, 0]) == []


def test_maze_render_episode_follows_the_env():
    env = MazeEnv()
    env.reset(3)
    rng = np.random.default_rng(0)
    actions, positions = [], []
    while not env.done:
        a = env.expert_action(rng)
        env.step(a)
        actions.append(a)
        positions.append(list(env.pos))
    out = MazeEnv().render_episode(3, actions)
    rec = out["maze"]
    assert rec["positions"] == positions and out["success"]
    assert rec["positions"][-1] == rec["goal"] and len(rec["walls"]) == 5
    assert rec["walls"][rec["start"][0]][rec["start"][1]] == "."


def test_sample_writer_fraction_determinism_and_maze(tmp_path, tokenizer):
    from gyre.rollout.demonstrate import demonstrate

    make_env = MazeEnv
    rng = np.random.default_rng(0)
    trajs = [demonstrate(make_env, tokenizer, 100 + k, 0.0, rng) for k in range(8)]
    w = SampleWriter(tmp_path / "s.jsonl", 0.25, tokenizer, make_env, seed=1)
    assert w.choose(4, 8) == w.choose(4, 8) and len(w.choose(4, 8)) == 2
    assert w.choose(4, 8) != w.choose(5, 8) or w.choose(4, 8) != w.choose(6, 8)
    assert len(SampleWriter(tmp_path / "x", 0.01, tokenizer).choose(1, 8)) == 1
    assert SampleWriter(tmp_path / "x", 0.0, tokenizer).choose(1, 8) == []
    assert w.write(4, trajs) == 2
    w.close()
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == w.choose(4, 8)
    for r in rows:
        t = trajs[r["index"]]
        assert r["turns"] == t.num_turns == len(r["actions"])
        assert r["success"] and r["reward"] == 1.0  # noise 0: the expert always succeeds
        assert r["maze"]["positions"][-1] == r["maze"]["goal"]
        assert len(r["maze"]["positions"]) == r["turns"]
        assert r["text"].startswith(r["maze"]["walls"][0][:1]) or "\n" in r["text"]


def test_config_telemetry_keys():
    cfg = load_config(None, ["telemetry.prometheus_port=9400", "telemetry.tensorboard=true"])
    assert cfg.telemetry.prometheus_port == 9400 and cfg.telemetry.tensorboard
    assert cfg.telemetry.prometheus_host == "127.0.0.1"
    assert load_config(None, ["telemetry.prometheus_port=off"]).telemetry.prometheus_port is None
    assert TelemetryConfig().prometheus_port is None
    with pytest.raises(ConfigError, match=re.escape("telemetry.samples")):
        load_config(None, ["telemetry.samples=1.5"])
    with pytest.raises(ConfigError, match=re.escape("telemetry.prometheus_port")):
        load_config(None, ["telemetry.prometheus_port=70000"])


def test_missing_tracker_names_the_extra(tmp_path, tokenizer, monkeypatch):
    from gyre.telemetry.factory import build_telemetry

    for name, extra in (("wandb", "gyre[wandb]"), ("mlflow", "gyre[mlflow]")):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
        cfg = load_config(None, [f"telemetry.{name}=true", "log.console=off"])
        with pytest.raises(ImportError, match=re.escape(extra)):
            build_telemetry(cfg, tmp_path, tokenizer)


def test_port_in_use_names_the_key(tmp_path, tokenizer):
    from gyre.telemetry.factory import build_telemetry

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = load_config(None, [f"telemetry.prometheus_port={port}", "log.console=off"])
        with pytest.raises(ValueError, match=re.escape(f"telemetry.prometheus_port={port}")):
            build_telemetry(cfg, tmp_path, tokenizer)


class _FakeWandbRun:
    def __init__(self):
        self.logged, self.finished = [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def test_wandb_sink_calls(tmp_path, monkeypatch):
    """The wandb sink's calls, against a recording stand-in module (wandb is not installed)."""
    import types

    run = _FakeWandbRun()
    seen = {}

    def init(**kw):
        seen.update(kw)
        return run

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    from gyre.telemetry.trackers import WandbSink

    sink = WandbSink(tmp_path / "myrun", "proj", {"train": {"lr": 0.1}})
    sink.log(3, {"a": 1.0, "b": math.inf, "c": True})
    sink.close()
    assert seen["project"] == "proj" and seen["name"] == "myrun"
    assert run.logged == [(3, {"a": 1.0})] and run.finished


def test_samples_jsonl_stays_strict_json_with_non_finite_rewards(tmp_path, tokenizer):
    from gyre.rollout.demonstrate import demonstrate

    rng = np.random.default_rng(0)
    trajs = [demonstrate(MazeEnv, tokenizer, 100 + k, 0.0, rng) for k in range(3)]
    for t, bad in zip(trajs, (float("nan"), float("inf"), -float("inf")), strict=True):
        t.reward = bad
        t.info["rewards"] = {"env": bad}
    w = SampleWriter(tmp_path / "s.jsonl", 1.0, tokenizer)
    assert w.write(0, trajs) == 3
    w.close()

    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    lines = (tmp_path / "s.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert [r["reward"] for r in rows] == [None, None, None]
