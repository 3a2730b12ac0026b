"""Build the loop's sinks from ``log.*`` and ``telemetry.*``: the one call ``train()`` makes.

``build_telemetry`` returns a :class:`Telemetry`, itself a sink (``log``, ``message``, ``close``)
that fans out to JSONL, TensorBoard, the Prometheus exporter, wandb, MLflow and the console, plus
``trajectories(step, trajs)`` which writes the sampled episodes and feeds the exporter's
per-episode histograms. Sinks that cannot start (a missing extra, a port in use) raise before
training begins, with a message naming the config key.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from gyre.config import Config, dump_config
from gyre.telemetry.samples import SampleWriter
from gyre.telemetry.sinks import SUCCESS_KEYS, ConsoleSink, JsonlSink, MetricsSink, MultiSink
from gyre.types import Trajectory


class Telemetry(MultiSink):
    """The loop's fan-out sink, plus the sampled-episode writer and the exporter's histograms."""

    def __init__(
        self,
        sinks: Sequence[MetricsSink],
        samples: SampleWriter | None = None,
        exporter: Any | None = None,
    ) -> None:
        super().__init__(*sinks)
        self.samples = samples
        self.exporter = exporter

    def trajectories(
        self, step: int, trajs: Sequence[Trajectory], trained_version: int | None = None
    ) -> None:
        """Phase 6 hands over the step's episodes: samples.jsonl and episode histograms.

        ``trained_version`` (the policy version these samples update) feeds the staleness
        histogram; runners that train on older samples pass it, the synchronous loop does not.
        """
        if self.samples is not None:
            self.samples.write(step, trajs)
        if self.exporter is not None:
            self.exporter.trajectories(step, trajs, trained_version)

    def close(self) -> None:
        super().close()
        if self.samples is not None:
            self.samples.close()


def build_telemetry(
    cfg: Config,
    run_dir: Path,
    tokenizer: Any | None = None,
    extra: MetricsSink | None = None,
    title: str = "GRPO",
    make_env: Callable[[], Any] | None = None,
) -> Telemetry:
    """Every sink the config asks for; on any failure the ones already opened are closed.

    ``tokenizer`` decodes the sampled episodes for ``samples.jsonl``; without one (a driver that
    never sees token ids) no samples are written and the console says so. ``make_env`` builds
    the run's env, whose optional ``render_episode`` hook draws the written episodes.
    """
    t = cfg.telemetry
    sinks: list[MetricsSink] = []
    exporter = None
    try:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if t.tensorboard:
            from gyre.telemetry.tensorboard_sink import TensorBoardSink

            sinks.append(TensorBoardSink(run_dir / "tb", dump_config(cfg)))
        if t.prometheus_port is not None:
            from gyre.telemetry.prometheus import PrometheusExporter

            try:
                exporter = PrometheusExporter(
                    run_dir, t.prometheus_port, t.prometheus_host, cfg.train.steps
                )
            except OSError as exc:
                raise ValueError(
                    f"telemetry.prometheus_port={t.prometheus_port}: cannot serve on "
                    f"{t.prometheus_host}:{t.prometheus_port} ({exc.strerror or exc})"
                ) from exc
            sinks.append(exporter)
        if t.wandb:
            from gyre.telemetry.trackers import WandbSink

            sinks.append(WandbSink(run_dir, t.wandb_project, cfg.model_dump(mode="json")))
        if t.mlflow:
            from gyre.telemetry.trackers import MlflowSink

            sinks.append(MlflowSink(run_dir, t.mlflow_tracking_uri, cfg.model_dump(mode="json")))
        if cfg.log.console != "off":
            # reward functions alone (env_weight 0): the env's success is not what the run learns
            hide = () if cfg.reward.env_success_scored else SUCCESS_KEYS
            sinks.append(ConsoleSink(cfg.train.steps, cfg.log.console, title, hide=hide))
        if extra is not None:
            sinks.append(extra)
    except BaseException:
        for s in sinks:
            if s is not extra:
                s.close()
        raise
    samples = None
    if t.samples > 0 and tokenizer is not None:
        path = run_dir / "samples.jsonl"
        samples = SampleWriter(path, t.samples, tokenizer, make_env, cfg.run.seed, t.sample_frames)
    tel = Telemetry(sinks, samples, exporter)
    if t.samples > 0 and tokenizer is None:
        tel.message("telemetry.samples: no tokenizer here, so no samples.jsonl is written")
    if exporter is not None:
        tel.message(f"prometheus metrics: {exporter.url}")
    return tel
