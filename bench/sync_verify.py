"""Cost of the sync check (``engine.verify_every``) on the default maze run.

Runs ``gyre train`` with the default config (maze, in-process engine, memory weight sync,
default GRPO batch) for a few GRPO steps after a short SFT, then reads ``metrics.jsonl``: each
step logs ``sync/verify_s`` (the probe scored by the trainer and by the engine, compared) next
to its rollout, update and sync times. Prints one line per step and, last, one JSON object with
the check's share of step time (the goal is under 3 %).

    python bench/sync_verify.py [--sft-steps 20] [--steps 3] [--workdir DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    from gyre.cli import main as gyre

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workdir", default="")
    p.add_argument("overrides", nargs="*", help="extra config keys")
    ns = p.parse_args()
    work = Path(ns.workdir or tempfile.mkdtemp(prefix="sync-verify-"))
    run = work / "run"
    args = [f"run.dir={run}", f"sft.steps={ns.sft_steps}", f"train.steps={ns.steps}",
            "eval.episodes=0", "checkpoint.every=0", "log.console=off", "run.overwrite=true",
            *ns.overrides]  # fmt: skip
    rc = gyre(["train", *args])
    if rc != 0:
        raise SystemExit(f"gyre train exited {rc}")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "sync/verify_s" in r]
    shares = []
    for r in steps:
        step_s = r["time/rollout_s"] + r["time/train_s"] + r.get("time/sync_s", 0.0)
        shares.append(r["sync/verify_s"] / step_s)
        print(f"step {r['step']}: step {step_s:.2f} s, sync {r.get('time/sync_s', 0.0):.4f} s, "
              f"verify {r['sync/verify_s']:.4f} s ({100 * shares[-1]:.3f} %), "
              f"gap {r['sync/verify_gap']:.2e}")  # fmt: skip
    out = {
        "bench": "sync_verify",
        "steps": len(steps),
        "verify_s_mean": statistics.mean(r["sync/verify_s"] for r in steps),
        "share_mean_pct": 100 * statistics.mean(shares),
        "share_max_pct": 100 * max(shares),
        "workdir": str(work),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
