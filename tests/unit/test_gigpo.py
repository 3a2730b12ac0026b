"""Turn-level credit: GiGPO's anchor-state step advantages and discounted per-turn returns, on
hand values; the maze's state key and the rollout's per-turn fields; a short GiGPO maze run."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

from gyre.algos import (
    ADVANTAGES,
    ESTIMATORS,
    AdvantageInputs,
    AdvantageSettings,
    Turns,
    compute_advantages,
    gigpo_advantages,
)
from gyre.algos.turns import (
    StepTerms,
    discounted_turn_returns,
    gigpo_step_advantages,
    self_loop_turns,
    turn_returns_advantages,
    turn_rewards,
)
from gyre.engines import TorchEngine
from gyre.envs.maze import MazeEnv
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.telemetry.samples import action_spans
from gyre.types import SamplingParams

S, X = (2, 1), (2, 2)  # two maze cells; the goal lies right of X


def _bump_batch() -> tuple[torch.Tensor, torch.Tensor, Turns, torch.Tensor]:
    """Two episodes of one task (group 0), both reaching the goal (reward 1 on the last turn):

    A: at S move right -> X; at X move right -> goal                       (2 turns)
    B: at S bump into a wall (stays at S); at S right -> X; at X right -> goal (3 turns)

    Each turn is one token; turn k of a row sits at position 1 + 2k (observations between).
    """
    turns = Turns(
        spans=[[(1, 2), (3, 4)], [(1, 2), (3, 4), (5, 6)]],
        states=[[S, X], [S, S, X]],
        rewards=[[0.0, 1.0], [0.0, 0.0, 1.0]],
    )
    mask = torch.zeros(2, 7)
    mask[0, [1, 3]] = 1
    mask[1, [1, 3, 5]] = 1
    return torch.tensor([1.0, 1.0]), torch.tensor([0, 0]), turns, mask


def test_gigpo_bump_turn_negative_good_turns_positive():
    rewards, groups, turns, mask = _bump_batch()
    # gamma = 0.5. Returns-from-there: A = [0.5, 1], B = [0.25, 0.5, 1].
    # Anchor S holds A0 = 0.5, B0 = 0.25 (the bump), B1 = 0.5: mean 5/12;
    #   deviations +1/12, -2/12, +1/12; unbiased var = (1 + 4 + 1) / 144 / 2 = 1/48,
    #   std = 1/sqrt(48) = 0.144338; step advantages +0.57735, -1.15470, +0.57735.
    # Anchor X holds A1 = 1, B2 = 1: equal returns -> 0.
    step = gigpo_step_advantages(rewards, groups, turns, gamma=0.5, eps=0.0)
    third = (1 / 12) * math.sqrt(48)  # 0.57735
    assert step[0] == pytest.approx([third, 0.0])
    assert step[1] == pytest.approx([-2 * third, third, 0.0])
    assert step[1][0] < 0 < step[1][1]
    # both episodes succeed: GRPO's episode advantage is 0, so A = w * A^S on each turn's token
    step = StepTerms(gamma=0.5, weight=0.5)
    adv = gigpo_advantages(rewards, groups, loss_mask=mask, turns=turns, step=step)
    want = torch.zeros(2, 7)
    want[0, 1], want[1, 1], want[1, 3] = 0.5 * third, -0.5 * 2 * third, 0.5 * third
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)  # eps = 1e-6 in the std


def test_gigpo_step_advantages_sum_to_zero_in_every_anchor_group():
    # Three episodes of group 0 and two of group 1, some states shared, rewards mixed.
    turns = Turns(
        spans=[[(1, 2), (3, 4), (5, 6)], [(1, 2), (3, 4)], [(1, 2)], [(1, 2), (3, 4)], [(1, 2)]],
        states=[["a", "b", "c"], ["a", "b"], ["a"], ["a", "z"], ["a"]],
        rewards=[[0.0, 0.5, 1.0], [0.0, 0.0], [0.2], [1.0, 0.0], [0.0]],
    )
    rewards = torch.tensor([1.5, 0.0, 0.2, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 1, 1])
    for norm in ("std", "none"):
        step = gigpo_step_advantages(rewards, groups, turns, gamma=0.9, norm=norm)
        members: dict = {}
        for i, states in enumerate(turns.states):
            for k, s in enumerate(states):
                members.setdefault((int(groups[i]), s), []).append(step[i][k])
        for key, vals in members.items():
            assert sum(vals) == pytest.approx(0.0, abs=1e-9), key
        # states seen once ("c", "z") are anchored alone: step advantage 0
        assert step[0][2] == 0.0 and step[3][1] == 0.0
    # group 1's "a" is not group 0's "a": anchors never cross task groups
    only_g1 = gigpo_step_advantages(rewards[3:], groups[3:], Turns(
        turns.spans[3:], turns.states[3:], turns.rewards[3:]), gamma=0.9)  # fmt: skip
    full = gigpo_step_advantages(rewards, groups, turns, gamma=0.9)
    assert [pytest.approx(row) for row in only_g1] == full[3:]


def test_gigpo_mean_norm_and_missing_states():
    rewards, groups, turns, _ = _bump_batch()
    step = gigpo_step_advantages(rewards, groups, turns, gamma=0.5, norm="none")
    assert step[0] == pytest.approx([1 / 12, 0.0])  # 0.5 - 5/12
    assert step[1] == pytest.approx([-2 / 12, 1 / 12, 0.0])
    # a None state (an env without a state key) is never anchored
    turns.states[1][1] = None
    step = gigpo_step_advantages(rewards, groups, turns, gamma=0.5, norm="none")
    # S now holds A0 = 0.5 and B0 = 0.25: mean 0.375
    assert step[0][0] == pytest.approx(0.125) and step[1] == pytest.approx([-0.125, 0.0, 0.0])
    with pytest.raises(ValueError, match="normalisation"):
        gigpo_step_advantages(rewards, groups, turns, norm="max")


def test_gigpo_episode_part_is_grpo_and_rows_without_turns_get_it():
    # rewards 1 and 0, gamma 1, no shared state after the first: GRPO's +-0.7071 per episode
    turns = Turns([[(1, 2), (3, 4)], []], [[S, X], []], [[0.0, 1.0], []])
    mask = torch.zeros(2, 5)
    mask[0, [1, 3]] = 1
    mask[1, [1, 2]] = 1
    rewards, groups, step = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), StepTerms(gamma=1.0)
    adv = gigpo_advantages(rewards, groups, loss_mask=mask, turns=turns, step=step, eps=0.0)
    a = 1 / math.sqrt(2)  # (1 - 0.5) / std([1, 0]) = 0.5 / 0.7071
    # row 0: turn 0 at S is anchored alone (row 1 has no turns) -> step 0; the same for turn 1
    want = torch.tensor([[0, a, 0, a, 0], [0, -a, -a, 0, 0]], dtype=torch.float32)
    torch.testing.assert_close(adv, want)


def test_turn_rewards_put_the_remainder_on_the_last_turn():
    turns = Turns([[(1, 2), (3, 4)], [(1, 2)]], [[S, X], [S]], [[0.25, 1.0], [0.0]])
    # row 0: reward functions made the total 2.0 -> last turn 1.75; row 1: 0.5 added
    assert turn_rewards(torch.tensor([2.0, 0.5]), turns) == [[0.25, 1.75], [0.5]]


def test_discounted_returns_and_turn_returns_estimator():
    # r = [0.5, 0, 1], gamma 0.9: R2 = 1, R1 = 0.9, R0 = 0.5 + 0.81 = 1.31
    assert discounted_turn_returns([0.5, 0.0, 1.0], 0.9) == pytest.approx([1.31, 0.9, 1.0])
    turns = Turns(
        spans=[[(1, 2), (3, 4), (5, 6)], [(1, 2)]],
        states=[[S, S, X], [S]],
        rewards=[[0.5, 0.0, 1.0], [0.0]],
    )
    mask = torch.zeros(2, 7)
    mask[0, [1, 3, 5]] = 1
    mask[1, 1] = 1
    adv = turn_returns_advantages(
        torch.tensor([1.5, 0.0]), torch.tensor([0, 0]), loss_mask=mask, turns=turns, gamma=0.9,
        eps=0.0,
    )  # fmt: skip
    # group episode returns R_{i,0} = [1.31, 0]: mean 0.655, unbiased std 1.31 / sqrt(2) = 0.92631
    mean, std = 0.655, 1.31 / math.sqrt(2)
    want = torch.zeros(2, 7)
    want[0, 1], want[0, 3], want[0, 5] = (1.31 - mean) / std, (0.9 - mean) / std, (1 - mean) / std
    want[1, 1] = (0.0 - mean) / std
    torch.testing.assert_close(adv, want)


def test_turn_returns_with_final_reward_and_gamma_one_is_grpo():
    turns = Turns([[(1, 2), (3, 4)], [(1, 2)]], [[S, X], [S]], [[0.0, 1.0], [0.0]])
    mask = torch.zeros(2, 5)
    mask[0, [1, 3]] = 1
    mask[1, 1] = 1
    rewards, groups = torch.tensor([1.0, 0.0]), torch.tensor([0, 0])
    inputs = AdvantageInputs(loss_mask=mask, turns=turns)
    adv, _ = compute_advantages(
        "turn_returns", rewards, groups, inputs, AdvantageSettings(gamma=1.0)
    )
    grpo, _ = compute_advantages("grpo", rewards, groups)
    torch.testing.assert_close(adv, grpo[:, None] * mask)


def test_registered_and_needs_turns():
    assert {"gigpo", "turn_returns"} <= set(ADVANTAGES) and ESTIMATORS["gigpo"].needs_turns
    assert ESTIMATORS["gigpo"].level == "token"
    with pytest.raises(ValueError, match="turns"):
        compute_advantages(
            "gigpo", torch.ones(2), torch.zeros(2), AdvantageInputs(torch.ones(2, 3))
        )


def test_maze_state_key_is_the_cell_and_a_bump_keeps_it():
    env = MazeEnv(size=5, wall_density=0.3, min_distance=4)
    env.reset(3)
    assert env.state_key() == env.start
    for move, (dr, dc) in {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}.items():
        r, c = env.pos[0] + dr, env.pos[1] + dc
        if not (0 <= r < env.size and 0 <= c < env.size) or env.walls[r, c]:
            before = env.state_key()
            _, _, _, info = env.step(move)
            assert info["state"] == before == env.state_key()  # the bump stays put
            return
    pytest.skip("no wall next to the start of maze 3")


def test_rollout_records_turn_spans_states_and_rewards(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=0, sharp=True)
    engine = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    params = SamplingParams(1.0, 1.0, 3, stop_ids(tokenizer), seed=5)

    def make_env():
        return MazeEnv(size=5, wall_density=0.3, min_distance=4, budget_factor=1.5)

    trajs = run_episodes(make_env, engine, tokenizer, [3, 8], 2, params)
    assert max(t.num_turns for t in trajs) > 1
    for t in trajs:
        assert len(t.turn_spans) == len(t.turn_states) == len(t.turn_rewards) == t.num_turns
        assert t.turn_spans == action_spans(t.loss_mask)
        assert sum(t.turn_rewards) == t.reward
        env = make_env()
        env.reset(t.task_seed)
        for k, (s, e) in enumerate(t.turn_spans):  # replay: the state before each action
            assert t.turn_states[k] == env.state_key()
            env.step(tokenizer.decode(t.token_ids[s:e], skip_special_tokens=True))


def test_gigpo_maze_run_trains(tmp_path):
    """A short maze run with advantage=gigpo through the local runner: it runs, and its update
    moves the weights away from the SFT start (seed 0: step 2 has successes, so nonzero
    advantages; a held-out improvement is out of reach of this ~25 s budget)."""
    from safetensors.torch import load_file

    import gyre.runners
    from gyre.config import load_config

    run = tmp_path / "run"
    cfg = load_config(None, [
        "model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
        "sft.steps=100", "sft.demos=200", "sft.batch_size=16", "sft.lr=0.01",
        "train.steps=2", "train.tasks_per_step=6", "train.group_size=4", "train.lr=0.003",
        "train.algo.advantage=gigpo", "train.algo.gamma=0.9", "train.algo.gigpo_step_weight=1",
        "eval.episodes=4", "eval.every=0", "checkpoint.every=0", "log.console=off",
        "run.threads=1", f"run.dir={run}",
    ])  # fmt: skip
    gyre.runners.train(cfg)
    before, after = (
        load_file(run / "sft" / "model.safetensors"),
        load_file(run / "final" / "model.safetensors"),
    )
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("train/grad_norm", 0.0) > 0 for r in rows)


def test_self_loop_turns_are_those_that_leave_the_state_key_unchanged():
    _, _, turns, _ = _bump_batch()
    assert self_loop_turns(turns) == [[False, False], [True, False, False]]
    # the last turn has no key after it; a missing key is never a self-loop
    odd = Turns(spans=[[(1, 2), (3, 4)], [(1, 2), (3, 4)]], states=[[S, S], [None, None]])
    assert self_loop_turns(odd) == [[True, False], [False, False]]


def test_nonpositive_self_loops_take_the_positive_part_off_a_bump():
    """Episode B bumps at S, then both reach the goal; a third episode C fails (reward 0), so
    the episode advantage of A and B is positive and the bump inherits it."""
    rewards = torch.tensor([1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0])
    base = _bump_batch()[2]
    turns = Turns(
        spans=[*base.spans, [(1, 2), (3, 4)]],
        states=[*base.states, [S, S]],  # C bumps twice at S
        rewards=[*base.rewards, [0.0, 0.0]],
    )
    mask = torch.zeros(3, 7)
    mask[0, [1, 3]] = 1
    mask[1, [1, 3, 5]] = 1
    mask[2, [1, 3]] = 1
    kw = dict(loss_mask=mask, turns=turns, eps=0.0)
    step = StepTerms(gamma=0.5, weight=0.1)
    keep = gigpo_advantages(rewards, groups, **kw, step=step)
    clamp = gigpo_advantages(rewards, groups, **kw, step=replace(step, self_loops="nonpositive"))
    # GRPO's episode advantage: rewards 1, 1, 0 -> mean 2/3, unbiased std 1/sqrt(3)
    ep = (1 - 2 / 3) * math.sqrt(3)  # +0.57735 for A and B, -1.1547 for C
    # Anchor S: A0 0.5, B0 0.25, B1 0.5, C0 0, C1 0 (C fails: all returns 0). mean 0.25,
    # unbiased std sqrt((0.0625 + 0 + 0.0625 + 0.0625 + 0.0625) / 4) = 0.25:
    # step advantages +1, 0, +1, -1, -1.
    assert keep[1, 1] == pytest.approx(ep + 0.1 * 0.0)  # B's bump: positive before the clamp
    assert clamp[1, 1] == 0.0  # ... and 0 after it
    assert clamp[1, 3] == pytest.approx(ep + 0.1 * 1.0) == keep[1, 3]  # the move out: kept
    assert clamp[2, 1] == pytest.approx(-2 * ep - 0.1) == keep[2, 1]  # C's first bump: negative
    assert clamp[2, 3] == keep[2, 3]  # C's last turn: no key after it, never clamped
    torch.testing.assert_close(clamp[0], keep[0])  # A has no self-loop
    # turn_returns the same way (gamma 0.9: B's bump returns 0.81 against the episode
    # returns' mean (0.9 + 0.81 + 0) / 3, so it is positive before the clamp)
    tk = turn_returns_advantages(rewards, groups, loss_mask=mask, turns=turns, gamma=0.9)
    tc = turn_returns_advantages(
        rewards, groups, loss_mask=mask, turns=turns, gamma=0.9, self_loops="nonpositive"
    )
    assert tk[1, 1] > 0 and tc[1, 1] == 0.0
    mask_other = torch.ones_like(tk, dtype=torch.bool)
    mask_other[1, 1] = False
    torch.testing.assert_close(tc[mask_other], tk[mask_other])
    with pytest.raises(ValueError, match="self_loops"):
        gigpo_advantages(rewards, groups, **kw, step=replace(step, self_loops="clip"))


def test_self_loop_advantage_needs_a_turn_estimator():
    from gyre.config import ConfigError, load_config

    cfg = load_config(None, ["train.algo.self_loop_advantage=nonpositive"])
    assert cfg.train.algo.self_loop_advantage == "nonpositive"
    with pytest.raises(ConfigError, match="self_loop_advantage"):
        load_config(
            None, ["train.algo.self_loop_advantage=nonpositive", "train.algo.advantage=grpo"]
        )
