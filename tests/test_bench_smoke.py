"""Smoke test: ``bench/rollout.py --quick`` runs and ends with a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "rollout.py"


def test_rollout_bench_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, "bench printed nothing"
    report = json.loads(lines[-1])
    assert report["bench"] == "rollout"
    assert report["threads"] == 1
    for scenario in ("single_turn", "multi_turn"):
        entry = report[scenario]
        for side in ("gyre", "hf"):
            assert entry[f"{side}_tok_s"] > 0, (scenario, side, entry)
            assert entry[f"{side}_generated_tokens"] > 0, (scenario, side, entry)
        assert "ratio" in entry
    st = report["single_turn"]
    assert st["gyre_generated_tokens"] == st["hf_generated_tokens"]
