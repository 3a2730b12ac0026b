"""``train.sampling.greedy_per_group``: the last episode of each GRPO group is the policy's
greedy one, so the update sees the failures that held-out (greedy) evaluation sees."""

from __future__ import annotations

import json

import pytest
import torch

from gyre.algos.correction import rollout_is_weights
from gyre.config import ConfigError, load_config
from gyre.engines import TorchEngine
from gyre.rollout import Rollout
from gyre.rollout.core import rollout_metrics

BASE = ["env.maze.size=5", "train.group_size=3", "train.sampling.max_new_tokens=2"]


def _rollout(tokenizer, model, *extra: str) -> Rollout:
    engine = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    return Rollout(load_config(None, [*BASE, *extra]), engine, tokenizer)


def test_each_group_ends_with_the_greedy_episode(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=4, sharp=True)
    mixed, _ = _rollout(tokenizer, model, "train.sampling.greedy_per_group=1").play(5, 3, seed=7)
    greedy, _ = _rollout(tokenizer, model, "train.sampling.temperature=0").play(5, 3, seed=7)
    assert len(mixed) == 9
    assert [t.group_id for t in mixed] == [5, 5, 5, 6, 6, 6, 7, 7, 7]
    assert [t.traj_id for t in mixed[:3]] == ["5:0", "5:1", "5:2"]
    for k in range(3):
        g, sampled = mixed[3 * k + 2], mixed[3 * k : 3 * k + 2]
        assert g.info.get("greedy") and not any(t.info.get("greedy") for t in sampled)
        # the very episode that temperature 0 plays (every sample of a greedy run is the same)
        assert g.token_ids == greedy[3 * k].token_ids == greedy[3 * k + 1].token_ids
        assert g.task_seed == sampled[0].task_seed == greedy[3 * k].task_seed
        # picked with probability 1 by the greedy sampler
        assert g.rollout_logprobs == [0.0] * len(g.token_ids)
        for t in sampled:
            assert all(lp < 0 for lp, m in zip(t.rollout_logprobs, t.loss_mask, strict=True) if m)
    # the sharp model at temperature 0.6 does not just replay its greedy episode
    assert any(t.token_ids != mixed[3 * (i // 3) + 2].token_ids for i, t in enumerate(mixed))
    m = rollout_metrics(mixed, 3)
    want = sum(mixed[3 * k + 2].success for k in range(3)) / 3
    assert m["rollout/greedy_success_rate"] == pytest.approx(want)
    assert "rollout/greedy_success_rate" not in rollout_metrics(greedy, 3)


def test_greedy_tokens_get_the_tempered_policy_as_rollout_is_weight():
    """With ``train.algo.rollout_is``, a greedy token's weight is pi_old(token) / 1."""
    old = torch.log(torch.tensor([[0.9, 0.5, 0.25, 0.7]]))
    mask = torch.tensor([[1, 1, 1, 0]])
    w, _ = rollout_is_weights(old, torch.zeros_like(old), mask, "truncate", threshold=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.9, 0.5, 0.25, 0.0]]))


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["train.sampling.temperature=0"], "temperature"),
        (["train.algo.old_logprobs=rollout"], "old_logprobs"),
        (["train.sampling.greedy_per_group=2"], "greedy_per_group"),
    ],
)
def test_bad_settings_name_the_field(extra, field):
    args = ["train.sampling.greedy_per_group=1", *extra]
    with pytest.raises(ConfigError, match=field):
        load_config(None, args)


def test_a_maze_run_with_greedy_episodes_logs_their_success(tmp_path):
    import gyre.runners

    run = tmp_path / "run"
    cfg = load_config(None, [
        "model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
        "sft.steps=30", "sft.demos=100", "sft.batch_size=16", "sft.lr=0.01",
        "train.steps=2", "train.tasks_per_step=4", "train.group_size=4",
        "train.sampling.greedy_per_group=1", "train.algo.rollout_is=truncate",
        "eval.episodes=4", "eval.every=0", "checkpoint.every=0", "log.console=off",
        "run.threads=1", f"run.dir={run}",
    ])  # fmt: skip
    gyre.runners.train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/greedy_success_rate" in r]
    assert len(steps) == 2
    assert all(0.0 <= r["rollout/greedy_success_rate"] <= 1.0 for r in steps)
