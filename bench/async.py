"""Sync vs one-step-off vs async (k=2) GRPO on the maze with the Ray runner, side by side.

    python bench/async.py                     # the table in docs/cluster.md
    python bench/async.py --steps 4 --sft-steps 20 --eval-episodes 20 --tasks 4  # a smoke run

One SFT warm start (in this process) feeds every mode, so they start from the same policy. Each
mode then runs ``--steps`` GRPO steps on a local Ray cluster (1 rollout worker and 1 trainer
rank, one logical CPU each) and is scored by

- samples/s: trained trajectories / wall time of the GRPO steps (from the step loop's start to
  the last update, so actor start-up and the evaluations are excluded);
- final success: held-out greedy success after the last step (``--eval-episodes`` mazes).

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

MODES = {
    "sync": ["ray.mode=sync"],
    "one-step-off": ["ray.mode=one-step-off", "ray.max_staleness=1"],
    "async k=2": ["ray.mode=async", "ray.max_staleness=2"],
}


def _overrides(a: argparse.Namespace, run_dir: Path) -> list[str]:
    return [
        f"run.dir={run_dir}",
        f"run.seed={a.seed}",
        "run.threads=1",
        f"train.tasks_per_step={a.tasks}",
        f"train.group_size={a.group}",
        f"eval.episodes={a.eval_episodes}",
        "eval.every=0",
        "eval.sampled=false",
        "checkpoint.every=0",
        "log.console=off",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--tasks", type=int, default=8, help="tasks per step")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--sft-steps", type=int, default=200)
    p.add_argument("--eval-episodes", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from gyre import loop
    from gyre.config import load_config

    root = Path(tempfile.mkdtemp(prefix="gab", dir="/tmp"))
    warm_cfg = load_config(
        None, [*_overrides(a, root / "warm"), f"sft.steps={a.sft_steps}", "sft.demos=2000"]
    )
    run_dir, device = loop.setup(warm_cfg)
    t0 = time.perf_counter()
    warm = loop.run_sft(warm_cfg, run_dir, device, loop.base_model_path(warm_cfg, run_dir))
    print(f"SFT warm start: {a.sft_steps} steps in {time.perf_counter() - t0:.0f}s", flush=True)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=str(root / "r"))
    rows = []
    try:
        for name in a.modes.split(","):
            d = root / name.replace(" ", "_").replace("=", "")
            cfg = load_config(
                None,
                [
                    *_overrides(a, d),
                    f"model.path={warm}",
                    "sft.steps=0",
                    f"train.steps={a.steps}",
                    "runner=ray",
                    "ray.rollout_workers=1",
                    *MODES[name],
                ],
            )
            s = loop.train(cfg)
            steps = [
                json.loads(x)
                for x in (d / "metrics.jsonl").read_text().splitlines()
                if "train/loss" in x
            ]
            samples = sum(a.tasks * a.group for _ in steps)
            wall = sum(a.tasks * a.group / m["perf/samples_per_s"] for m in steps)
            rows.append(
                {
                    "mode": name,
                    "samples_per_s": samples / wall,
                    "grpo_wall_s": wall,
                    "final_success": s["after"].get("eval/success_greedy"),
                    "start_success": s["before"].get("eval/success_greedy"),
                    "staleness_mean": sum(m["async/staleness_mean"] for m in steps) / len(steps),
                    "dropped": steps[-1]["async/dropped_total"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    base = rows[0]["samples_per_s"]
    print("| mode | samples/s | vs sync | final greedy success | mean staleness | dropped |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x | "
            f"{r['final_success']:.1%} | {r['staleness_mean']:.2f} | {r['dropped']:.0f} |"
        )
    print(json.dumps({"args": vars(a), "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
