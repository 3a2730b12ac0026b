"""Time generating the default SFT demonstrations vs loading them from the resume cache.

python bench/sft_demo_cache.py
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from gyre.checkpoint.resume import cached
from gyre.config import load_config
from gyre.envs import env_factory
from gyre.models.build import build_char_tokenizer
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.evaluate import train_seed


def main() -> None:
    cfg = load_config(None, [])
    tok, make = build_char_tokenizer(), env_factory(cfg.env)
    rng = np.random.default_rng([0, 1])
    path = Path(tempfile.mkdtemp()) / "sft_demos.pt"

    def build() -> list:
        return [
            demonstrate(make, tok, train_seed(0, 1, k), cfg.sft.noise, rng)
            for k in range(cfg.sft.demos)
        ]

    t0 = time.perf_counter()
    cached(path, {"k": 1}, build)
    t1 = time.perf_counter()
    cached(path, {"k": 1}, build)
    t2 = time.perf_counter()
    print(
        f"{cfg.sft.demos} demos: generate+save {t1 - t0:.1f} s, load {t2 - t1:.2f} s, "
        f"{path.stat().st_size / 1e6:.1f} MB"
    )


if __name__ == "__main__":
    main()
