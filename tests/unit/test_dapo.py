"""DAPO sampling: dynamic sampling refills the batch with groups that have reward variance, up
to a cap on rounds; the soft overlong penalty; truncated-response masking."""

from __future__ import annotations

import pytest
import torch

from gyre.config import DapoConfig, SamplingConfig
from gyre.rollout.dapo import sample_groups
from gyre.trainer.batch import collate
from gyre.trainer.overlong import apply_overlong, mask_truncated, overlong_penalty
from gyre.types import Trajectory

CPU = torch.device("cpu")


def _traj(reward, group, task, n_gen=2, truncated=False):
    ids = [1] + [5] * n_gen
    mask = [0] + [1] * n_gen
    return Trajectory(ids, mask, [0.0] * len(ids), reward, group, 0, 1, reward > 0, task,
                      truncated=truncated)  # fmt: skip


class ScriptedRollout:
    """generate(n, round): task k (a global counter) has rewards script[k] for its group."""

    def __init__(self, script):
        self.script = script
        self.next_task = 0
        self.calls = []

    def __call__(self, n_tasks, round_):
        self.calls.append((n_tasks, round_))
        out = []
        for local in range(n_tasks):
            task = self.next_task
            self.next_task += 1
            out += [_traj(r, local, task) for r in self.script[task]]
        return out


def test_disabled_is_one_plain_call():
    gen = ScriptedRollout([[0, 0], [1, 0]])
    trajs, metrics = sample_groups(gen, 2)
    assert gen.calls == [(2, 0)] and metrics == {} and len(trajs) == 4


def test_dynamic_sampling_refills_until_full():
    # round 0: tasks 0..3, only task 1 and 3 have variance; round 1 asks for 2: task 4 all-equal,
    # task 5 varies; round 2 asks for 1: task 6 varies
    script = [[1, 1], [1, 0], [0, 0], [0, 1], [1, 1], [0, 1], [1, 0], [1, 0]]
    gen = ScriptedRollout(script)
    trajs, m = sample_groups(gen, 4, dynamic=True, max_rounds=5)
    assert gen.calls == [(4, 0), (2, 1), (1, 2)]
    assert [t.task_seed for t in trajs] == [1, 1, 3, 3, 5, 5, 6, 6]
    assert [t.group_id for t in trajs] == [0, 0, 1, 1, 2, 2, 3, 3]  # renumbered, contiguous
    assert m["rollout/frac_groups_dropped"] == pytest.approx(3 / 7)
    assert m["rollout/sampling_rounds"] == 3.0 and m["rollout/groups_kept"] == 4.0


def test_dynamic_sampling_round_cap():
    script = [[0, 0], [1, 0], [0, 0], [1, 1], [0, 0], [0, 0], [0, 0], [0, 0]]
    gen = ScriptedRollout(script)
    trajs, m = sample_groups(gen, 3, dynamic=True, max_rounds=2)
    assert gen.calls == [(3, 0), (2, 1)]  # capped: trains on the one group with variance
    assert [t.task_seed for t in trajs] == [1, 1] and m["rollout/groups_kept"] == 1.0
    gen = ScriptedRollout([[0, 0]] * 4)
    trajs, m = sample_groups(gen, 2, dynamic=True, max_rounds=2)
    assert [t.task_seed for t in trajs] == [2, 2, 3, 3]  # nothing varied: the last round
    assert m["rollout/frac_groups_dropped"] == 1.0 and m["rollout/groups_kept"] == 0.0


def test_overlong_penalty_hand_values():
    # L_max 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 beyond 10
    pen = overlong_penalty(torch.tensor([3, 6, 7, 8, 10, 14]), 10, 4, factor=1.0)
    torch.testing.assert_close(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    pen = overlong_penalty(torch.tensor([8]), 10, 4, factor=0.5)
    assert pen.item() == pytest.approx(-0.25)
    assert torch.all(overlong_penalty(torch.tensor([99]), 10, 0) == 0)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 3, 4)


def test_mask_truncated_and_apply_overlong():
    trajs = [_traj(1.0, 0, 0, n_gen=2), _traj(0.0, 0, 0, n_gen=5, truncated=True)]
    batch = collate(trajs, 0, CPU)
    metrics: dict[str, float] = {}
    cfg = DapoConfig(overlong_buffer_len=2, mask_truncated=True)
    shaped = apply_overlong(
        torch.tensor([1.0, 0.0]), trajs, batch, cfg, SamplingConfig(max_new_tokens=4), metrics
    )
    # L_max = max_new_tokens = 4, buffer 2: 2 tokens free, 5 tokens -> -1
    torch.testing.assert_close(shaped, torch.tensor([1.0, -1.0]))
    assert batch.loss_mask.sum(dim=1).tolist() == [2.0, 0.0]
    assert metrics["rollout/truncated_frac"] == 0.5
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(-0.5)
    with pytest.raises(ValueError, match="2 rows"):
        mask_truncated(batch, trajs[:1])


def test_rollout_marks_truncated_episodes(make_tiny_model, tokenizer):
    """``Trajectory.truncated`` is set exactly when the episode's last completion hit the limit."""
    from gyre.config import EnvConfig
    from gyre.engines import TorchEngine
    from gyre.envs import env_factory
    from gyre.rollout.episodes import run_episodes, stop_ids
    from gyre.types import SamplingParams
    from helpers import RecordingEngine

    engine = RecordingEngine(TorchEngine(make_tiny_model(seed=0), tokenizer.pad_token_id))
    make_env = env_factory(EnvConfig(name="arithmetic"))
    params = SamplingParams(1.0, 1.0, 2, stop_ids(tokenizer), seed=0)
    trajs = run_episodes(make_env, engine, tokenizer, [1, 2, 3, 4], 4, params)
    reasons = [c.finish_reason for c in engine.calls[-1].completions]
    assert len(reasons) == len(trajs)  # single turn: one call holds every last completion
    assert [t.truncated for t in trajs] == [r == "length" for r in reasons]
    assert any(t.truncated for t in trajs)
