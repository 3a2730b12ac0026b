"""Checkpoint cost and resume latency for the default model (docs/operations.md).

    python bench/checkpoint.py [--sft-steps 100] [--steps 6] [--threads 2] [key=value ...]

1. ``gyre train`` with the default model and GRPO settings (``sft.steps`` shortened, evaluation
   off, a checkpoint after *every* step so several writes are timed). From ``summary.json`` and
   ``metrics.jsonl``: mean checkpoint write time (fsync included) and size, mean GRPO step time
   (rollout + update + sync), and the write's share of step time at the default interval
   (``checkpoint.every=20``): write / (20 x step + write).
2. ``gyre train ... run.resume=auto`` one step further, timed from process start to the first
   new step in ``metrics.jsonl`` (so it includes ``import torch``, hash verification, loading and
   that step's own compute); the step's compute is reported apart.
3. The same command once more on the now finished run: everything a resume does except a step
   (the resume overhead).

The last line is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_EVERY = 20


def _gyre(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "gyre.cli", "train", *args]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sft-steps", type=int, default=100)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", default="")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    a = ap.parse_args()
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gyre-bench-ckpt-"))
    run = work / "run"
    base = [
        f"run.dir={run}",
        f"sft.steps={a.sft_steps}",
        "eval.episodes=0",
        "checkpoint.every=1",
        "checkpoint.keep=2",
        "log.console=off",
        f"run.threads={a.threads}",
        *a.overrides,
    ]
    subprocess.run(_gyre([*base, f"train.steps={a.steps}"]), check=True)
    summary = json.loads((run / "summary.json").read_text())
    ck = summary["checkpoints"]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "train/loss" in r]
    step_s = sum(r["time/rollout_s"] + r["time/train_s"] + r["time/sync_s"] for r in steps)
    step_s /= len(steps)
    share = ck["mean_write_s"] / (DEFAULT_EVERY * step_s + ck["mean_write_s"])

    # resume one step further, timing process start -> first new step logged
    target = a.steps + 1
    t0 = time.perf_counter()
    proc = subprocess.Popen(_gyre([*base, f"train.steps={target}", "run.resume=auto"]))
    first = None
    while first is None and proc.poll() is None:
        for line in (run / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line) if line.endswith("}") else {}
            if r.get("step") == target and "train/loss" in r:
                first = time.perf_counter() - t0
                new_step_s = r["time/rollout_s"] + r["time/train_s"] + r["time/sync_s"]
        time.sleep(0.02)
    proc.wait()
    if first is None:
        raise SystemExit("the resumed run logged no new step")
    overhead = _relaunch_finished(base, target)
    out = {
        "checkpoint_write_s": round(ck["mean_write_s"], 4),
        "checkpoint_writes_timed": ck["writes"],
        "checkpoint_bytes": ck["bytes"],
        "grpo_step_s": round(step_s, 3),
        "share_at_every_20": round(share, 5),
        "resume_to_first_new_step_s": round(first, 2),
        "of_which_step_compute_s": round(new_step_s, 2),
        "resume_overhead_s": round(overhead, 2),
        "threads": a.threads,
    }
    print(
        f"checkpoint: {ck['bytes'] / 1e6:.2f} MB, {ck['mean_write_s'] * 1000:.0f} ms per write "
        f"(mean of {ck['writes']}, fsync included)"
    )
    print(f"GRPO step: {step_s:.2f} s -> checkpoint share at checkpoint.every=20: {share:.3%}")
    print(f"resume -> first new step: {first:.1f} s (that step's own compute {new_step_s:.1f} s)")
    print(f"resume overhead without a step (relaunch of the finished run): {overhead:.1f} s")
    print(json.dumps(out))


def _relaunch_finished(base: list[str], steps: int) -> float:
    """Wall time of ``run.resume=auto`` on a finished run: process start, imports, hash
    verification, model/optimizer/RNG load, writing final/ -- everything but a training step."""
    t0 = time.perf_counter()
    subprocess.run(
        _gyre([*base, f"train.steps={steps}", "run.resume=auto"]),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
