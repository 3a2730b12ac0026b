"""SIGTERM to a ``runner: ray`` run: it stops after the current step with a checkpoint (exit
code 75, as the local loop), and ``run.resume=auto`` finishes it with every trajectory trained
exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")

from gyre.checkpoint.resume import EXIT_PREEMPTED
from gyre.checkpoint.store import GRPO_PREFIX

STEPS, TASKS, GROUP = 12, 2, 2


def _cmd(run_dir: Path, tmp: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "gyre.cli", "train",
        f"run.dir={run_dir}", "run.threads=1", "runner=ray", "ray.num_cpus=2",
        f"ray.temp_dir={tmp / 'ray'}", "ray.rollout_workers=1", "ray.mode=one-step-off",
        "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4",
        "model.intermediate_size=64", "sft.steps=0", f"train.steps={STEPS}",
        f"train.tasks_per_step={TASKS}", f"train.group_size={GROUP}", "eval.episodes=0",
        "checkpoint.every=0", "log.console=off", "train.level_replay.prob=0", *extra,
    ]  # fmt: skip


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [r["step"] for r in rows if "train/loss" in r]


@pytest.mark.slow
def test_sigterm_stops_with_a_checkpoint_and_resume_finishes(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("rp")  # short: Ray's socket paths have a length limit
    run_dir = tmp_path / "run"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_cmd(run_dir, tmp_path), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not _steps(run_dir) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if not _steps(run_dir):
            proc.kill()
            pytest.fail(f"no step was logged:\n{proc.communicate()[0][-3000:]}")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, out[-3000:]
    stopped = _steps(run_dir)[-1]
    assert stopped < STEPS
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts[-1] == f"{GRPO_PREFIX}{stopped:06d}", ckpts
    assert "received" in out and "stopped on SIGTERM" in out

    res = subprocess.run(_cmd(run_dir, tmp_path, "run.resume=auto"), env=env, text=True,
                         capture_output=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert _steps(run_dir) == list(range(1, STEPS + 1))
    rows = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    ids = [r["traj_id"] for r in rows if r["status"] == "trained"]
    assert sorted(ids) == sorted(f"{t}:{j}" for t in range(STEPS * TASKS) for j in range(GROUP))
