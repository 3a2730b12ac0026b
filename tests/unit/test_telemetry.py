"""Metrics sinks: JSONL records and the timing helper."""

from __future__ import annotations

import json
import time

from gyre.telemetry import JsonlSink, MultiSink, timed


class _Collect:
    def __init__(self):
        self.logged, self.closed = [], False

    def log(self, step, metrics):
        self.logged.append((step, dict(metrics)))

    def message(self, text):
        pass

    def close(self):
        self.closed = True


def test_jsonl_sink_appends_and_nulls_non_finite(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(1, {"a": 0.5, "b": float("nan"), "c": float("inf")})
    sink.close()
    sink = JsonlSink(path)  # reopening appends (resume)
    sink.log(2, {"a": 1.0})
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"step": 1, "a": 0.5, "b": None, "c": None}, {"step": 2, "a": 1.0}]


def test_multisink_fans_out():
    a, b = _Collect(), _Collect()
    sink = MultiSink(a, b)
    sink.log(3, {"x": 1.0})
    sink.close()
    assert a.logged == b.logged == [(3, {"x": 1.0})]
    assert a.closed and b.closed


def test_timed_accumulates():
    m = {}
    with timed(m, "t"):
        time.sleep(0.01)
    first = m["t"]
    with timed(m, "t"):
        time.sleep(0.01)
    assert first >= 0.009 and m["t"] >= first + 0.009


def test_console_plain_lines_show_phases_and_eta(capsys, monkeypatch):
    from gyre.telemetry import sinks

    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr(sinks.time, "perf_counter", lambda: next(clock))
    c = sinks.ConsoleSink(10, "plain")
    c.log(0, {"eval/success_greedy": 0.5})
    c.log(1, {"rollout/reward_mean": 0.25, "time/rollout_s": 1.5, "time/train_s": 0.25})
    c.log(2, {"rollout/reward_mean": 0.5, "perf/rollout_tokens_per_s": 1234.0})
    c.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 0/10  eval 0.500"
    # 10 s for the first step, 9 steps left -> 90 s
    assert lines[1] == "step 1/10  reward 0.250  | phases: rollout 1.50s train 0.25s  ETA 1m30s"
    # (130 - 100) / 2 steps * 8 left = 120 s
    assert lines[2] == "step 2/10  reward 0.500  tok/s 1234  | ETA 2m00s"


def test_console_rich_live_view_renders():
    import io

    from rich.console import Console

    from gyre.telemetry.sinks import ConsoleSink, format_duration

    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=160)
    c = ConsoleSink(4, "rich", console=con)
    c.log(0, {"eval/success_greedy": 0.5})
    c.log(1, {"rollout/reward_mean": 0.75, "rollout/success_rate": 0.5, "time/rollout_s": 2.0})
    c.message("hello")
    c.close()
    out = buf.getvalue()
    for text in ("GRPO", "1/4", "reward 0.750", "success 0.500", "rollout 2.00s", "ETA", "hello"):
        assert text in out, text
    assert [format_duration(s) for s in (5, 75, 3725)] == ["5s", "1m15s", "1h02m"]


def test_runs_scored_by_reward_functions_alone_show_their_reward_not_env_success(capsys):
    import io

    from rich.console import Console

    from gyre.cli import _table
    from gyre.config import load_config
    from gyre.telemetry.factory import SUCCESS_KEYS
    from gyre.telemetry.sinks import ConsoleSink

    fns = "reward.functions=[{fn: gyre.rewards.math_answer:math_answer}]"
    assert load_config(None, [fns]).reward.env_success_scored  # env_weight 1: both count
    cfg = load_config(None, ["env.name=arithmetic", fns, "reward.env_weight=0"])
    assert not cfg.reward.env_success_scored
    c = ConsoleSink(10, "plain", hide=SUCCESS_KEYS)
    c.log(0, {"eval/success_greedy": 0.0, "eval/reward_greedy": 0.33})
    c.log(1, {"rollout/reward_mean": 0.25, "rollout/success_rate": 0.0})
    c.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "step 0/10  eval reward 0.330" and "success" not in lines[1]
    before = {"eval/success_greedy": 0.0, "eval/reward_greedy": 0.33, "eval/reward_sampled": 0.1}
    after = {"eval/success_greedy": 0.0, "eval/reward_greedy": 0.73, "eval/reward_sampled": 0.67}
    out = io.StringIO()
    Console(file=out, width=120).print(_table([("before", before), ("after", after)], False))
    text = out.getvalue()
    assert "success" not in text and "0.330" in text and "0.670" in text
    out = io.StringIO()
    Console(file=out, width=120).print(_table([("after", after)]))
    assert "greedy success" in out.getvalue()
