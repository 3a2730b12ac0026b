"""A tiny finished run with every file-based telemetry output, shared by the observability and
report tests (TensorBoard events, samples.jsonl, metrics.jsonl, a mid-run evaluation)."""

from __future__ import annotations

from pathlib import Path

import pytest

OBSERVED = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "sft.steps=5",
    "sft.demos=20",
    "sft.batch_size=8",
    "train.steps=4",
    "train.tasks_per_step=2",
    "train.group_size=2",
    # every row of this tiny run has A = 0; unskipped, the update still measures the entropy,
    # KL and clipfrac whose logging, plots and exporters these tests check
    "train.algo.skip_zero_advantage=false",
    "eval.episodes=4",
    "eval.every=2",
    "checkpoint.every=2",
    "log.console=off",
    "run.threads=1",
    "telemetry.samples=0.5",
]


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory) -> Path:
    pytest.importorskip("tensorboard")
    from gyre.cli import main

    run_dir = tmp_path_factory.mktemp("observed") / "run"
    assert main(["train", *OBSERVED, "telemetry.tensorboard=true", f"run.dir={run_dir}"]) == 0
    return run_dir
