"""End to end through ``gyre.cli.main``: a tiny 3-step run, resume to 5 steps, refusal to
overwrite, and the arithmetic env. Every run uses a 2-layer, 32-wide model on one thread."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from gyre.checkpoint.store import list_checkpoints
from gyre.cli import main

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "sft.steps=5",
    "sft.demos=20",
    "sft.batch_size=8",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "eval.episodes=4",
    "eval.every=0",
    "checkpoint.every=1",
    "checkpoint.keep=2",
    "log.console=off",
    "run.threads=1",
]

TRAIN_KEYS = {
    "step",
    "rollout/reward_mean",
    "rollout/success_rate",
    "train/loss",
    "train/kl",
    "train/clipfrac",
    "train/entropy",
    "train/grad_norm",
    "time/rollout_s",
    "time/train_s",
    "perf/rollout_tokens_per_s",
}
TOKEN_MEANS = {"train/kl", "train/clipfrac", "train/entropy"}
EVAL_KEYS = {"eval/success_greedy", "eval/success_sampled"}


def _records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _train_records(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir) if "train/loss" in r]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", *TINY, f"run.dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def maze_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("maze") / "run"
    rc = _train(run_dir, "train.steps=3")
    snapshot = (run_dir / "metrics.jsonl").read_text() if rc == 0 else ""
    return rc, run_dir, snapshot


@pytest.fixture(scope="module")
def resumed_run(maze_run):
    rc0, run_dir, _ = maze_run
    assert rc0 == 0
    rc = _train(run_dir, "train.steps=5", "run.resume=auto")
    return rc, run_dir


def test_three_step_run_outputs(maze_run):
    rc, run_dir, snapshot = maze_run
    assert rc == 0
    records = [json.loads(line) for line in snapshot.splitlines()]
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    for r in train:
        # zero-advantage rows are skipped (the default); a step that skipped every row measured
        # no token, so its token means are absent rather than a false 0.0
        # (the maze default is memoryless: a row per turn, so count tokens, not rows)
        all_skipped = r.get("train/scored_tokens") == 0.0
        assert all_skipped == (r.get("train/skipped_rows", 0) > 0 and "train/entropy" not in r)
        expected = TRAIN_KEYS - TOKEN_MEANS if all_skipped else TRAIN_KEYS
        missing = expected - r.keys()
        assert not missing, f"step {r['step']} lacks {sorted(missing)}"
        if all_skipped:
            assert not TOKEN_MEANS & r.keys() and r["rollout/frac_reward_zero_std"] == 1.0
        for key in expected - {"step"}:
            assert isinstance(r[key], float) and math.isfinite(r[key]), key
        assert 0.0 <= r["rollout/success_rate"] <= 1.0
        assert all_skipped or 0.0 <= r["train/clipfrac"] <= 1.0
        assert all_skipped or r["train/entropy"] > 0
        assert r["train/grad_norm"] >= 0
        if r["rollout/frac_reward_zero_std"] == 1.0:
            # every group has equal rewards: all advantages 0, so no loss and no gradient
            assert r["train/loss"] == 0.0 and r["train/grad_norm"] == 0.0
        else:
            assert r["train/grad_norm"] > 0
        assert r["time/rollout_s"] > 0 and r["time/train_s"] > 0
        assert r["perf/rollout_tokens_per_s"] > 0
        assert r["policy_version"] == r["step"]
    # held-out evaluation before GRPO (step 0) and after it (step 3)
    evals = [r for r in records if EVAL_KEYS <= r.keys()]
    assert [r["step"] for r in evals] == [0, 3]
    for r in evals:
        assert all(0.0 <= r[k] <= 1.0 for k in EVAL_KEYS)
    assert records[0]["step"] == 0 and records[-1]["step"] == 3

    assert (run_dir / "config.yaml").is_file()
    assert "hidden_size: 32" in (run_dir / "config.yaml").read_text()
    assert (run_dir / "sft" / "config.json").is_file()
    assert (run_dir / "sft_metrics.jsonl").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    ckpts = list_checkpoints(run_dir)
    assert [p.name for p in ckpts][-1] == "step_000003"


def test_final_model_loads_and_matches_last_checkpoint(maze_run, tmp_path):
    rc, run_dir, _ = maze_run
    assert rc == 0
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32)
    assert final.config.hidden_size == 32 and final.config.num_hidden_layers == 2
    # the final model is the step-3 checkpoint model, not the SFT or initial one
    last = AutoModelForCausalLM.from_pretrained(
        run_dir / "checkpoints" / "step_000003" / "model", dtype=torch.float32
    )
    sft = AutoModelForCausalLM.from_pretrained(run_dir / "sft", dtype=torch.float32)
    fsd, lsd, ssd = final.state_dict(), last.state_dict(), sft.state_dict()
    assert all(torch.equal(fsd[k], lsd[k]) for k in fsd)
    learned = any(r["train/grad_norm"] > 0 for r in _train_records(run_dir)[:3])
    # with all-equal rewards in every group GRPO has no gradient and AdamW leaves the weights
    assert any(not torch.equal(fsd[k], ssd[k]) for k in fsd) == learned


def test_resume_continues_at_step_four(resumed_run):
    rc, run_dir = resumed_run
    assert rc == 0
    records = _records(run_dir)
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert [r["policy_version"] for r in train[3:]] == [4.0, 5.0]
    # the pre-GRPO evaluation is not repeated on resume
    assert [r["step"] for r in records if r["step"] == 0] == [0]
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_000004", "step_000005"]
    state = json.loads((run_dir / "checkpoints" / "step_000005" / "state.json").read_text())
    assert state["policy_version"] == 5
    assert state["cursor"] == 5 * 2  # task cursor restored, not restarted
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 5


def test_resumed_checkpoint_records_its_own_step(resumed_run):
    rc, run_dir = resumed_run
    assert rc == 0
    for step in (4, 5):
        path = run_dir / "checkpoints" / f"step_{step:06d}" / "state.json"
        assert json.loads(path.read_text())["step"] == step


def test_fresh_run_in_used_dir_fails(resumed_run, capsys):
    rc0, run_dir = resumed_run
    assert rc0 == 0
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    ckpts_before = [p.name for p in list_checkpoints(run_dir)]
    capsys.readouterr()
    rc = _train(run_dir, "train.steps=5", "run.resume=never")
    assert rc != 0
    assert "run.resume=auto" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    assert [p.name for p in list_checkpoints(run_dir)] == ckpts_before


def test_second_resume_continues(resumed_run):
    rc0, run_dir = resumed_run
    assert rc0 == 0
    assert _train(run_dir, "train.steps=6", "run.resume=auto") == 0
    train = _train_records(run_dir)
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]


def test_refused_fresh_run_keeps_config(tmp_path):
    run_dir = tmp_path / "run"
    assert _train(run_dir, "train.steps=1", "sft.steps=0", "eval.episodes=0") == 0
    before = (run_dir / "config.yaml").read_text()
    assert _train(run_dir, "train.steps=2", "sft.steps=0", "eval.episodes=0") != 0
    assert (run_dir / "config.yaml").read_text() == before


# Arithmetic with answers 0..4 gives a sparse but non-zero reward after a short SFT, so GRPO
# really updates the weights; everything that shapes the run is pinned here, not left to defaults.
ARITH = [
    "env.name=arithmetic",
    "env.arithmetic.max_operand=2",
    "env.arithmetic.ops=+",
    "run.seed=0",
    "sft.lr=0.02",
    "sft.warmup_steps=0",
    "sft.lr_schedule=constant",
    "sft.noise=0.25",
    "train.group_size=4",
    "train.lr=0.001",
    # constant: the resume test extends train.steps, which re-times a decaying schedule
    "train.lr_schedule=constant",
    "train.algo.advantage=grpo",
    "train.mini_batches=1",
    "train.kl_coef=0",
    "train.sampling.temperature=1.0",
    "train.sampling.top_p=1.0",
    "train.sampling.max_new_tokens=4",
]


@pytest.fixture(scope="module")
def arith_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("arith") / "run"
    rc = _train(run_dir, *ARITH, "train.steps=2")
    snapshot = _train_records(run_dir) if rc == 0 else []
    return rc, run_dir, snapshot


def test_arithmetic_end_to_end(arith_run):
    rc, run_dir, train = arith_run
    assert rc == 0
    assert [r["step"] for r in train] == [1, 2]
    for r in train:  # a step whose 2 x 4 rows were all skipped measured no token mean
        skipped_all = r["train/skipped_rows"] == 8
        assert (TRAIN_KEYS - TOKEN_MEANS if skipped_all else TRAIN_KEYS) <= r.keys()
    assert not all(r["train/skipped_rows"] == 8 for r in train), "no learning signal"
    # single-turn env: every episode is exactly one turn
    assert all(r["rollout/turns_mean"] == 1.0 for r in train)
    assert (run_dir / "final" / "config.json").is_file()
    assert "name: arithmetic" in (run_dir / "config.yaml").read_text()


def test_resume_equals_uninterrupted_run(arith_run, tmp_path):
    """2 steps + resume to 4 gives the same steps 3-4 and weights as 4 steps in one go, exactly."""
    rc, run_dir, _ = arith_run
    assert rc == 0
    assert _train(run_dir, *ARITH, "train.steps=4", "run.resume=auto") == 0
    straight = tmp_path / "straight"
    assert _train(straight, *ARITH, "train.steps=4") == 0
    a, b = _train_records(run_dir), _train_records(straight)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert any(r["train/grad_norm"] > 0 for r in b), "no learning signal: the check is vacuous"
    for ra, rb in zip(a, b, strict=True):  # exact, not approximate (docs/operations.md)
        for key in ("rollout/reward_mean", "train/loss", "train/entropy", "train/grad_norm"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    wa = AutoModelForCausalLM.from_pretrained(run_dir / "final", dtype=torch.float32).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(straight / "final", dtype=torch.float32).state_dict()
    ws = AutoModelForCausalLM.from_pretrained(straight / "sft", dtype=torch.float32).state_dict()
    for k in wb:
        assert torch.equal(wa[k], wb[k]), k
    assert any(not torch.equal(wb[k], ws[k]) for k in wb)
