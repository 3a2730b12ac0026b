"""Smoke test: ``bench/algos.py --quick`` on two algorithms runs and ends with a JSON report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "algos.py"


def test_algos_bench_quick(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick", "--algos", "grpo,gae", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == "algos" and set(report["results"]) == {"grpo", "gae"}
    for res in report["results"].values():
        assert 0.0 <= res["after"] <= 1.0 and res["rl_wall_s"] > 0
        assert math.isfinite(res["final_kl"]) and res["final_kl"] >= 0
    assert "| `gae` — PPO + GAE" in proc.stdout
