"""env.name=minigrid: MiniGrid envs as message-mode envs with RGB images and their mission."""

from __future__ import annotations

import sys

import numpy as np
import pytest

pytest.importorskip("minigrid")

from gyre.config import ConfigError, load_config
from gyre.envs import env_factory
from gyre.envs.base import Demonstrator, is_message_env
from gyre.envs.minigrid import ACTIONS, MiniGridEnv, parse_minigrid_action
from gyre.telemetry.frames import message_images, replay_frames


def _make(*overrides: str):
    return env_factory(load_config(None, ["env.name=minigrid", *overrides]).env)


def _parts(msgs):
    (msg,) = msgs
    assert msg["role"] == "user"
    image, text = msg["content"]
    assert image["type"] == "image" and text["type"] == "text"
    return np.asarray(image["image"]), text["text"]


def _solve(env, seed: int):
    rng = np.random.default_rng(0)
    env.reset(seed)
    while True:
        _, r, done, info = env.step(env.expert_action(rng))
        if done:
            return r, info


def test_reset_gives_the_view_and_the_mission():
    env = _make()()
    assert is_message_env(env) and isinstance(env, Demonstrator)
    img, text = _parts(env.reset(0))
    assert img.shape == (56, 56, 3) and img.dtype == np.uint8  # 7x7 tiles of 8 px
    assert text.startswith("Mission: get to the green goal square. The image is your view")
    assert "100 steps" in text and "left, right, forward, pickup, drop, toggle or done" in text
    full = _make("env.minigrid.image=full", "env.minigrid.tile_size=16")()
    img, text = _parts(full.reset(0))
    assert img.shape == (80, 80, 3) and "whole grid" in text  # 5x5 tiles of 16 px


def test_pixels_are_deterministic_per_seed():
    make = _make("env.minigrid.env_id=MiniGrid-Empty-Random-6x6-v0", "env.minigrid.image=full")
    for seed in (1, 2**31 + 4):
        a, b = make(), make()
        fa = replay_frames(a, seed, ["forward", "left", "forward", "x", "right"])
        fb = replay_frames(b, seed, ["forward", "left", "forward", "x", "right"])
        assert len(fa) == 6
        assert all(
            np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(fa, fb, strict=True)
        )
    starts = {np.asarray(message_images(make().reset(s))[0]).tobytes() for s in range(12)}
    assert len(starts) > 1  # the random start depends on the seed


def test_action_parsing():
    assert parse_minigrid_action(" Forward.\n") == ACTIONS.index("forward") == 2
    assert [parse_minigrid_action(a) for a in ACTIONS] == list(range(7))
    for bad in ("", "go", "forward left", "3", "turn left"):
        assert parse_minigrid_action(bad) is None


def test_steps_feedback_and_a_wasted_step():
    env = _make()()
    env.reset(0)  # Empty-5x5: the agent starts at (1, 1) facing right
    u = env.grid_env
    assert (tuple(u.agent_pos), u.agent_dir) == ((1, 1), 0)
    msgs, r, done, info = env.step("forward")
    assert _parts(msgs)[1] == "You moved forward. 99 steps left." and tuple(u.agent_pos) == (2, 1)
    key = env.state_key()
    before = np.asarray(env.pixels()).copy()
    msgs, r, done, info = env.step("jump!")
    assert (r, done, info["malformed"], info["steps"]) == (0.0, False, True, 2)
    assert _parts(msgs)[1].startswith("Not an action: reply left, right") and env.state_key() == key
    assert np.array_equal(before, env.pixels())  # nothing moved
    assert _parts(env.step("left")[0])[1] == "You turned left. 97 steps left."
    assert env.state_key() != key  # the direction is part of the key
    env.step("forward")  # facing up from (2, 1): the wall
    assert _parts(env.step("forward")[0])[1].startswith("Blocked: you did not move.")


def test_max_steps_truncates_as_a_failure():
    env = _make("env.minigrid.max_steps=3")()
    env.reset(0)
    assert not env.step("??")[2] and not env.step("left")[2]
    _, r, done, info = env.step("nope")
    assert done and r == 0.0 and not info["success"] and info["truncated"]
    with pytest.raises(RuntimeError, match="finished episode"):
        env.step("left")


@pytest.mark.parametrize("env_id", ["MiniGrid-Empty-5x5-v0", "MiniGrid-Empty-Random-6x6-v0"])
def test_the_demonstrator_solves_empty_envs(env_id):
    env = _make(f"env.minigrid.env_id={env_id}")()
    for seed in range(5):
        r, info = _solve(env, seed)
        assert info["success"] and 0.0 < r < 1.0  # MiniGrid's own reward, shrinking with steps
    sparse = _make(f"env.minigrid.env_id={env_id}", "env.minigrid.reward=success")()
    assert _solve(sparse, 0)[0] == 1.0
    rng = np.random.default_rng(0)
    assert {env.random_action(rng) for _ in range(200)} == set(ACTIONS)


def test_the_demonstrator_says_when_it_cannot():
    env = _make("env.minigrid.env_id=MiniGrid-DoorKey-5x5-v0")()
    env.reset(0)  # the goal sits behind a locked door
    with pytest.raises(RuntimeError, match="no open path to a goal in MiniGrid-DoorKey-5x5-v0"):
        env.expert_action(np.random.default_rng(0))


def test_bad_settings_fail_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"env\.minigrid\.env_id='MiniGrid-Nope-v0'"):
        _make("env.minigrid.env_id=MiniGrid-Nope-v0")
    with pytest.raises(ConfigError, match=r"env\.minigrid\.image"):
        load_config(None, ["env.name=minigrid", "env.minigrid.image=top"])
    with pytest.raises(ValueError, match="not a MiniGrid env"):
        MiniGridEnv("CartPole-v1")
    monkeypatch.setitem(sys.modules, "minigrid", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'gyre\[minigrid\]'"):
        MiniGridEnv()
