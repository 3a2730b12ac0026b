"""Smoke test: ``bench/algos.py --quick`` on one algorithm (gae: the critic and KL paths) runs
in process (no second interpreter start) and ends with a JSON report and the markdown table."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "algos.py"


def test_algos_bench_quick(tmp_path: Path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("bench_algos", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--algos", "gae", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert report["bench"] == "algos" and set(report["results"]) == {"gae"}
    for res in report["results"].values():
        assert 0.0 <= res["after"] <= 1.0 and res["rl_wall_s"] > 0
        assert math.isfinite(res["final_kl"]) and res["final_kl"] >= 0
    assert "| `gae` — PPO + GAE" in out
