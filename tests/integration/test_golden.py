"""Golden runs: today's code reproduces, bit for bit, the metrics and weights recorded before the
one-loop redesign (tests/golden/record.py says how they were made and when to re-record)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
_spec = importlib.util.spec_from_file_location("golden_record", GOLDEN / "record.py")
assert _spec is not None and _spec.loader is not None
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)


def _golden_run_on_avx2(name: str, tmp_path: Path) -> dict:
    """``name``'s golden record, made with torch's AVX2 kernels as the records were: in this
    process on an AVX2 CPU that is not Intel's, else in a subprocess with
    ``ATEN_CPU_CAPABILITY=avx2`` (an AVX-512 CPU runs AVX2 code; its own kernels give other
    bits) and, on Intel, ``MKL_CBWR=AVX2`` (``record.replay_env``; docs/operations.md)."""
    if record.cpu_capability() == "AVX2" and not record.blas_family():
        return record.golden_run(name, tmp_path / "run")
    out = tmp_path / "record.json"
    env = {**os.environ, **record.replay_env()}
    cmd = [sys.executable, str(GOLDEN / "record.py"), "--out", str(out), name]
    subprocess.run(cmd, env=env, check=True, cwd=tmp_path, stdout=subprocess.DEVNULL)
    got = json.loads(out.read_text())
    if got["cpu_capability"] != "AVX2":
        pytest.skip(f"the golden records are AVX2 bits; this CPU runs {got['cpu_capability']}")
    return got["record"]


@pytest.mark.parametrize("name", sorted(record.RUNS))
def test_golden_run_is_bitwise_identical(name: str, tmp_path: Path) -> None:
    want = json.loads(record.record_path(name).read_text())
    got = _golden_run_on_avx2(name, tmp_path)
    assert _portable(got["args"]) == _portable(want["args"]), (
        "the golden run's config changed: re-record deliberately"
    )
    assert len(got["sft_metrics"]) == len(want["sft_metrics"])
    for g, w in zip(got["sft_metrics"], want["sft_metrics"], strict=True):
        assert _recorded(g, w) == w, f"SFT step {w.get('step')}: {_diff(g, w)}"
    assert len(got["metrics"]) == len(want["metrics"])
    for g, w in zip(got["metrics"], want["metrics"], strict=True):
        assert _recorded(g, w) == w, f"GRPO row step {w.get('step')}: {_diff(g, w)}"
    assert got["final_weights"] == want["final_weights"]


def _portable(args: list[str]) -> list[str]:
    """The recorded args with the checkout's absolute path cut off (any worktree reproduces)."""
    return ["examples/" + a.split("/examples/", 1)[1] if a.startswith("/") else a for a in args]


def _recorded(got: dict, want: dict) -> dict:
    """``got`` restricted to the recorded keys: a metric added since (a new count, such as the
    maze's ``eval/bump_frac_*``) is not a numerics change; every recorded one must be equal."""
    return {k: got[k] for k in want if k in got}


def _diff(got: dict, want: dict) -> str:
    keys = sorted(set(got) | set(want))
    bad = [k for k in keys if got.get(k) != want.get(k)]
    return ", ".join(f"{k}: {got.get(k)} != {want.get(k)}" for k in bad)
