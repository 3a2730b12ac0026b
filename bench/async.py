"""Sync vs one-step-off vs async (k=2) GRPO on the maze with the Ray runner, side by side.

    python bench/async.py                     # the table in docs/cluster.md
    python bench/async.py --steps 4 --sft-steps 20 --eval-episodes 20  # a smoke run

One SFT warm start (in this process; ``--warm-cache DIR`` keeps and reuses it) feeds every mode,
so they start from the same policy. Each mode then runs ``--steps`` GRPO steps on a local Ray
cluster (1 rollout worker and 1 trainer rank, one logical CPU and one torch thread each) with
exactly the same config (``CONFIG`` below, docs/cluster.md says why) and is scored by

- samples/s: trained trajectories / wall time of the GRPO steps (from the step loop's start to
  the last update, so actor start-up and the evaluations are excluded);
- final success: held-out greedy success after the last step (``--eval-episodes`` mazes).

``--repeats N`` runs the modes N times, interleaved (sync, one-step-off, async, sync, ...), so
every mode sees the same machine load on average. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from async_common import bench_overrides, warm_start

MODES = {
    "sync": ["ray.mode=sync"],
    "one-step-off": ["ray.mode=one-step-off"],
    "async k=2": ["ray.mode=async", "ray.max_staleness=2"],
}
# The GRPO config every mode shares (docs/cluster.md, "Benchmark"): the maze defaults except one
# optimizer step per rollout batch (so the old policy is the current one: no recompute forward),
# zero-advantage rows skipped (exact), and truncated rollout IS (the off-policy correction).
CONFIG = [
    "train.mini_batches=1",
    "train.algo.skip_zero_advantage=true",
    "train.algo.rollout_is=truncate",
    "ray.max_staleness=1",
]
PHASES = (
    "time/step_s",
    "time/rollout_s",
    "time/gen_actor_s",
    "time/train_s",
    "time/trainer_update_s",
    "time/gen_actor_cpu_s",
    "time/trainer_update_cpu_s",
    "time/sync_s",
    "time/train_call_overhead_s",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tasks", type=int, default=8, help="tasks per step")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--sft-steps", type=int, default=600, help="the maze default: 600")
    p.add_argument("--sft-demos", type=int, default=4000, help="the maze default: 4000")
    p.add_argument("--eval-episodes", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--warm-cache", default="", help="reuse / keep the SFT warm start here")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("overrides", nargs="*", help="extra config overrides (every mode)")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from gyre import runners
    from gyre.config import load_config

    root = Path(tempfile.mkdtemp(prefix="gab", dir="/tmp"))
    base = [*bench_overrides(a.seed, a.tasks, a.group), f"eval.episodes={a.eval_episodes}"]
    cache = Path(a.warm_cache) if a.warm_cache else None
    warm = warm_start(a.seed, root, a.sft_steps, cache, a.sft_demos)
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=str(root / "r"))
    rows = []
    try:
        for rep in range(a.repeats):
            for name in a.modes.split(","):
                d = root / f"{name.replace(' ', '_').replace('=', '')}-{rep}"
                cfg = load_config(
                    None,
                    [
                        *base,
                        f"run.dir={d}",
                        f"model.path={warm}",
                        "sft.steps=0",
                        f"train.steps={a.steps}",
                        "runner=ray",
                        "ray.rollout_workers=1",
                        *CONFIG,
                        *MODES[name],
                        *a.overrides,
                    ],
                )
                s = runners.train(cfg)
                steps = [
                    json.loads(x)
                    for x in (d / "metrics.jsonl").read_text().splitlines()
                    if "train/loss" in x
                ]
                n = len(steps) * a.tasks * a.group
                wall = sum(m["time/step_s"] for m in steps)
                rows.append(
                    {
                        "mode": name,
                        "repeat": rep,
                        "samples_per_s": n / wall,
                        "grpo_wall_s": wall,
                        "final_success": s["after"].get("eval/success_greedy"),
                        "start_success": s["before"].get("eval/success_greedy"),
                        "staleness_mean": statistics.mean(m["async/staleness_mean"] for m in steps),
                        "dropped": steps[-1]["async/dropped_total"],
                        "skipped_rows_frac": statistics.mean(
                            m.get("train/skipped_rows", 0.0) / (a.tasks * a.group) for m in steps
                        ),
                        # medians over steps 2.. (step 1 pays the actors' first-call warm-up)
                        **{k: statistics.median(m.get(k, 0.0) for m in steps[1:]) for k in PHASES},
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        ray.shutdown()
    print("| mode | run | samples/s | vs sync | final greedy success | mean staleness | dropped |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base_sps = next(
            x["samples_per_s"] for x in rows if x["mode"] == "sync" and x["repeat"] == r["repeat"]
        )
        print(
            f"| {r['mode']} | {r['repeat']} | {r['samples_per_s']:.1f} | "
            f"{r['samples_per_s'] / base_sps:.2f}x | {r['final_success']:.1%} | "
            f"{r['staleness_mean']:.2f} | {r['dropped']:.0f} |"
        )
    print("\nmedian seconds per step (steps 2..):")
    print("| mode | run | " + " | ".join(k.removeprefix("time/") for k in PHASES) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in PHASES) + " |")
    for r in rows:
        vals = " | ".join(f"{r[k]:.3f}" for k in PHASES)
        print(f"| {r['mode']} | {r['repeat']} | {vals} |")
    print(json.dumps({"args": vars(a), "config": CONFIG, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
