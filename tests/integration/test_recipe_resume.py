"""Training-recipe pieces across a resume: the GRPO LR schedule and the level-replay buffer are
checkpointed, so 2 steps + resume + 2 steps is the 4-step run (same LRs, same task seeds)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

import gyre.runners
from gyre.checkpoint.resume import Preempted
from gyre.cli import main
from gyre.commands.verify_resume import compare_runs
from gyre.config import load_config

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
    "sft.steps=6", "sft.demos=12", "sft.batch_size=4", "checkpoint.sft_every=0",
    "train.steps=4", "train.tasks_per_step=2", "train.group_size=4", "train.lr=0.001",
    "eval.episodes=2", "eval.every=0", "checkpoint.every=1", "log.console=off", "run.threads=1",
    "env.name=arithmetic", "env.arithmetic.max_operand=2", "env.arithmetic.ops=+", "sft.lr=0.02",
]  # fmt: skip


class _TermAt:
    """A metrics sink that sends SIGTERM after step ``step``'s training row."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, step: int, metrics: dict) -> None:
        if step == self.step and "train/loss" in metrics:
            os.kill(os.getpid(), signal.SIGTERM)

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def _rows(run: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(x) for x in (run / name).read_text().splitlines()]


def _straight_and_resumed(tmp_path: Path, extra: list[str]) -> tuple[Path, Path]:
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(["train", *TINY, *extra, f"run.dir={straight}"]) == 0
    cfg = load_config(None, [*TINY, *extra, f"run.dir={killed}"])
    with pytest.raises(Preempted) as info:
        gyre.runners.train(cfg, sink=_TermAt(2))
    assert info.value.step == 2
    assert main(["train", *TINY, *extra, f"run.dir={killed}", "run.resume=auto"]) == 0
    return straight, killed


def test_grpo_lr_schedule_survives_resume(tmp_path):
    extra = ["train.lr_schedule=linear", "train.warmup_steps=1", "train.min_lr_ratio=0.5"]
    straight, killed = _straight_and_resumed(tmp_path, extra)
    lrs = [r["train/lr"] for r in _rows(straight) if "train/lr" in r]
    # warmup 1, then p = (s - 1) / 3: factors 1, 1, 0.5 + 0.5 * 2/3, 0.5 + 0.5 * 1/3
    assert lrs == pytest.approx([1e-3, 1e-3, 1e-3 * (0.5 + 1 / 3), 1e-3 * (0.5 + 1 / 6)])
    assert [r["train/lr"] for r in _rows(killed) if "train/lr" in r] == lrs
    assert compare_runs(straight, killed) == []
    assert (straight / "checkpoints" / "step_000004" / "scheduler.pt").is_file()


def test_level_replay_survives_resume(tmp_path):
    # a longer SFT than TINY's, so that groups have mixed outcomes and replays happen (seed 0:
    # one replayed task in each of steps 3 and 4, drawn from the buffer of steps 1-2)
    extra = ["sft.steps=60", "sft.demos=200", "sft.batch_size=16",
             "train.level_replay.prob=0.5", "telemetry.samples=1.0"]  # fmt: skip
    straight, killed = _straight_and_resumed(tmp_path, extra)
    replayed = [r.get("rollout/replayed_tasks", 0.0) for r in _rows(straight) if "train/loss" in r]
    assert sum(replayed) > 0, "the run never replayed a task: the test would prove nothing"

    def seeds(run: Path) -> list[tuple[int, int, int]]:
        return [(r["step"], r["group_id"], r["task_seed"]) for r in _rows(run, "samples.jsonl")]

    assert seeds(killed) == seeds(straight)
    assert compare_runs(straight, killed) == []
    state = json.loads((killed / "checkpoints" / "step_000004" / "state.json").read_text())
    want = json.loads((straight / "checkpoints" / "step_000004" / "state.json").read_text())
    assert state["level_replay"] == want["level_replay"]


def test_validation_split_is_logged(tmp_path):
    run = tmp_path / "run"
    assert main(["train", *TINY, "train.steps=1", "eval.validation_episodes=3",
                 f"run.dir={run}"]) == 0  # fmt: skip
    evals = [r for r in _rows(run) if "eval/success_greedy" in r]
    assert evals and all("val/success_greedy" in r for r in evals)
