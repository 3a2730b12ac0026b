"""Which source files one GRPO step runs through, and their lines: a reader's map of a step.

Runs ``gyre train`` in this process on what it runs with no config file, the maze recipe (a
small model, no SFT, no evaluation, three steps), and records every line run during step 2 --
from ``placement.rollout(2)`` to ``placement.rollout(3)`` -- with :func:`sys.settrace`. A file
counts when any of its code ran; its size is the whole file's lines, next to the distinct lines
that ran. "Without the engine" leaves out ``engines/`` and ``models/`` (sampling, the lean
forward, KV caches).

    python scripts/step_files.py [key=value ...]   # extra overrides, e.g. train.algo.advantage=gae
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import gyre
from gyre.config import load_recipe
from gyre.runners.local import LocalPlacement

SRC = Path(gyre.__file__).resolve().parent
ENGINE = ("engines/", "models/")
OVERRIDES = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=64",
    "sft.steps=0",
    "train.steps=3",
    "eval.episodes=0",
    "log.console=off",
    "run.threads=1",
]


class StepTrace:
    """The files whose functions run between two calls of ``placement.rollout``."""

    def __init__(self, step: int) -> None:
        self.step, self.active = step, False
        self.lines: dict[str, set[int]] = {}

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        name = frame.f_code.co_filename
        if not name.startswith(str(SRC)):
            return None  # no line events inside other code
        rel = Path(name).resolve().relative_to(SRC).as_posix()
        if event in ("call", "line"):
            self.lines.setdefault(rel, set()).add(frame.f_lineno)
        return self.trace

    def around(self, rollout: Any) -> Any:
        def traced(placement: Any, step: int) -> Any:
            if step == self.step:
                self.active = True
                sys.settrace(self.trace)
                threading.settrace(self.trace)
            elif self.active:
                sys.settrace(None)
                threading.settrace(None)  # type: ignore[arg-type]
                self.active = False
            return rollout(placement, step)

        return traced


def main(argv: list[str]) -> None:
    from gyre.loop import train

    trace = StepTrace(step=2)
    LocalPlacement.rollout = trace.around(LocalPlacement.rollout)  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_recipe("maze", [*OVERRIDES, f"run.dir={tmp}/run", *argv])
        train(cfg, LocalPlacement(cfg))
    rows = sorted(
        (f, len((SRC / f).read_text().splitlines()), len(ran)) for f, ran in trace.lines.items()
    )
    print("  size   ran  file")
    for f, n, ran in rows:
        print(f"{n:6d} {ran:5d}  {f}")
    for label, part in (
        ("one GRPO step", rows),
        ("without the engine", [r for r in rows if not r[0].startswith(ENGINE)]),
    ):
        size, ran = sum(r[1] for r in part), sum(r[2] for r in part)
        print(f"{label}: {len(part)} files, {size} lines, {ran} of them ran")


if __name__ == "__main__":
    main(sys.argv[1:])
