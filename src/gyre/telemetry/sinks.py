"""The sink interface (``log(step, metrics)``, ``message(text)``, ``close()``) and its sinks.

Later sinks (TensorBoard, Prometheus, wandb) implement the same three methods and are added to
the :class:`MultiSink` the loop writes to; the loop never knows which sinks exist.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol


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


def format_duration(seconds: float) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``: short enough for a status line."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


HEADLINE = (
    ("rollout/reward_mean", "reward", "{:.3f}"),
    ("rollout/success_rate", "success", "{:.3f}"),
    ("eval/success_greedy", "eval", "{:.3f}"),
    ("eval/reward_greedy", "eval reward", "{:.3f}"),
    ("perf/rollout_tokens_per_s", "tok/s", "{:.0f}"),
    ("train/loss", "loss", "{:.4f}"),
    ("sft/loss", "sft loss", "{:.4f}"),
    ("sft/token_acc", "token acc", "{:.3f}"),
    ("sft/val_loss", "val loss", "{:.4f}"),
    ("sft/val_exact", "val exact", "{:.3f}"),
)


SUCCESS_KEYS = ("rollout/success_rate", "eval/success_greedy")
"""The env's own success in the headline: hidden where reward functions alone score a run."""


class _Status:
    """The line under the progress bar; rich re-renders it on every refresh."""

    def __init__(self) -> None:
        self.text = ""

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(self.text)  # plain: no number highlighting


class ConsoleSink:
    """Step, reward, success, tokens/s, phase times and ETA.

    ``rich``: a live view, a progress bar with the headline numbers and a status line with the
    last step's phase times and the ETA. ``plain``: one line per logged step (what CI logs
    want). ``auto`` picks rich on a terminal and plain otherwise. The ETA is the mean wall time
    per step since the first logged step times the steps left, so periodic evaluations are
    averaged in rather than mistaken for a slowdown.
    """

    def __init__(
        self,
        total_steps: int,
        mode: str = "auto",
        title: str = "GRPO",
        console: Any | None = None,
        hide: Collection[str] = (),
    ) -> None:
        self.total = total_steps
        self.headline = [h for h in HEADLINE if h[0] not in hide]
        self.mode = mode
        if mode == "auto":
            self.mode = "rich" if sys.stdout.isatty() else "plain"
        self._live = None
        self._progress = None
        self._task = None
        self._status = _Status()
        self._origin: tuple[float, int] | None = None
        if self.mode == "rich":
            from rich.console import Group
            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._progress = Progress(
                TextColumn(f"[bold]{title}[/] step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                console=console,
            )
            self._task = self._progress.add_task("train", total=total_steps, info="")
            self._live = Live(
                Group(self._progress, self._status),
                console=self._progress.console,
                refresh_per_second=4,
            )
            self._live.start()

    def eta(self, step: int) -> float | None:
        """Seconds left, from the mean time per step since the first log call (None before
        two distinct steps have been seen)."""
        now = time.perf_counter()
        if self._origin is None:
            self._origin = (now, step)
            return None
        t0, s0 = self._origin
        if step <= s0 or step >= self.total:  # nothing measured yet, or nothing left
            return None
        return (now - t0) / (step - s0) * max(0, self.total - step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        parts = [
            f"{label} {fmt.format(metrics[key])}"
            for key, label, fmt in self.headline
            if metrics.get(key) is not None
        ]
        phases = [
            f"{k[5:-2]} {metrics[k]:.2f}s"
            for k in metrics
            if k.startswith("time/") and k.endswith("_s") and metrics[k] is not None
        ]
        eta = self.eta(step)
        extra = ["phases: " + " ".join(phases)] if phases else []
        extra += [f"ETA {format_duration(eta)}"] if eta is not None else []
        tail = "  ".join(extra)
        line = "  ".join(parts)
        if self.mode == "rich" and self._progress is not None:
            self._progress.update(self._task, completed=step, info=line)
            if tail:
                self._status.text = tail
        elif self.mode == "plain":
            print(f"step {step}/{self.total}  {line}" + (f"  | {tail}" if tail else ""), flush=True)

    def message(self, text: str) -> None:
        if self.mode == "rich" and self._progress is not None:
            self._progress.console.print(text)
        elif self.mode == "plain":
            print(text, flush=True)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
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
