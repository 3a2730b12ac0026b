"""A tiny end-to-end run per algorithm through ``gyre.cli.main``: 3 GRPO-loop steps on the
arithmetic env from one shared SFT checkpoint, finishing with finite metrics and the
algorithm's own metrics present. Every run: 2-layer 32-wide model, one thread, 2 tasks x 4."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gyre.cli import main
from helpers import TINY_ARITHMETIC_RUN

BASE = [
    *TINY_ARITHMETIC_RUN,
    "train.tasks_per_step=2",
    "train.group_size=4",
    "train.lr=0.001",
    "train.sampling.max_new_tokens=3",
    "eval.episodes=4",
    "eval.every=0",
    "checkpoint.every=0",
    "log.console=off",
    "run.threads=1",
]

ALGOS: dict[str, tuple[list[str], set[str]]] = {
    "grpo": ([], set()),
    "dr_grpo": (["train.algo.advantage=dr_grpo", "train.loss_agg=seq-mean-token-sum-norm"], set()),
    "rloo": (["train.algo.advantage=rloo", "train.loss_agg=seq-mean-token-sum"], set()),
    "reinforce_pp": (
        [
            "train.algo.advantage=reinforce_pp",
            "train.kl_coef=0.01",
            "train.algo.kl_in=reward",
            "train.algo.kl_type=k1",
            "train.algo.gamma=0.99",
        ],
        {"train/kl"},
    ),
    "reinforce_pp_baseline": (["train.algo.advantage=reinforce_pp_baseline"], set()),
    "gae_critic": (
        ["train.algo.advantage=gae", "train.algo.lam=0.95", "train.algo.value_model=critic"],
        {"train/value_loss", "train/vf_clipfrac"},
    ),
    "gae_head": (
        ["train.algo.advantage=gae", "train.algo.value_model=head"],
        {"train/value_loss"},
    ),
    "gspo": (
        ["train.algo.policy_loss=gspo", "train.clip_eps=3e-4", "train.algo.clip_eps_high=4e-4"],
        set(),
    ),
    "cispo": (
        ["train.algo.policy_loss=cispo", "train.clip_eps=1.0", "train.algo.clip_eps_high=0.28"],
        set(),
    ),
    "reinforce": (["train.algo.policy_loss=reinforce", "train.mini_batches=1"], set()),
    "dapo": (
        [
            "train.dapo.dynamic_sampling=true",
            "train.dapo.max_rounds=3",
            "train.dapo.overlong_buffer_len=2",
            "train.dapo.mask_truncated=true",
            "train.algo.clip_eps_high=0.28",
            "train.loss_agg=token-mean",
        ],
        {"rollout/frac_groups_dropped", "rollout/truncated_frac", "rollout/overlong_penalty_mean"},
    ),
    "ppo_epochs_kl_tis": (
        [
            "train.algo.ppo_epochs=2",
            "train.algo.mini_batch_size=4",
            "train.algo.dual_clip=3",
            "train.kl_coef=0.01",
            "train.algo.kl_type=k2",
            "train.algo.entropy_coef=0.01",
            "train.algo.rollout_is=truncate",
            "train.algo.rollout_is_level=sequence",
        ],
        {"train/kl", "train/is_weight", "train/rollout_logprob_gap", "train/ppo_kl"},
    ),
    "masked_is": (["train.algo.rollout_is=mask"], {"train/is_affected_frac"}),
}


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("algos") / "sft_run"
    sft = ["sft.steps=30", "sft.demos=40", "sft.batch_size=8", "sft.lr=0.02"]
    assert main(["sft", *BASE, *sft, f"run.dir={run_dir}"]) == 0
    return run_dir / "sft"


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_three_steps_per_algorithm(name, sft_dir, tmp_path):
    overrides, expected = ALGOS[name]
    run_dir = tmp_path / name
    args = ["train", *BASE, f"model.path={sft_dir}", "sft.steps=0", "train.steps=3"]
    assert main([*args, *overrides, f"run.dir={run_dir}"]) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        missing = expected - r.keys()
        assert not missing, f"{name} step {r['step']} lacks {sorted(missing)}"
        for key, value in r.items():
            assert math.isfinite(value), f"{name} step {r['step']}: {key} = {value}"
        assert r["train/optimizer_steps"] >= 1 and r["train/tokens"] > 0
    assert (run_dir / "final" / "config.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0.0 <= summary["after"]["eval/success_greedy"] <= 1.0


@pytest.mark.parametrize("value_model", ["critic", "head"])
def test_ppo_resume_restores_the_value_model(sft_dir, tmp_path, value_model):
    """PPO 2 steps + resume to 3 equals 3 steps in one go: the checkpoint carries the value
    model and its optimizer (without them the resumed critic would restart at V = 0)."""
    gae = ["train.algo.advantage=gae", f"train.algo.value_model={value_model}", "sft.steps=0"]
    # constant LR: a decaying schedule spans train.steps, which this resume extends
    args = ["train", *BASE, *gae, f"model.path={sft_dir}", "train.lr_schedule=constant"]
    resumed, straight = tmp_path / "resumed", tmp_path / "straight"
    assert main([*args, "train.steps=2", f"run.dir={resumed}"]) == 0
    assert (resumed / "checkpoints" / "step_000002" / "value_model.pt").is_file()
    assert main([*args, "train.steps=3", "run.resume=auto", f"run.dir={resumed}"]) == 0
    assert main([*args, "train.steps=3", f"run.dir={straight}"]) == 0
    recs = []
    for d in (resumed, straight):
        lines = (d / "metrics.jsonl").read_text().splitlines()
        recs.append({r["step"]: r for r in map(json.loads, lines) if "train/loss" in r})
    assert recs[0][3]["train/value_loss"] > 0
    for key in ("rollout/reward_mean", "train/loss", "train/value_loss", "train/grad_norm"):
        assert recs[0][3][key] == pytest.approx(recs[1][3][key], rel=1e-4, abs=1e-6), key
