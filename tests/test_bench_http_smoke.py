"""Smoke test: ``bench/http_engine.py --quick`` runs and ends with a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "http_engine.py"


@pytest.mark.slow  # ~11 s: a bench smoke
def test_http_bench_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == "http_engine"
    tp = report["throughput"]
    assert tp["inproc_tok_s"] > 0 and tp["http_tok_s"] > 0
    # every row generates exactly new_tokens tokens on both sides: the same work
    assert tp["generated_tokens"]["inproc"] == tp["generated_tokens"]["http"] == 2 * 2 * 4
    for side in ("adapter", "full"):
        assert report["sync"][side]["bytes"] > 0
    assert report["sync"]["adapter"]["bytes"] < report["sync"]["full"]["bytes"]
