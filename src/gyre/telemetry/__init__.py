"""Metrics sinks: one small interface, fanned out to the console and a JSONL file."""

from gyre.telemetry.sinks import ConsoleSink, JsonlSink, MetricsSink, MultiSink, timed

__all__ = ["ConsoleSink", "JsonlSink", "MetricsSink", "MultiSink", "timed"]
