"""``gyre plan``: where should the devices go? Step time, utilisation and idle time per placement.

From measured per-role throughputs and one step's work it predicts, for N nodes (one device
each, or one node = one unit of whatever a role reserves), every placement gyre runs:

    inputs   g  rollout tokens/s of one engine         R  tokens generated per step
             t  trainer tokens/s of one rank            T  tokens trained per step
             s  sync seconds per GB of weights          W  GB of weights synced per step
             c_r  seconds a rollout call costs beyond the engines' work (Ray, transfer)
             c_t  seconds the update call costs beyond the ranks' work (Ray, transfer)
             o  the driver's own seconds per step       h  colocated hand-over seconds per step
             a_g  an engine call's seconds that do not shrink with its batch
             a_t  a rank's update seconds that do not shrink with its shard
    times    gen = a_g + R / (g r)      train = a_t + T / (t m)     sync = s W
             (r rollout nodes, m trainer nodes, each engine one call per step)

    colocated       r = m = N      step = gen + c_r + train + c_t + sync + h + o
    disaggregated   r + m = N      step = gen + c_r + train + c_t + sync + o        (mode sync)
    one-step-off    r + m = N      step = max(gen + c_r, train + c_t + sync + o)
    async           r + m = N      step = max(gen + c_r, train + c_t + sync + o)  (steady state)

In the overlapped modes the driver's own work (taking the batch, logging, checkpoint cadence)
lies on the trainer's path: the next update call waits for it, while the workers already
generate the shares handed out ahead. The rollout call's overhead lies on the generation path.

    utilisation     rollout = gen / step, trainer = train / step (colocated: (gen + train) / step
                    on every node); idle fraction = 1 - (r gen + m train) / (N step)

async is given the same bound as one-step-off: in steady state generation cannot outrun training
by more than the staleness bound, so both are limited by the slower role; async only absorbs the
step-to-step jitter of the two times, which this model of mean times does not see. For each mode
with a split the planner tries every r = 1 .. N-1 and reports the split with the shortest step.

a_g and a_t are why splitting a small batch over more engines or ranks gains less than the
split: a decode step reads all the weights whatever the batch (on a GPU; on a CPU, the per-step
launch overhead), and every data-parallel rank runs the whole optimizer step (the gradient
all-reduce too, which calibration runs of one rank do not see). One run cannot separate them
from g and t, so they are 0 unless two or more runs of different batch sizes are given
(:func:`calibrate` fits time = a + work / rate over their calls).

The inputs come from finished runs (``gyre plan RUN_DIR [RUN_DIR ...]``: medians over the steps
after the first, see :func:`measure`) or from the command line. docs/cluster.md shows the
calibration on a local multi-node Ray cluster and the comparison with published step-time
breakdowns.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

MODES = ("colocated", "disaggregated", "one-step-off", "async")


@dataclass
class Throughputs:
    rollout_tokens_per_s: float  # one engine (g)
    trainer_tokens_per_s: float  # one rank (t)
    sync_s_per_gb: float  # (s)
    overhead_s: float = 0.0  # the driver's own seconds per step (o)
    handover_s: float = 0.0  # colocated: engine sleep + wake and trainer offload per step (h)
    rollout_call_s: float = 0.0  # a step's rollout calls beyond the engines' work (c_r)
    train_call_s: float = 0.0  # the update call beyond the ranks' work (c_t)
    rollout_fixed_s: float = 0.0  # an engine call's seconds whatever its batch (a_g)
    trainer_fixed_s: float = 0.0  # a rank's update seconds whatever its shard (a_t)


@dataclass
class Workload:
    rollout_tokens: float  # generated per step (R)
    train_tokens: float  # trained per step (T)
    weights_gb: float  # synced per step (W)


@dataclass
class Prediction:
    mode: str
    rollout_nodes: int
    trainer_nodes: int
    gen_s: float
    train_s: float
    sync_s: float
    step_s: float
    util_rollout: float
    util_trainer: float
    idle_frac: float


def predict(
    tp: Throughputs, wl: Workload, mode: str, nodes: int, rollout_nodes: int = 0
) -> Prediction:
    """One placement's step time (see the module docstring for the formulas)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}; valid: {', '.join(MODES)}")
    if mode == "colocated":
        r = m = nodes
    else:
        r, m = rollout_nodes, nodes - rollout_nodes
        if r < 1 or m < 1:
            raise ValueError(f"{mode} needs 1 <= rollout nodes < {nodes} (got {r})")
    gen = tp.rollout_fixed_s + wl.rollout_tokens / (tp.rollout_tokens_per_s * r)
    train = tp.trainer_fixed_s + wl.train_tokens / (tp.trainer_tokens_per_s * m)
    sync = tp.sync_s_per_gb * wl.weights_gb
    gen_path = gen + tp.rollout_call_s
    train_path = train + tp.train_call_s + sync + tp.overhead_s
    if mode == "colocated":
        step = gen_path + train_path + tp.handover_s
        busy = (gen + train) / step
        return Prediction(mode, r, m, gen, train, sync, step, busy, busy, 1 - busy)
    if mode == "disaggregated":
        step = gen_path + train_path
    else:
        step = max(gen_path, train_path)
    idle = 1 - (r * gen + m * train) / (nodes * step)
    return Prediction(mode, r, m, gen, train, sync, step, gen / step, train / step, idle)


def plan(tp: Throughputs, wl: Workload, nodes: int) -> list[Prediction]:
    """The best split of every mode over ``nodes`` (colocated needs no split), fastest first."""
    out = [predict(tp, wl, "colocated", nodes)]
    for mode in MODES[1:]:
        if nodes >= 2:
            splits = [predict(tp, wl, mode, nodes, r) for r in range(1, nodes)]
            out.append(min(splits, key=lambda p: p.step_s))
    return sorted(out, key=lambda p: p.step_s)


def _median(rows: list[dict], key: str, default: float | None = None) -> float:
    values = [float(r[key]) for r in rows if r.get(key) is not None]
    if not values:
        if default is not None:
            return default
        raise ValueError(f"metrics.jsonl has no '{key}' after step 1 (a Ray run logs it)")
    return statistics.median(values)


def _keys(rows: list[dict]) -> set[str]:
    return {k for r in rows for k in r}


def _is_handover_time(key: str) -> bool:
    return key.startswith("handover/") and key.endswith("_s")


def _metric_rows(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics (give a finished run's run.dir)")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "train/loss" in r and r.get("step", 0) > 1]
    if not rows:
        raise ValueError(f"{path}: no step after the first to measure")
    return rows


def _rollout_tokens(rows: list[dict]) -> float:
    """Tokens generated per step: samples per step times the mean response length."""
    samples = _median(rows, "perf/samples_per_s") * _median(rows, "time/step_s")
    return samples * _median(rows, "rollout/response_tokens_mean")


def measure(run_dir: Path) -> tuple[Throughputs, Workload]:
    """Throughputs and one step's work from a Ray run's ``metrics.jsonl`` (medians over the
    steps after the first; best from a ``ray.mode=sync`` run, whose phases do not overlap).
    h is the sum of the run's ``handover/*_s`` metrics: 0 unless the run was colocated.
    a_g and a_t stay 0: one run cannot tell them from g and t (see :func:`calibrate`)."""
    rows = _metric_rows(run_dir)
    rollout_tokens = _rollout_tokens(rows)
    gen_call = _median(rows, "time/gen_actor_s")  # inside the rollout calls, the load included
    gather, load = _median(rows, "time/sync_gather_s"), _median(rows, "time/sync_load_s")
    gen = max(gen_call - load, 1e-9)  # the weight load is counted once, as sync
    train_tokens = _median(rows, "train/tokens")
    train = _median(rows, "time/trainer_update_s")
    gb = _median(rows, "sync/bytes") / 1e9
    step = _median(rows, "time/step_s")
    # what the step spends beyond the actors' work: the rollout and update calls (Ray, data
    # transfer) and the driver's own loop; without the loop's call timings, all of it is o
    rollout_wait = _median(rows, "time/rollout_s", -1.0)
    update_call = _median(rows, "time/train_s", -1.0)
    # a colocated run's hand-over (the engines' release, the trainer's offload and load, the
    # engines' sleep and wake): all of it inside the update call
    handover = sum(_median(rows, k) for k in sorted(_keys(rows)) if _is_handover_time(k))
    c_r = max(0.0, rollout_wait - gen_call) if rollout_wait >= 0 else 0.0
    c_t = max(0.0, update_call - train - gather - handover) if update_call >= 0 else 0.0
    own = max(0.0, step - gen - load - train - gather - c_r - c_t - handover)
    sync_per_gb = (gather + load) / gb if gb else 0.0
    tp = Throughputs(
        rollout_tokens / gen, train_tokens / train, sync_per_gb, own, handover, c_r, c_t
    )
    return tp, Workload(rollout_tokens, train_tokens, gb)


def _calls(run_dir: Path) -> tuple[int, int]:
    """(engine calls per step, trainer ranks) from the run's ``config.yaml``."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config (give a finished run's run.dir)")
    cfg = yaml.safe_load(path.read_text()) or {}
    placement = cfg.get("ray") or {}
    tasks = int((cfg.get("train") or {}).get("tasks_per_step", 0))
    workers = int(placement.get("rollout_workers", 1))
    ranks = int(placement.get("trainer_ranks", 1))
    share = int(placement.get("tasks_per_share") or 0) or max(1, tasks // max(workers, 1))
    return max(1, -(-tasks // share)), max(1, ranks)


def _affine(points: list[tuple[float, float]], what: str) -> tuple[float, float]:
    """Least squares of seconds = fixed + work / rate over (work, seconds); (fixed, rate)."""
    works = [w for w, _ in points]
    if max(works) - min(works) <= 1e-6 * max(works):
        raise ValueError(
            f"every run has the same {what} ({works[0]:.0f} tokens): the fixed seconds need "
            "runs of different batch sizes (train.tasks_per_step)"
        )
    n = len(points)
    mw, ms = sum(works) / n, sum(s for _, s in points) / n
    slope = sum((w - mw) * (s - ms) for w, s in points) / sum((w - mw) ** 2 for w in works)
    fixed = ms - slope * mw
    if fixed < 0:  # no fixed cost to see: the line through the origin
        fixed, slope = 0.0, sum(w * s for w, s in points) / sum(w * w for w in works)
    if slope <= 0:
        raise ValueError(f"{what}: the seconds do not grow with the work across these runs")
    return fixed, 1 / slope


def calibrate(run_dirs: list[Path]) -> tuple[Throughputs, Workload]:
    """:func:`measure` of the first run; with two or more runs of different batch sizes, g, a_g,
    t and a_t are fitted instead over every run's engine calls (tokens and seconds per call,
    from ``time/gen_actor_s`` less the weight load) and rank updates (``train/tokens`` per rank,
    ``time/trainer_update_s``)."""
    tp, wl = measure(run_dirs[0])
    if len(run_dirs) < 2:
        return tp, wl
    gen_points, train_points = [], []
    for d in run_dirs:
        rows, (calls, ranks) = _metric_rows(d), _calls(d)
        gen = _median(rows, "time/gen_actor_s") - _median(rows, "time/sync_load_s")
        gen_points.append((_rollout_tokens(rows) / calls, max(gen, 1e-9) / calls))
        update = _median(rows, "time/trainer_update_s")
        train_points.append((_median(rows, "train/tokens") / ranks, update))
    tp.rollout_fixed_s, tp.rollout_tokens_per_s = _affine(gen_points, "work per engine call")
    tp.trainer_fixed_s, tp.trainer_tokens_per_s = _affine(train_points, "work per rank")
    return tp, wl


def format_plan(preds: list[Prediction], nodes: int) -> str:
    head = f"{'mode':<14} {'rollout':>7} {'trainer':>7} {'gen s':>7} {'train s':>7} "
    head += f"{'sync s':>7} {'step s':>7} {'util r':>6} {'util t':>6} {'idle':>5}"
    lines = [head]
    for p in preds:
        lines.append(
            f"{p.mode:<14} {p.rollout_nodes:>7} {p.trainer_nodes:>7} {p.gen_s:>7.3f} "
            f"{p.train_s:>7.3f} {p.sync_s:>7.3f} {p.step_s:>7.3f} {p.util_rollout:>6.0%} "
            f"{p.util_trainer:>6.0%} {p.idle_frac:>5.0%}"
        )
    best = preds[0]
    split = (
        "all nodes both roles"
        if best.mode == "colocated"
        else (f"{best.rollout_nodes} rollout + {best.trainer_nodes} trainer nodes")
    )
    lines.append(f"best over {nodes} nodes: {best.mode}, {split}: {best.step_s:.3f} s per step")
    return "\n".join(lines)


def run_plan(run_dirs: list[str], nodes: int, given: dict[str, float], as_json: bool) -> str:
    """``gyre plan``: measure (or take ``given``), plan, format."""
    if run_dirs:
        tp, wl = calibrate([Path(d) for d in run_dirs])
    else:
        tp, wl = Throughputs(0, 0, 0), Workload(0, 0, 0)
    for k, v in given.items():
        target = tp if k in Throughputs.__dataclass_fields__ else wl
        setattr(target, k, v)
    needed = {
        "rollout_tokens_per_s": tp.rollout_tokens_per_s,
        "trainer_tokens_per_s": tp.trainer_tokens_per_s,
        "rollout_tokens": wl.rollout_tokens,
        "train_tokens": wl.train_tokens,
    }
    for name, value in needed.items():
        if value <= 0:
            flag = name.replace("_", "-")
            raise ValueError(f"--{flag} must be > 0 (give a RUN_DIR to measure it)")
    preds = plan(tp, wl, nodes)
    if as_json:
        return json.dumps(
            {
                "throughputs": asdict(tp),
                "workload": asdict(wl),
                "predictions": [asdict(p) for p in preds],
            },
            indent=1,
        )
    return format_plan(preds, nodes)


def main(argv: list[str]) -> int:
    """``gyre plan [RUN_DIR ...] --nodes N [--rollout-tokens-per-s X ...] [--json]``."""
    import argparse

    p = argparse.ArgumentParser(
        prog="gyre plan",
        description="Predict step time, per-role utilisation and idle time of every placement "
        "over N nodes, from finished Ray runs' measured throughputs (RUN_DIR) and/or the "
        "figures given; print the fastest split.",
    )
    p.add_argument(
        "run_dirs",
        nargs="*",
        metavar="RUN_DIR",
        help="finished Ray runs (ray.mode=sync is best); the first gives the step's work and "
        "overheads, two or more of different batch sizes also the fixed seconds per engine "
        "call and per rank update",
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes (devices) to split")
    fields = [*Throughputs.__dataclass_fields__, *Workload.__dataclass_fields__]
    for name in fields:
        p.add_argument(f"--{name.replace('_', '-')}", type=float, help="overrides the measured")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    ns = p.parse_args(argv)
    if ns.nodes < 1:
        raise ValueError("--nodes must be >= 1")
    given = {k: getattr(ns, k) for k in fields if getattr(ns, k) is not None}
    print(run_plan(ns.run_dirs, ns.nodes, given, ns.json))
    return 0
