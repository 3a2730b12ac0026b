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
