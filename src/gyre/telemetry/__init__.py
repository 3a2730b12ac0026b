"""Telemetry: one small sink interface fanned out to the console, JSONL, TensorBoard, a
Prometheus exporter and optional trackers; sampled episodes; the HTML report (``report``)."""

from gyre.telemetry.sinks import ConsoleSink, JsonlSink, MetricsSink, MultiSink, timed

__all__ = ["ConsoleSink", "JsonlSink", "MetricsSink", "MultiSink", "timed"]
