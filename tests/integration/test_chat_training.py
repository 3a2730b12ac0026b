"""A short GRPO run in message mode with the calculator tool, through ``gyre.runners.train``."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from chat_helpers import AddEnv, build_chat_model, build_chat_tokenizer
from gyre.config import load_config
from gyre.runners import train


class ShapedAddEnv(AddEnv):
    """AddEnv plus a small length bonus, so a random tiny model's groups have reward variance
    (and the update a gradient) even when no answer is right."""

    def step(self, action):
        msgs, r, done, info = super().step(action)
        return msgs, r + (0.01 * len(action) if done else 0.0), done, info


@pytest.mark.parametrize("stepwise", [False, True])
def test_message_mode_training_with_a_tool_moves_the_weights(tmp_path, monkeypatch, stepwise):
    tok = build_chat_tokenizer("chatml")
    model = build_chat_model(tok, "qwen2", seed=0)
    model.save_pretrained(tmp_path / "init")
    tok.save_pretrained(tmp_path / "init")
    # the env plug-in: this branch's env registry has built-ins only, so the test swaps the
    # factory the Rollout calls (the same place a registered plug-in would come from)
    monkeypatch.setattr("gyre.rollout.core.env_factory", lambda cfg: lambda: ShapedAddEnv(1))
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            f"model.path={tmp_path / 'init'}", f"run.dir={run_dir}", "run.threads=1",
            "log.console=off", "sft.steps=0", "train.steps=2", "train.tasks_per_step=2",
            "train.group_size=4", "train.lr=0.05", "train.mini_batches=1", "train.kl_coef=0",
            "train.sampling.max_new_tokens=12", "eval.episodes=2", "checkpoint.every=0",
            "rollout.tools=[calculator]", "rollout.max_turns=3",
            f"rollout.stepwise={str(stepwise).lower()}",
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
    moved = [
        n for (n, a), b in zip(after.state_dict().items(), before.state_dict().values())
        if not torch.equal(a, b)
    ]  # fmt: skip
    assert moved, "the update did not change any weight"
