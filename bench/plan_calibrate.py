"""Calibrate ``gyre plan`` on a local multi-node Ray cluster and check its predictions.

A head (no CPUs) and two worker nodes of one logical CPU each are started on this machine
(``ray.cluster_utils.Cluster``): ``gyre_rollout`` on one, ``gyre_trainer`` on the other. The
maze config (``bench_overrides``: 8 tasks x 8 samples, one torch thread per actor, every row
trained so the trainer's work does not depend on the rewards) then runs, each as its own
``gyre train`` joined to the cluster, in these placements:

    disaggregated 1+1, sync         the calibration run: its medians are the planner's inputs
    the same, 16 tasks per step      the second calibration run: a second batch size, so the
                                     engine's and the rank's fixed seconds (a_g, a_t) separate
                                     from their tokens/s (``gyre.commands.plan.calibrate``)
    colocated, 1 bundle              both roles on one node, alternating
    one-step-off 1+1                 generation of n+1 overlaps the update of n
    async (k=2) 1+1
    colocated, 2 bundles             2 rollout workers + 2 trainer ranks (gloo) on both nodes

For each: the median ``time/step_s`` over steps 2..N, the planner's predictions, and their
errors: "one run" calibrated on the first run alone (a_g = a_t = 0: work scales linearly over
engines and ranks), "two runs" on both. The prediction takes the throughputs (g, t, s, c_r, c_t,
o, and a_g, a_t) from the calibration runs and
the step's work (tokens generated and trained, weight bytes) from the placement's own run
(``gyre.commands.plan.measure``): response lengths drift differently in each mode (staleness
changes what is sampled), and the planner is asked about a given workload.

Before the runs, ``bench/cores.py``'s probe measures what two single-thread processes cost each
other here (1.0: two independent cores; a host that throttles this machine's sustained CPU
shows more): every placement that computes on both nodes at once depends on it.

``--repeats R`` runs the five placements R times, interleaved, and calibrates each repeat on
its own sync run (the machine's load drifts between minutes; within a repeat all placements see
about the same), then reports the median error per placement. The last line is one JSON object.

    python bench/plan_calibrate.py --steps 12 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from async_common import bench_overrides
from cores import cpu_slowdown
from gyre.commands.plan import calibrate, measure, predict

PIN = ["ray.rollout.resources={gyre_rollout: 1}", "ray.trainer.resources={gyre_trainer: 1}"]
CALIBRATION = ("disaggregated 1+1 sync", "disaggregated 1+1 sync 16 tasks")
PLACEMENTS = {  # name: (overrides, planner mode, nodes, rollout nodes)
    "disaggregated 1+1 sync": (["ray.mode=sync", *PIN], "disaggregated", 2, 1),
    "disaggregated 1+1 sync 16 tasks": (
        ["ray.mode=sync", *PIN, "train.tasks_per_step=16"], "disaggregated", 2, 1,
    ),
    "colocated 1 bundle": (["ray.placement=colocated"], "colocated", 1, 0),
    "one-step-off 1+1": (["ray.mode=one-step-off", *PIN], "one-step-off", 2, 1),
    "async k=2 1+1": (["ray.mode=async", "ray.max_staleness=2", *PIN], "async", 2, 1),
    "colocated 2 bundles": (
        ["ray.placement=colocated", "ray.trainer_ranks=2", "ray.placement_strategy=SPREAD"],
        "colocated", 2, 0,
    ),
}  # fmt: skip


def run(address: str, run_dir: Path, steps: int, extra: list[str]) -> float:
    ov = [
        *bench_overrides(0), f"run.dir={run_dir}", "sft.steps=0", f"train.steps={steps}",
        "train.mini_batches=1", "train.algo.skip_zero_advantage=false", "eval.episodes=0",
        "runner=ray", "ray.rollout_workers=1", "ray.rollout.num_cpus=0.5",
        "ray.trainer.num_cpus=0.5", f"ray.address={address}", *extra,
    ]  # fmt: skip
    if "ray.trainer_ranks=2" in extra:
        ov.append("ray.rollout_workers=2")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    subprocess.run([sys.executable, "-m", "gyre.cli", "train", *ov], env=env, check=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["time/step_s"] for r in rows if "train/loss" in r and r["step"] > 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--only",
        action="append",
        choices=list(PLACEMENTS),
        default=None,
        help="run only these placements (and the calibration run); repeatable",
    )
    args = ap.parse_args()
    os.environ["RAY_AUTH_MODE"] = "disabled"
    keep = {*CALIBRATION, *(args.only or PLACEMENTS)}
    placements = {k: v for k, v in PLACEMENTS.items() if k in keep}
    from ray.cluster_utils import Cluster

    probe = cpu_slowdown()[2]
    print(f"two concurrent single-thread processes: {probe:.2f}x the lone CPU time", flush=True)
    root = Path(tempfile.mkdtemp(prefix="gyre-plan-"))
    print(f"run directories: {root}", flush=True)
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 0, "include_dashboard": False})  # fmt: skip
    for res in ({"gyre_rollout": 2.0}, {"gyre_trainer": 2.0}):
        cluster.add_node(num_cpus=1, resources=res)
    cluster.wait_for_nodes()
    rows: list[dict] = []
    try:
        for rep in range(args.repeats):
            measured = {}
            for name, (extra, *_rest) in placements.items():
                d = root / f"r{rep}-{name.replace(' ', '_')}"
                measured[name] = run(cluster.address, d, args.steps, extra)
                print(f"repeat {rep} {name}: median step {measured[name]:.3f} s", flush=True)
            dirs = [root / f"r{rep}-{n.replace(' ', '_')}" for n in CALIBRATION]
            one, _ = measure(dirs[0])
            two, _ = calibrate(dirs)
            print(f"repeat {rep} calibration: {two}", flush=True)
            for name, (_, mode, nodes, r) in placements.items():
                _, own = measure(root / f"r{rep}-{name.replace(' ', '_')}")  # its R, T, W
                got = measured[name]
                p1, p2 = (predict(tp, own, mode, nodes, r).step_s for tp in (one, two))
                rows.append({"repeat": rep, "placement": name, "measured_s": got,
                             "one_run_s": p1, "one_run_error": p1 / got - 1,
                             "two_runs_s": p2, "two_runs_error": p2 / got - 1})  # fmt: skip
    finally:
        cluster.shutdown()
    print(f"{'placement':<32} {'repeat':>6} {'measured s':>10} {'one run s':>9} {'error':>7} "
          f"{'two runs s':>10} {'error':>7}")  # fmt: skip
    for r in rows:
        print(f"{r['placement']:<32} {r['repeat']:>6} {r['measured_s']:>10.3f} "
              f"{r['one_run_s']:>9.3f} {r['one_run_error']:>+7.1%} "
              f"{r['two_runs_s']:>10.3f} {r['two_runs_error']:>+7.1%}")  # fmt: skip
    for name in placements:
        one = statistics.median(r["one_run_error"] for r in rows if r["placement"] == name)
        two = statistics.median(r["two_runs_error"] for r in rows if r["placement"] == name)
        print(f"{name:<32} median error: one run {one:+.1%}, two runs {two:+.1%}")
    print(json.dumps({"cpu_slowdown": probe, "rows": rows}))


if __name__ == "__main__":
    main()
