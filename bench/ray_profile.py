"""Where the time of one synchronous Ray GRPO step goes, on the maze (the breakdown in
docs/cluster.md).

    python bench/ray_profile.py                  # in-process breakdown, then a sync Ray run
    python bench/ray_profile.py --steps 3 --sft-steps 50 --no-ray   # a smoke run

Part 1 runs the Ray runner's own actor classes (``RolloutWorker``, ``TrainerRank``) in this
process, one torch thread, and times every phase of a step by wrapping the functions the update
calls: old-logprob recompute (``prepare_batch``), forward (``policy_forward``), backward, the
gradient all-reduce (``sync_gradients``, a world of one here), clipping, the optimizer step,
collate/advantages, the state-dict gather and its pickling (what the object store does), and the
engine's weight load. Part 2 runs the same steps on a local Ray cluster (``runner: ray``,
``ray.mode=sync``) and splits each step's wall time into the actors' own compute (reported by
the actors) and what is left: Ray calls, object transfer and the driver's glue.

The config is the one ``bench/async.py`` uses (``--config`` extras are appended to both).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from async_common import bench_overrides, warm_start

TIMES: dict[str, float] = defaultdict(float)
ZERO_STD = [0, 0]  # groups whose rewards are all equal, groups
_STACK: list[float] = []  # time spent in nested clocks, per open clock


@contextmanager
def _clock(name: str) -> Iterator[None]:
    """Exclusive timing: a clock opened inside another is not counted twice."""
    t0 = time.perf_counter()
    _STACK.append(0.0)
    try:
        yield
    finally:
        spent = time.perf_counter() - t0
        inner = _STACK.pop()
        TIMES[name] += spent - inner
        if _STACK:
            _STACK[-1] += spent


def _wrap(owner: Any, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        with _clock(name):
            return fn(*args, **kwargs)

    setattr(owner, attr, timed)


def _instrument() -> None:
    import gyre.loop
    import gyre.trainer.update

    _wrap(gyre.loop, "collate", "train: collate")
    _wrap(gyre.loop, "batch_advantages", "train: advantages")
    fwd = gyre.trainer.update.policy_forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        # prepare_batch's forward runs under no_grad: that is the old-logprob recompute
        grad = torch.is_grad_enabled()
        name = "train: forward (with grad)" if grad else "train: old-logprob recompute forward"
        with _clock(name):
            return fwd(*args, **kwargs)

    gyre.trainer.update.policy_forward = forward
    _wrap(torch.Tensor, "backward", "train: backward")
    _wrap(torch.nn.utils, "clip_grad_norm_", "train: grad clip")
    _wrap(torch.optim.AdamW, "step", "train: optimizer step")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_process(cfg: Any, warm: Path, steps: int) -> dict[str, float]:
    """Part 1: the actor classes in this process; seconds per step by phase."""
    from gyre.rollout.core import rollout_seed
    from gyre.runners.actors import RolloutWorker, TrainerRank
    from gyre.runners.scheduler import ShareScheduler

    torch.set_num_threads(1)
    worker = RolloutWorker(cfg, str(warm), 0)
    trainer = TrainerRank(cfg, 0, 1, str(warm), str(warm), None)
    trainer.init_group("127.0.0.1", _free_port())
    assert trainer.comm is not None
    _wrap(trainer.comm, "sync_gradients", "train: grad all-reduce (world 1)")
    _wrap(trainer.comm, "reduce_counts", "train: count all-reduce (world 1)")
    _instrument()
    T = cfg.train.tasks_per_step
    sched = ShareScheduler(T, T, 0, 0)
    for step in range(1, steps + 1):
        share = sched.share_of(step - 1, rollout_seed(cfg, step))
        with _clock("generate (rollout actor)"):
            res = worker.rollout(share)
        rewards = torch.tensor([t.reward for t in res["trajs"]]).view(T, -1)
        ZERO_STD[0] += int((rewards.std(dim=1) == 0).sum())
        ZERO_STD[1] += T
        with _clock("train: rest of update_phase"):
            trainer.update(step, res["trajs"])
        with _clock("sync: state-dict gather"):
            state, nbytes = trainer.get_weights()
        with _clock("sync: pickle + unpickle (object store)"):
            state = pickle.loads(pickle.dumps(state, protocol=5))
        with _clock("sync: engine load_weights"):
            worker.load_weights(state, step)
    import torch.distributed as dist

    dist.destroy_process_group()
    TIMES["sync: bytes"] = float(nbytes) * steps
    return {k: v / steps for k, v in TIMES.items()}


def on_ray(cfg_overrides: list[str], steps: int, root: Path) -> list[dict[str, float]]:
    """Part 2: a sync run on a local Ray cluster; its per-step metrics."""
    from gyre import runners
    from gyre.config import load_config

    d = root / "ray-sync"
    cfg = load_config(
        None,
        [*cfg_overrides, f"run.dir={d}", f"train.steps={steps}", "runner=ray", "ray.mode=sync",
         "eval.episodes=0", f"ray.temp_dir={root / 'r'}", "ray.num_cpus=2",
         "ray.rollout_workers=1"],
    )  # fmt: skip
    runners.train(cfg)
    return [
        json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if "train/loss" in x
    ]


def _median(rows: list[dict[str, float]], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--sft-steps", type=int, default=600, help="the maze default: 600")
    p.add_argument("--sft-demos", type=int, default=4000, help="the maze default: 4000")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ray", action="store_true", help="part 1 only")
    p.add_argument("--root", default="", help="work dir (default: a new temp dir)")
    p.add_argument("--warm-cache", default="", help="reuse / keep the SFT warm start here")
    p.add_argument("overrides", nargs="*", help="extra config overrides for both parts")
    a = p.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from gyre.config import load_config

    root = Path(a.root or tempfile.mkdtemp(prefix="gprof", dir="/tmp"))
    base = [*bench_overrides(a.seed), *a.overrides]
    cache = Path(a.warm_cache) if a.warm_cache else None
    warm = warm_start(a.seed, root, a.sft_steps, cache, a.sft_demos)
    over = [*base, f"model.path={warm}", "sft.steps=0"]
    cfg = load_config(None, [*over, f"run.dir={root / 'inproc'}"])
    Path(cfg.run.dir).mkdir(parents=True, exist_ok=True)
    per_step = in_process(cfg, warm, a.steps)
    total = sum(v for k, v in per_step.items() if k != "sync: bytes")
    train = sum(v for k, v in per_step.items() if k.startswith("train:"))
    gen = per_step["generate (rollout actor)"]
    print(f"\nPart 1: in-process, 1 thread, mean seconds per step over {a.steps} steps")
    print("| phase | s/step | share of the step |")
    print("| --- | --- | --- |")
    for k, v in sorted(per_step.items()):
        if k == "sync: bytes":
            print(f"| sync: bytes | {v:.0f} | |")
        else:
            print(f"| {k} | {v:.3f} | {v / total:.0%} |")
    print(f"| **train total** | {train:.3f} | {train / total:.0%} |")
    print(
        f"train / generate = {train / gen:.2f}; overlap ceiling (g+t)/max(g,t) = "
        f"{(gen + train) / max(gen, train):.2f}"
    )
    print(f"groups with zero reward std: {ZERO_STD[0] / max(ZERO_STD[1], 1):.0%}")
    out: dict[str, Any] = {"in_process": per_step, "train_over_gen": train / gen}
    if not a.no_ray:
        rows = on_ray(over, a.steps, root)[1:]  # step 1 pays the actors' first-call warm-up
        keys = ["time/rollout_s", "time/gen_actor_s", "time/train_s", "time/trainer_update_s",
                "time/sync_s", "time/sync_gather_s", "time/sync_load_s", "time/step_s"]  # fmt: skip
        print(f"\nPart 2: sync on local Ray, median over steps 2..{a.steps}")
        print("| metric | s/step |")
        print("| --- | --- |")
        med = {k: _median(rows, k) for k in keys}
        for k, v in med.items():
            print(f"| {k} | {v:.3f} |")
        out["ray_sync_median"] = med
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
