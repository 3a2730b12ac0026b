"""Reward scoring cost: math-verify in process vs in the sandbox, on the same samples.

    python bench/rewards.py [--samples 128] [--workers 2] [--repeats 3]

Scores ``samples`` completions (half right, half wrong, some as fractions) of the bundled
examples/math/tasks.jsonl with ``gyre.rewards.math_answer:math_answer``: once in process, once
sandboxed (one worker call per sample, ``workers`` reused processes, network denied when the
kernel allows it). Prints seconds per step and the ratio; the last line is one JSON object.
Worker start-up is paid once, before timing, as in a run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from gyre.config import RewardConfig
from gyre.envs import load_jsonl_tasks
from gyre.rewards import RewardBatch, Rewarder

TASKS = Path(__file__).resolve().parents[1] / "examples" / "math" / "tasks.jsonl"


def _batch(n: int) -> RewardBatch:
    tasks = load_jsonl_tasks(TASKS)
    rows = [tasks[i % len(tasks)] for i in range(n)]
    completions = [r.answer if i % 2 == 0 else r.answer + "1" for i, r in enumerate(rows)]
    return RewardBatch(
        [r.prompt for r in rows],
        completions,
        {"answer": [r.answer for r in rows], "env_reward": [0.0] * n},
    )


def _time(rewarder: Rewarder, batch: RewardBatch, repeats: int) -> tuple[float, list[float]]:
    best, totals = float("inf"), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        totals, _, _ = rewarder.score_batch(batch)
        best = min(best, time.perf_counter() - t0)
    return best, totals


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    probe = (
        "from gyre.rewards._worker import isolate_network as f; raise SystemExit(f() is not None)"
    )
    netns = subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0
    batch = _batch(args.samples)
    fn = {"fn": "gyre.rewards.math_answer:math_answer"}
    inproc = Rewarder(RewardConfig.model_validate({"functions": [fn], "env_weight": 0.0}))
    sandbox = {"workers": args.workers, "network": "deny" if netns else "allow"}
    boxed = Rewarder(
        RewardConfig.model_validate(
            {"functions": [{**fn, "sandbox": True}], "env_weight": 0.0, "sandbox": sandbox}
        )
    )
    try:
        _time(inproc, batch, 1)  # warm-up: imports, sympy caches
        _time(boxed, batch, 1)  # warm-up: every worker started and has imported math-verify
        t_in, r_in = _time(inproc, batch, args.repeats)
        t_box, r_box = _time(boxed, batch, args.repeats)
    finally:
        boxed.close()
    assert r_in == r_box, "sandboxed and in-process scores differ"
    print(
        f"{args.samples} samples, math_answer: in process {t_in:.3f}s, sandbox "
        f"({args.workers} workers, network {sandbox['network']}) {t_box:.3f}s, "
        f"ratio {t_box / t_in:.2f}x; mean reward {sum(r_in) / len(r_in):.3f}"
    )
    report = {
        "bench": "rewards",
        "samples": args.samples,
        "workers": args.workers,
        "network": sandbox["network"],
        "in_process_s": t_in,
        "sandbox_s": t_box,
        "ratio": t_box / t_in,
        "mean_reward": sum(r_in) / len(r_in),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
