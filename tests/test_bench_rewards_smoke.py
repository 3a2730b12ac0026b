"""Smoke test: ``bench/rewards.py`` on a few samples runs and ends with a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rewards.py"


def test_rewards_bench_small() -> None:
    pytest.importorskip("math_verify")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--samples", "8", "--repeats", "1", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == "rewards" and report["samples"] == 8
    assert report["mean_reward"] == 0.5  # half the completions are the reference answers
    assert report["in_process_s"] > 0 and report["sandbox_s"] > 0
