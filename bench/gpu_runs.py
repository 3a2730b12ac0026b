"""Subprocess sections of ``bench/gpu_check.py``: ``pytest -m gpu`` and a short ``gyre train``
on the device, each with a timeout taken from the time budget."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class Skipped(Exception):
    """A section that found too little time left; the report records it as skipped."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    return env


def pytest_gpu(ctx: Any) -> dict[str, Any]:
    files = sorted(
        str(f.relative_to(REPO))
        for f in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in f.read_text()
    )
    if not files:
        return {"files": [], "summary": "no @pytest.mark.gpu tests found"}
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider"]
    t = min(ctx.sizes.pytest_timeout_s, max(ctx.budget.left() - 5, 1))
    try:
        proc = subprocess.run(
            [*cmd, *files], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=t
        )
    except subprocess.TimeoutExpired:
        return {"files": files, "summary": f"timed out after {t:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    counts = dict(
        (k, int(n))
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", lines[-1] if lines else "")
    )
    return {
        "files": files,
        "returncode": proc.returncode,
        "summary": lines[-1] if lines else proc.stderr[-500:],
        "counts": counts,
        "outcomes": [ln for ln in lines if ln.startswith(("PASSED", "FAILED", "SKIPPED", "ERROR"))],
    }


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def grpo_run(ctx: Any) -> dict[str, Any]:
    """``gyre train`` (maze default, shortened) on the device; learned = greedy success after
    GRPO above before GRPO."""
    t = ctx.budget.left() - 5
    if t < ctx.sizes.train_min_s:
        raise Skipped(ctx.budget.note())
    with tempfile.TemporaryDirectory(prefix="gyre-gpu-run-") as tmp:
        run_dir = Path(tmp) / "run"
        device = "cpu" if ctx.device.type == "cpu" else str(ctx.device)
        overrides = [
            f"run.dir={run_dir}",
            f"run.device={device}",
            "eval.every=0",
            "checkpoint.every=0",
            "log.console=plain",
            *ctx.sizes.train_overrides,
        ]
        code = "import sys; from gyre.cli import main; sys.exit(main(sys.argv[1:]))"
        out: dict[str, Any] = {"overrides": overrides[1:], "timeout_s": round(t)}
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, "train", *overrides],
                cwd=REPO,
                env=_env(),
                capture_output=True,
                text=True,
                timeout=t,
            )
            out["returncode"] = proc.returncode
            if proc.returncode != 0:
                out["stderr_tail"] = proc.stderr[-1500:]
        except subprocess.TimeoutExpired:
            out["returncode"] = "timeout"
        out["wall_s"] = round(time.perf_counter() - t0, 1)
        rows = _read_jsonl(run_dir / "metrics.jsonl")
        steps = [r for r in rows if "rollout/reward_mean" in r]
        evals = [r for r in rows if "eval/success_greedy" in r]
        out["steps_done"] = len(steps)
        out["reward_per_step"] = [round(r["rollout/reward_mean"], 4) for r in steps]
        out["rollout_logprob_gap"] = [r.get("train/rollout_logprob_gap") for r in steps]
        half = len(steps) // 2
        if half:  # the training reward's trend, also when the run was cut short
            first, last = out["reward_per_step"][:half], out["reward_per_step"][-half:]
            out["reward_first_half"] = round(sum(first) / half, 4)
            out["reward_last_half"] = round(sum(last) / half, 4)
        if evals:  # the first evaluation is before GRPO, the last (if any) after it
            out["before"] = evals[0]
            out["after"] = evals[-1] if len(evals) > 1 else None
        summary = run_dir / "summary.json"
        if summary.is_file():
            s = json.loads(summary.read_text())
            out["before"], out["after"], out["run_wall_s"] = (
                s["before"],
                s["after"],
                s.get("wall_s"),
            )
        if out.get("before") and out.get("after"):
            b, a = out["before"]["eval/success_greedy"], out["after"]["eval/success_greedy"]
            out["learned"] = a > b
    return out
