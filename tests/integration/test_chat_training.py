"""A short GRPO run in message mode with the calculator tool, through ``gyre.runners.train``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from chat_helpers import build_chat_model, build_chat_tokenizer
from gyre.config import load_config
from gyre.runners import train


@pytest.mark.parametrize("stepwise", [False, True])
def test_message_mode_training_with_a_tool_moves_the_weights(tmp_path, stepwise):
    tok = build_chat_tokenizer("chatml")
    model = build_chat_model(tok, "qwen2", seed=0)
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.path={tmp_path / 'init'}", f"run.dir={run_dir}", "run.threads=1",
            "log.console=off", "sft.steps=0", "train.steps=2", "train.tasks_per_step=2",
            "train.group_size=4", "train.lr=0.05", "train.mini_batches=1", "train.kl_coef=0",
            "train.sampling.max_new_tokens=12", "eval.episodes=2", "checkpoint.every=0",
            "env.name=chat_helpers:ShapedAddEnv", "rollout.tools=[calculator]",
            "rollout.max_turns=3",
            f"rollout.stepwise={str(stepwise).lower()}",
            "train.algo.advantage=grpo",  # step-wise samples take an outcome estimator
        ],
    )  # fmt: skip
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 2
    for r in steps:
        assert 0.0 <= r["rollout/template_drift"] <= 1.0 and "rollout/tool_errors" in r
        assert r["rollout/template_drift"] == 0.0  # ChatML is prefix-stable
    after = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    before = build_chat_model(tok, "qwen2", seed=0)
    init = before.state_dict()
    moved = [n for n, a in after.state_dict().items() if not torch.equal(a, init[n])]
    assert moved, "the update did not change any weight"
