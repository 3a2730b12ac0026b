"""A Prometheus exporter for the trainer's own health, fed through the sink interface.

One HTTP endpoint (``/metrics``, ``prometheus_client``'s server on its own registry) in the
process that owns the sinks: the local loop, or the driver of a distributed runner, so whatever
workers report reaches Prometheus aggregated there. It binds ``127.0.0.1`` unless told otherwise.

What is exposed (every name starts with ``gyre_``; the tables in docs/observability.md list them):

* **gauges, one per logged key**: the last value of every numeric metric the loop logs, named
  ``gyre_`` + the key with ``/`` and other non-identifier characters replaced by ``_``
  (``rollout/reward_mean`` -> ``gyre_rollout_reward_mean``, ``train/kl`` -> ``gyre_train_kl``).
  A gauge appears when its key is first logged, so keys a feature adds later (for instance the
  async runner's ``async/staleness_mean`` and ``async/staleness_max``) show up without code here.
* **phase time**: ``time/<phase>_s`` keys go to the gauge ``gyre_phase_seconds{phase}`` (last
  step) and the histogram ``gyre_phase_duration_seconds{phase}``.
* **counters**: ``gyre_steps_total`` (logged training steps), ``gyre_train_tokens_total`` (from
  ``train/tokens``), and the fault counters of :data:`FAULT_COUNTERS`, fed by the features that
  log those keys: ``gyre_restarts_total{component}``, ``gyre_failures_total{kind}``,
  ``gyre_skipped_steps_total``, ``gyre_dropped_samples_total``. They appear once such a key is
  logged; the local synchronous loop never restarts, drops or skips, logs none of them, and so
  exposes none (no made-up zeros).
* **histograms over episodes** (fed by :meth:`PrometheusExporter.trajectories`):
  ``gyre_episode_reward``, ``gyre_episode_turns``, ``gyre_episode_response_tokens``, and
  ``gyre_staleness`` (trainer version minus each sample's policy version) when the caller says
  which policy version it trains.
* **checkpoint age**: ``gyre_checkpoint_age_seconds`` and ``gyre_checkpoint_step``, read from the
  newest complete checkpoint in ``<run.dir>/checkpoints`` at scrape time (NaN before the first).
* ``gyre_step``, ``gyre_total_steps``, ``gyre_last_log_timestamp_seconds``.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gyre.checkpoint.files import MANIFEST_FILE
from gyre.checkpoint.store import list_checkpoints

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
except ImportError:  # pragma: no cover - exercised only without the extra
    CollectorRegistry = None  # type: ignore[assignment,misc]

PREFIX = "gyre_"


@dataclass(frozen=True)
class FaultCounter:
    """How one logged fault key becomes a counter. ``cumulative`` keys carry the run's running
    total (the counter grows by the increase); the others carry this step's count."""

    name: str  # without "_total", which prometheus_client appends
    doc: str
    labels: tuple[tuple[str, str], ...] = ()
    cumulative: bool = True


# Keys that the Ray runner and fault handling log; each becomes a counter.
# The local loop logs none of them.
FAULT_COUNTERS: dict[str, FaultCounter] = {
    "recovery/trainer_restarts": FaultCounter(
        "restarts", "Restarts of trainer or rollout workers.", (("component", "trainer"),)
    ),
    "recovery/rollout_restarts": FaultCounter(
        "restarts", "Restarts of trainer or rollout workers.", (("component", "rollout"),)
    ),
    "rollout/failed_episodes": FaultCounter(
        "failures", "Failures seen by the run.", (("kind", "episode"),), cumulative=False
    ),
    "recovery/reissued_shares": FaultCounter(
        "failures", "Failures seen by the run.", (("kind", "reissued_share"),)
    ),
    "recovery/regathered_weights": FaultCounter(
        "failures", "Failures seen by the run.", (("kind", "lost_weights"),)
    ),
    "faults/nonfinite_steps": FaultCounter(
        "skipped_steps", "Steps skipped because the loss or gradients were not finite."
    ),
    "async/dropped_total": FaultCounter(
        "dropped_samples", "Samples dropped for exceeding the staleness bound."
    ),
}
# Keys the dashboard reads that only other features (async runner, fault handling) log.
FEATURE_KEYS = ("async/staleness_mean", "async/staleness_max", *FAULT_COUNTERS)
PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
REWARD_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)

_NON_IDENT = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """The gauge name of a logged key: ``rollout/reward_mean`` -> ``gyre_rollout_reward_mean``."""
    return PREFIX + _NON_IDENT.sub("_", key).strip("_")


def require_prometheus_client() -> None:
    if CollectorRegistry is None:
        raise ImportError(
            "telemetry.prometheus_port needs the prometheus_client package: "
            "pip install 'gyre[telemetry]'"
        )


class PrometheusExporter:
    """A sink that keeps Prometheus metrics current and serves them over HTTP."""

    def __init__(
        self,
        run_dir: str | Path,
        port: int,
        host: str = "127.0.0.1",
        total_steps: int = 0,
        serve: bool = True,
    ) -> None:
        require_prometheus_client()
        self.run_dir = Path(run_dir)
        self.registry = CollectorRegistry()
        r = self.registry
        self._gauges: dict[str, Gauge | None] = {}
        self._counters: dict[str, Counter] = {}
        self._fault_seen: dict[str, float] = {}
        self.step_gauge = Gauge(PREFIX + "step", "Last logged step.", registry=r)
        total = Gauge(PREFIX + "total_steps", "Steps the run is configured for.", registry=r)
        total.set(total_steps)
        self.last_log = Gauge(
            PREFIX + "last_log_timestamp_seconds", "Unix time of the last log call.", registry=r
        )
        self.steps = Counter(PREFIX + "steps", "Training steps logged by this process.", registry=r)
        self.train_tokens = Counter(
            PREFIX + "train_tokens", "Policy tokens trained on (sum of train/tokens).", registry=r
        )
        self.phase = Gauge(
            PREFIX + "phase_seconds",
            "Wall time of each phase in the last step.",
            ["phase"],
            registry=r,
        )
        self.phase_hist = Histogram(
            PREFIX + "phase_duration_seconds",
            "Wall time of each phase per step.",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.ep_reward = Histogram(
            PREFIX + "episode_reward",
            "Reward of each rollout episode.",
            buckets=REWARD_BUCKETS,
            registry=r,
        )
        self.ep_turns = Histogram(
            PREFIX + "episode_turns",
            "Turns of each rollout episode.",
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.ep_tokens = Histogram(
            PREFIX + "episode_response_tokens",
            "Policy-written tokens of each rollout episode.",
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.staleness = Histogram(
            PREFIX + "staleness",
            "Trained policy version minus the sample's policy version.",
            buckets=STALENESS_BUCKETS,
            registry=r,
        )
        ckpt_age = Gauge(
            PREFIX + "checkpoint_age_seconds",
            "Seconds since the newest complete checkpoint was written (NaN: none yet).",
            registry=r,
        )
        ckpt_age.set_function(self._checkpoint_age)
        ckpt_step = Gauge(
            PREFIX + "checkpoint_step",
            "Step of the newest complete checkpoint (NaN: none yet).",
            registry=r,
        )
        ckpt_step.set_function(self._checkpoint_step)
        self._server = None
        self.port = port
        if serve:
            self._server, self._thread = start_http_server(port, addr=host, registry=r)
            self.port = int(self._server.server_port)
        self.url = f"http://{host}:{self.port}/metrics"

    # -- checkpoint age, computed when scraped ----------------------------------------------------
    def _newest_checkpoint(self) -> Path | None:
        ckpts = list_checkpoints(self.run_dir)
        return ckpts[-1] if ckpts else None

    def _checkpoint_age(self) -> float:
        newest = self._newest_checkpoint()
        if newest is None:
            return math.nan
        try:
            return max(0.0, time.time() - (newest / MANIFEST_FILE).stat().st_mtime)
        except FileNotFoundError:  # rotated away between listing and stat
            return math.nan

    def _checkpoint_step(self) -> float:
        newest = self._newest_checkpoint()
        return math.nan if newest is None else float(int(newest.name.split("_", 1)[1]))

    # -- the sink interface -----------------------------------------------------------------------
    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.step_gauge.set(step)
        self.last_log.set(time.time())
        if "train/loss" in metrics:  # a training step (eval-only records carry no loss)
            self.steps.inc()
        for key, value in metrics.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            value = float(value)
            if key in FAULT_COUNTERS:
                self._count_fault(key, value)
            elif key.startswith("time/") and key.endswith("_s"):
                name = key[len("time/") : -len("_s")]
                self.phase.labels(name).set(value)
                if math.isfinite(value):
                    self.phase_hist.labels(name).observe(value)
            else:
                if key == "train/tokens" and math.isfinite(value) and value > 0:
                    self.train_tokens.inc(value)
                g = self._gauge(key)
                if g is not None:
                    g.set(value)

    def _gauge(self, key: str) -> Gauge | None:
        if key in self._gauges:
            return self._gauges[key]
        try:
            g = Gauge(metric_name(key), f"Last logged value of '{key}'.", registry=self.registry)
        except ValueError:  # the name is taken by a fixed metric above: keep that one
            g = None
        self._gauges[key] = g
        return g

    def _count_fault(self, key: str, value: float) -> None:
        spec = FAULT_COUNTERS[key]
        c = self._counters.get(spec.name)
        if c is None:
            c = Counter(
                PREFIX + spec.name, spec.doc, [k for k, _ in spec.labels], registry=self.registry
            )
            self._counters[spec.name] = c
        child = c.labels(*[v for _, v in spec.labels]) if spec.labels else c
        if not math.isfinite(value):
            return
        if spec.cumulative:
            seen = self._fault_seen.get(key, 0.0)
            if value > seen:
                child.inc(value - seen)
                self._fault_seen[key] = value
        elif value > 0:
            child.inc(value)

    def trajectories(
        self, step: int, trajs: Sequence[Any], trained_version: int | None = None
    ) -> None:
        """Observe every episode's reward, turns and response tokens (and staleness, when the
        caller passes the policy version these samples train)."""
        for t in trajs:
            self.ep_reward.observe(float(t.reward))
            self.ep_turns.observe(float(t.num_turns))
            self.ep_tokens.observe(float(t.num_generated))
            if trained_version is not None:
                self.staleness.observe(float(trained_version - t.policy_version))

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
