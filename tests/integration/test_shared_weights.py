"""engine.weight_sync=shared (the torch engine samples from the trainer's own parameters, no
copy) gives exactly the run of weight_sync=memory; bad combinations are refused by name."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gyre.cli import main
from gyre.config import Config
from helpers import TINY_ARITHMETIC_RUN

BASE = [
    *TINY_ARITHMETIC_RUN,
    "sft.steps=30",
    "sft.lr=0.02",
    "sft.demos=40",
    "sft.batch_size=8",
    "train.tasks_per_step=4",  # enough groups that every step has a reward spread
    "train.group_size=4",
    "train.lr=0.01",
    "train.steps=3",
    "train.sampling.max_new_tokens=3",
    "eval.episodes=8",
    "eval.every=0",
    "checkpoint.every=0",
    "log.console=off",
    "run.threads=1",
]


def test_shared_weights_run_equals_memory_sync(tmp_path):
    recs = {}
    for mode in ("memory", "shared"):
        run_dir = tmp_path / mode
        assert main(["train", *BASE, f"engine.weight_sync={mode}", f"run.dir={run_dir}"]) == 0
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        recs[mode] = [r for r in map(json.loads, lines) if "train/loss" in r]
        recs[mode + "_summary"] = json.loads((run_dir / "summary.json").read_text())
    assert len(recs["memory"]) == len(recs["shared"]) == 3
    # the policy really moves between rollouts (else any sync would pass)
    assert all(r["train/grad_norm"] > 0 for r in recs["memory"])
    assert recs["memory"][-1]["sync/bytes"] > 0
    for a, b in zip(recs["memory"], recs["shared"], strict=True):
        for key in ("rollout/reward_mean", "train/loss", "train/grad_norm", "rollout/tokens"):
            if key in a:
                assert a[key] == b[key], key
    assert recs["shared"][-1]["sync/bytes"] == 0.0
    assert recs["memory_summary"]["after"] == recs["shared_summary"]["after"]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"engine": {"weight_sync": "shared", "sync_every": 2}}, "sync_every"),
        ({"engine": {"weight_sync": "shared", "kind": "http", "urls": ["http://x:1"]}}, "kind"),
        ({"engine": {"weight_sync": "shared"}, "model": {"lora": {"rank": 4}}}, "lora"),
        ({"engine": {"weight_sync": "shared"}, "runner": "ray"}, "runner=ray"),
    ],
)
def test_shared_weights_refuses_what_it_cannot_do(overrides, field):
    with pytest.raises(ValidationError, match=field):
        Config.model_validate(overrides)
