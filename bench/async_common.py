"""The maze config and SFT warm start shared by ``bench/async.py`` and ``bench/ray_profile.py``."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

# The benchmark's GRPO config (every mode uses exactly this; docs/cluster.md says why).
TASKS, GROUP = 8, 8


def bench_overrides(seed: int, tasks: int = TASKS, group: int = GROUP) -> list[str]:
    """Config overrides every mode (and the profile) shares."""
    return [
        f"run.seed={seed}",
        "run.threads=1",
        f"train.tasks_per_step={tasks}",
        f"train.group_size={group}",
        "eval.every=0",
        "eval.sampled=false",
        "checkpoint.every=0",
        "log.console=off",
        "train.level_replay.prob=0",  # the maze recipe's replay is the local runner's only
    ]


def warm_start(
    seed: int, root: Path, sft_steps: int, cache: Path | None = None, demos: int = 4000
) -> Path:
    """One SFT warm start (in this process; the default SFT config is 600 steps on 4000 demos)
    that every mode starts from; reused from ``cache`` when it was made with the same settings."""
    from gyre import loop, sft
    from gyre.config import load_config

    overrides = bench_overrides(seed)
    key = "|".join([*overrides, f"sft.steps={sft_steps}", f"sft.demos={demos}"])
    if cache is not None and (cache / "sft" / "config.json").is_file():
        if (cache / "key.txt").read_text() == key:
            print(f"SFT warm start: reused {cache / 'sft'}", flush=True)
            return cache / "sft"
    cfg = load_config(
        None,
        [*overrides, f"run.dir={root / 'warm'}", f"sft.steps={sft_steps}", f"sft.demos={demos}"],
    )
    run_dir, device = loop.setup(cfg)
    t0 = time.perf_counter()
    warm = sft.run_sft(cfg, run_dir, device, loop.base_model_path(cfg, run_dir))
    print(f"SFT warm start: {sft_steps} steps in {time.perf_counter() - t0:.0f}s", flush=True)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        shutil.copytree(warm, cache / "sft")
        (cache / "key.txt").write_text(key)
        return cache / "sft"
    return warm
