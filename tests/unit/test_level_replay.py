"""The level-replay sampler on hand cases, the Ray refusal, and the three disjoint seed ranges."""

from __future__ import annotations

import pytest

from gyre.config import ConfigError, LevelReplayConfig, load_config
from gyre.rollout.evaluate import (
    EVAL_SEED_BASE,
    MAX_EPISODES,
    VAL_SEED_BASE,
    eval_seeds,
    train_seed,
    validation_seeds,
)
from gyre.rollout.replay import LevelReplay
from gyre.types import Trajectory


def _traj(group: int, success: bool) -> Trajectory:
    return Trajectory([0, 1], [0, 1], [0.0, -1.0], float(success), group, 0, 1, success, group)


def test_only_mixed_outcome_tasks_are_kept_and_scored_by_reward_std():
    plr = LevelReplay(LevelReplayConfig(prob=0.5, buffer_size=2), run_seed=0)
    batch = [_traj(0, s) for s in (1, 0, 0, 0)] + [_traj(1, s) for s in (1, 1, 1, 1)]
    batch += [_traj(2, s) for s in (1, 1, 0, 0)]
    plr.update(batch)
    # group 0: rewards 1,0,0,0: mean 1/4, squared deviations 9/16 + 3/16 = 3/4, / 3 -> std 0.5
    # group 2: 1,1,0,0: 4 * 1/4 = 1, / 3 -> std 0.57735; group 1 all success: not kept
    assert plr.scores == pytest.approx({0: 0.5, 2: 3**-0.5})
    plr.update([_traj(3, s) for s in (1, 1, 1, 0)])  # std 0.5, ties with task 0: older goes
    assert set(plr.scores) == {2, 3}
    plr.update([_traj(2, s) for s in (0, 0, 0, 0)])  # replayed, now all failures: leaves
    assert set(plr.scores) == {3}


def test_draw_mixes_replays_and_new_tasks_deterministically():
    plr = LevelReplay(LevelReplayConfig(prob=1.0, temperature=0.3), run_seed=0)
    plr.scores = {4: 0.9, 7: 0.1}
    tasks, new = plr.draw(4, next_task=10, step=3, round_=0)
    # every slot replays while candidates are left (prob 1); a task is never drawn twice
    assert sorted(tasks[:2]) == [4, 7] and tasks[2:] == [10, 11] and new == 2
    assert plr.draw(4, 10, 3, 0) == (tasks, new)  # (seed, step, round) fixes the draw
    assert plr.draw(2, 10, 3, 0, exclude=[4, 7]) == ([10, 11], 2)
    # rank prioritisation: (1/1)^(1/0.3) vs (1/2)^(1/0.3) -> 0.9106 / 0.0894
    p = plr.probabilities([4, 7])
    assert p[0] == pytest.approx(1 / (1 + 0.5 ** (1 / 0.3)))
    off = LevelReplay(LevelReplayConfig(prob=0.0), run_seed=0)
    off.scores = {4: 0.9}
    assert off.draw(3, 5, 1, 0) == ([5, 6, 7], 3)


def test_state_round_trip():
    plr = LevelReplay(LevelReplayConfig(prob=0.5), run_seed=0)
    plr.scores = {3: 0.25, 9: 0.5}
    other = LevelReplay(LevelReplayConfig(prob=0.5), run_seed=0)
    other.load_state_dict(plr.state_dict())
    assert other.scores == plr.scores


def test_level_replay_refused_under_ray_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.level_replay\.prob"):
        load_config(None, ["runner=ray", "train.level_replay.prob=0.5"])
    load_config(None, ["runner=ray"])  # off by default


def test_seed_ranges_never_overlap():
    train_max = max(train_seed(s, stream, i) for s in range(3) for stream in (1, 2)
                    for i in range(200))  # fmt: skip
    assert train_max < EVAL_SEED_BASE
    held = eval_seeds(5)
    val = validation_seeds(5)
    assert held[0] == EVAL_SEED_BASE and val[0] == VAL_SEED_BASE and not set(held) & set(val)
    # the largest allowed held-out range ends exactly where validation begins
    assert EVAL_SEED_BASE + MAX_EPISODES == VAL_SEED_BASE
    with pytest.raises(ValueError, match="episodes"):
        eval_seeds(MAX_EPISODES + 1)
    with pytest.raises(ConfigError, match=r"eval\.episodes"):
        load_config(None, [f"eval.episodes={MAX_EPISODES + 1}"])
    with pytest.raises(ConfigError, match=r"eval\.validation_episodes"):
        load_config(None, ["env.name=dataset", "eval.validation_episodes=4"])
