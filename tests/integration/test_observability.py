"""Telemetry against the real tools: TensorBoard's reader, a real Prometheus server scraping a
run's exporter, and the shipped Grafana dashboard checked against what the exporter exposes."""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from system_tools import free_port, require_binary

REPO = Path(__file__).resolve().parents[2]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_tensorboard_events_equal_metrics_jsonl(observed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(observed_run / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    expected: dict[str, list[tuple[int, float]]] = {}
    for r in _records(observed_run / "metrics.jsonl"):
        for key, value in r.items():
            if key != "step" and isinstance(value, float | int) and not isinstance(value, bool):
                expected.setdefault(key, []).append((r["step"], float(value)))
    tags = set(acc.Tags()["scalars"])
    assert tags == set(expected), tags ^ set(expected)
    assert {"rollout/reward_mean", "train/kl", "train/entropy", "eval/success_greedy"} <= tags
    for tag, rows in expected.items():
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in rows], tag
        for (_, g), (_, want) in zip(got, rows, strict=True):
            assert g == pytest.approx(want, rel=1e-6, abs=1e-7), tag  # stored as float32
    assert [s for s, _ in expected["eval/success_greedy"]] == [0, 2, 4]


def test_samples_jsonl_fraction_and_fields(observed_run):
    rows = _records(observed_run / "samples.jsonl")
    # 4 episodes a step, fraction 0.5 -> 2 a step, for steps 1..4
    assert [r["step"] for r in rows] == [1, 1, 2, 2, 3, 3, 4, 4]
    for r in rows:
        assert {"text", "reward", "turns", "actions", "task_seed", "maze"} <= r.keys()
        assert len(r["actions"]) == r["turns"] == len(r["maze"]["positions"])
        assert r["text"] and r["reward"] in (0.0, 1.0)


# -- a real Prometheus server ---------------------------------------------------------------------


def _api(base: str, path: str, **params: str) -> dict:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


@pytest.fixture
def prometheus(tmp_path):
    """Start Prometheus on loopback with the shipped scrape config pointed at a free port.

    Yields (api base URL, the exporter port it scrapes)."""
    binary = require_binary("prometheus", "prometheus")
    exporter_port, web_port = free_port(), free_port()
    conf = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yml").read_text())
    conf["global"]["scrape_interval"] = "500ms"
    conf["global"]["scrape_timeout"] = "400ms"
    conf["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{exporter_port}"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(conf))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web_port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{web_port}"
    try:
        deadline = time.time() + 30
        while True:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(base + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.time() < deadline, "Prometheus did not become ready in 30 s"
            time.sleep(0.1)
        yield base, exporter_port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


class WaitForScrape:
    """A sink placed after the exporter: each training step waits until Prometheus has scraped
    the exporter after that step's values were set, so every step lands in Prometheus."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.steps: list[int] = []

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if "train/loss" not in metrics:
            return
        logged = time.time()
        deadline = logged + 30
        while time.time() < deadline:
            res = _api(self.base, "query", query="timestamp(gyre_step)")["result"]
            if res and float(res[0]["value"][1]) > logged:
                self.steps.append(step)
                return
            time.sleep(0.1)
        raise AssertionError(f"Prometheus did not scrape the exporter after step {step}")

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_prometheus_scrapes_a_run(prometheus, tmp_path):
    pytest.importorskip("prometheus_client")
    from gyre import runners
    from gyre.config import load_config

    base, port = prometheus
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.num_layers=2",
            "model.intermediate_size=64",
            "sft.steps=0",
            "train.steps=3",
            "train.tasks_per_step=2",
            "train.group_size=2",
            "train.algo.skip_zero_advantage=false",  # measure the token means (all A = 0)
            "eval.episodes=2",
            "eval.every=0",
            "checkpoint.every=1",
            "log.console=off",
            "run.threads=1",
            f"run.dir={run_dir}",
            f"telemetry.prometheus_port={port}",
        ],
    )
    gate = WaitForScrape(base)
    runners.train(cfg, sink=gate)
    assert gate.steps == [1, 2, 3]
    rows = [r for r in _records(run_dir / "metrics.jsonl") if "train/loss" in r]

    def series(metric: str) -> list[float]:
        res = _api(base, "query", query=f"{metric}[10m]")["result"]
        assert len(res) == 1, (metric, res)
        assert res[0]["metric"]["job"] == "gyre"
        return [float(v) for _, v in res[0]["values"]]

    # The reward series comes back, and every step's logged value is in it, exactly.
    reward = series("gyre_rollout_reward_mean")
    assert set(reward) == {r["rollout/reward_mean"] for r in rows}
    tokens = series("gyre_perf_rollout_tokens_per_s")
    assert set(tokens) == {r["perf/rollout_tokens_per_s"] for r in rows}
    assert sorted(set(series("gyre_step"))) >= [1.0, 2.0, 3.0]
    assert max(series("gyre_steps_total")) == 3.0
    ckpt = series("gyre_checkpoint_step")
    assert {1.0, 2.0} <= set(v for v in ckpt if not math.isnan(v))
    assert max(series("gyre_episode_reward_count")) == 3 * 4  # every episode observed
    names = set(_api(base, "label/__name__/values"))
    assert {"gyre_phase_seconds", "gyre_train_kl", "gyre_train_entropy"} <= names


# -- the shipped Grafana dashboard ----------------------------------------------------------------

PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "le", "phase", "job", "run", "instance",
}  # fmt: skip


def dashboard_metrics(dashboard: dict) -> set[str]:
    """Every metric name the dashboard's PromQL queries read (functions, label names and
    keywords removed)."""
    names = set()
    panels = list(dashboard["panels"])
    while panels:
        p = panels.pop()
        panels.extend(p.get("panels", []))
        for target in p.get("targets", []):
            expr = target["expr"]
            expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
            expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
            expr = re.sub(r"\b(by|without)\s*\([^)]*\)", "", expr)
            for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", expr):
                is_call = expr[m.end() :].lstrip().startswith("(")
                if not is_call and m.group() not in PROMQL_WORDS:
                    names.add(m.group())
    return names


def test_grafana_dashboard_queries_exposed_metrics(observed_run):
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gyre.telemetry.prometheus import FEATURE_KEYS, PrometheusExporter

    dashboard = json.loads((REPO / "deploy" / "grafana" / "gyre-dashboard.json").read_text())
    used = dashboard_metrics(dashboard)
    assert len(used) >= 10, used

    def exposed(exporter: PrometheusExporter) -> set[str]:
        text = generate_latest(exporter.registry).decode()
        return {s.name for f in text_string_to_metric_families(text) for s in f.samples}

    # Everything a real run logged (metrics.jsonl of the tiny run) ...
    exporter = PrometheusExporter(observed_run, 0, serve=False)
    for r in _records(observed_run / "metrics.jsonl"):
        exporter.log(r.pop("step"), {k: v for k, v in r.items() if v is not None})
    plain = exposed(exporter)
    # ... plus the keys only the async runner and fault handling log.
    exporter.log(5, {key: float(i + 1) for i, key in enumerate(FEATURE_KEYS)})
    full = exposed(exporter)
    missing = used - full
    assert not missing, f"dashboard queries metrics the exporter does not expose: {missing}"
    # and the ones a plain run lacks are all fed by other features (documented, not faked)
    feature_metrics = {
        "gyre_async_staleness_mean",
        "gyre_async_staleness_max",
        "gyre_restarts_total",
        "gyre_failures_total",
        "gyre_skipped_steps_total",
        "gyre_dropped_samples_total",
    }
    assert used - plain <= feature_metrics, used - plain
    assert feature_metrics <= used
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for word in ("reward", "success", "loss", "kl", "entropy", "throughput", "phase",
                 "staleness", "restarts", "checkpoint age"):  # fmt: skip
        assert word in titles, word
