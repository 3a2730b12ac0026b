"""The sink interface (``log(step, metrics)``, ``message(text)``, ``close()``) and its sinks.

Later sinks (TensorBoard, Prometheus, wandb) implement the same three methods and are added to
the :class:`MultiSink` the loop writes to; the loop never knows which sinks exist.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def message(self, text: str) -> None: ...

    def close(self) -> None: ...


@contextmanager
def timed(metrics: dict[str, float], key: str) -> Iterator[None]:
    """Add the wall time of the block, in seconds, to ``metrics[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


class JsonlSink:
    """``<run.dir>/metrics.jsonl``: one JSON object per logged step, flushed at once."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {
            k: (v if not (isinstance(v, float) and not math.isfinite(v)) else None)
            for k, v in metrics.items()
        }
        self._f.write(json.dumps({"step": step, **clean}) + "\n")
        self._f.flush()

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        self._f.close()


class ConsoleSink:
    """A rich progress bar (step, reward, success, tokens/s) on a TTY; plain lines otherwise."""

    def __init__(self, total_steps: int, mode: str = "auto", title: str = "GRPO") -> None:
        self.total = total_steps
        self.mode = mode
        if mode == "auto":
            self.mode = "rich" if sys.stdout.isatty() else "plain"
        self._progress = None
        self._task = None
        if self.mode == "rich":
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn(f"[bold]{title}[/] step {{task.completed}}/{{task.total}}"),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._progress.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = []
        for key, label, fmt in (
            ("rollout/reward_mean", "reward", "{:.3f}"),
            ("rollout/success_rate", "success", "{:.3f}"),
            ("eval/success_greedy", "eval", "{:.3f}"),
            ("perf/rollout_tokens_per_s", "tok/s", "{:.0f}"),
            ("train/loss", "loss", "{:.4f}"),
            ("sft/loss", "sft loss", "{:.4f}"),
            ("sft/token_acc", "token acc", "{:.3f}"),
        ):
            if key in metrics and metrics[key] is not None:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        line = "  ".join(parts)
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(self._task, completed=step, info=line)
        elif self.mode == "plain":
            print(f"step {step}/{self.total}  {line}", flush=True)

    def message(self, text: str) -> None:
        if self.mode == "rich" and self._progress is not None:
            self._progress.console.print(text)
        elif self.mode == "plain":
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class MultiSink:
    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = list(sinks)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def message(self, text: str) -> None:
        for s in self.sinks:
            s.message(text)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
