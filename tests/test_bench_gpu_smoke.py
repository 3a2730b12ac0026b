"""Smoke test: ``bench/gpu_check.py --smoke`` runs every section on the CPU and reports real
figures (the full run needs a GPU: docs/performance.md, "GPU check")."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
SECTIONS = (
    "lean_vs_hf",
    "engine_vs_trainer",
    "pytest_gpu",
    "matmul_peak",
    "rollout_throughput",
    "grpo_step",
    "scale",
    "grpo_run",
)


@pytest.mark.slow  # ~28 s on CPU: the GPU check script end to end
def test_gpu_check_smoke(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["meta"]["mode"] == "smoke"
    sec = report["sections"]
    assert list(sec) == list(SECTIONS)
    for name in SECTIONS:
        assert sec[name]["status"] == "ok", (name, sec[name])
    res = {name: sec[name]["result"] for name in SECTIONS}

    for dtype in ("float32", "bfloat16"):
        for model, d in res["lean_vs_hf"][dtype].items():
            assert math.isfinite(d["logits_abs_max"]) and d["logits_abs_max"] > 0, (dtype, model)
            limit = 1e-4 if dtype == "float32" else 0.1
            assert d["prefill_max_abs_diff"] < limit and d["decode_max_abs_diff"] < limit

    models = [k for k, v in res["engine_vs_trainer"].items() if isinstance(v, dict)]
    assert len(models) == 2
    for model in models:
        entry = res["engine_vs_trainer"][model]
        for key in ("float32_t1.0_p1.0", "float32_t0.7_p0.9"):
            gap = entry[key]["same_dtype"]
            assert gap["tokens"] > 0 and gap["outside_nucleus"] == 0
            assert gap["max"] < 1e-4, (model, key, gap)
            assert entry[key]["max_turns"] > 1  # multi-turn episodes
        bf16 = entry["bfloat16_t1.0_p1.0"]
        assert bf16["same_dtype"]["mean"] > 0 and "vs_fp32_trainer" in bf16

    assert res["pytest_gpu"]["files"] and res["pytest_gpu"]["returncode"] == 0
    assert res["pytest_gpu"]["counts"].get("failed", 0) == 0
    assert res["matmul_peak"]["bfloat16"] > 0 and res["matmul_peak"]["float32"] > 0

    points = res["rollout_throughput"]["points"]
    assert [p["prompts"] for p in points] == [2, 4]
    for p in points:
        for side in ("gyre", "hf"):
            assert p[side]["tok_s"] > 0 and 0 < p[side]["mfu_vs_bfloat16"], (p, side)

    step = res["grpo_step"]
    assert step["rollout_s"] > 0 and step["update_s"] > 0 and step["rows"] == 4
    assert math.isfinite(step["loss"]) and "skipped" in step["trl"]

    for mode, rungs in res["scale"]["modes"].items():
        assert [r["status"] for r in rungs] == ["ok", "ok"], (mode, rungs)
        assert all(r["step_s"] > 0 and r["params"] > 0 for r in rungs)
    assert res["scale"]["largest"] == {"lean_no_ckpt": "tiny-b", "hf_grad_ckpt": "tiny-b"}

    run = res["grpo_run"]
    assert run["returncode"] == 0 and run["steps_done"] == 2, run
    assert "eval/success_greedy" in run["before"] and "eval/success_greedy" in run["after"]

    md = (tmp_path / "report.md").read_text()
    for name in SECTIONS:
        assert f"## {name}" in md
    assert "table failed" not in md
