"""The no-learning-signal warning: hand-fed metrics, then a run whose rewards are all 0."""

from __future__ import annotations

import logging

from gyre.cli import main
from gyre.telemetry.signal import NoSignalWatch


class Messages:
    def __init__(self) -> None:
        self.texts: list[str] = []

    def log(self, step, metrics) -> None:  # the MetricsSink protocol
        pass

    def message(self, text: str) -> None:
        self.texts.append(text)

    def close(self) -> None:
        pass


FLAT = {"rollout/frac_reward_zero_std": 1.0, "rollout/reward_mean": 0.0}
SPREAD = {"rollout/frac_reward_zero_std": 0.5, "rollout/reward_mean": 0.25}


def test_warns_after_n_flat_steps_in_a_row_then_backs_off():
    out = Messages()
    watch = NoSignalWatch(2)
    fed = [FLAT, SPREAD, FLAT, FLAT, FLAT, FLAT, FLAT, FLAT]
    said = [watch.update(dict(m), out) is not None for m in fed]
    # streaks: 1, reset, 1, 2 (warn), 3, 4 (warn: 2 * 2), 5, 6
    assert said == [False, False, False, True, False, True, False, False]
    assert len(out.texts) == 2
    assert "last 2 steps" in out.texts[0] and "last 4 steps" in out.texts[1]
    for hint in ("sft.steps", "train.sampling.temperature", "train.group_size",
                 "train.dapo.dynamic_sampling"):  # fmt: skip
        assert hint in out.texts[0]
    never = NoSignalWatch(0)
    assert all(never.update(dict(FLAT), out) is None for _ in range(10))


ZERO_ENV = """
class Zero:
    def reset(self, seed):
        return "say anything:"

    def step(self, action):
        return "", 0.0, True, {"success": False}
"""


def test_run_with_all_zero_rewards_says_so(tmp_path, monkeypatch, capsys, caplog):
    (tmp_path / "zero_env.py").write_text(ZERO_ENV)
    monkeypatch.chdir(tmp_path)
    args = ["train", f"run.dir={tmp_path / 'run'}", "env.name=zero_env.py:Zero", "sft.steps=0",
            "train.steps=4", "train.tasks_per_step=2", "train.group_size=2",
            "train.mini_batches=1", "model.hidden_size=32", "model.num_layers=2",
            "model.intermediate_size=64", "log.console=plain", "log.no_signal_steps=3",
            "eval.episodes=2", "run.threads=1"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="gyre.loop"):
        assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.count("no learning signal") == 1 and "last 3 steps" in printed
    assert [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
