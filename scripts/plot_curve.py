"""The learning curve of a run as a small PNG: held-out greedy success at every evaluation and
the training success of every GRPO step, from ``RUN_DIR/metrics.jsonl``.

    python scripts/plot_curve.py RUN_DIR [--out PNG]   # default RUN_DIR/curve.png

Needs matplotlib (the ``telemetry`` extra). The README's curve, ``docs/assets/default-curve.png``,
is this script's output for a run of ``gyre train run.threads=1``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curve(run_dir: Path) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(step, eval/success_greedy) at each evaluation and (step, rollout/success_rate)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"plot_curve: {path} does not exist (is {run_dir} a run directory?)")
    evals, train = [], []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "eval/success_greedy" in row:
            evals.append((row["step"], row["eval/success_greedy"]))
        if "rollout/success_rate" in row:
            train.append((row["step"], row["rollout/success_rate"]))
    return evals, train


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--out", type=Path, help="the PNG to write (default: RUN_DIR/curve.png)")
    args = p.parse_args()
    out = args.out or args.run_dir / "curve.png"
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "plot_curve: needs matplotlib, the telemetry extra: pip install -e '.[telemetry]'"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals, train = read_curve(args.run_dir)
    fig, ax = plt.subplots(figsize=(6, 3), dpi=100)
    if train:
        ax.plot(*zip(*train, strict=True), lw=0.8, alpha=0.6, label="training success (step)")
    ax.plot(*zip(*evals, strict=True), "o-", lw=1.8, label="held-out greedy success")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("success")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
