"""The gymnasium adapter (env.name=gymnasium): text, action parsing, wasted steps, seeds,
success, the BFS expert, GiGPO state keys and the config errors."""

from __future__ import annotations

import numpy as np
import pytest

from gyre.config import ConfigError, EnvConfig, load_config
from gyre.envs import env_factory
from gyre.errors import InputError

gym = pytest.importorskip("gymnasium", reason="the gymnasium extra is not installed")

from gyre.envs.gymnasium_env import parse_action, shortest_path  # noqa: E402

LAKE = {"name": "gymnasium", "gymnasium": {"make_kwargs": {"is_slippery": False}}}


def _env(**section: object):
    body = {"make_kwargs": {"is_slippery": False}, **section}
    return env_factory(EnvConfig.model_validate({"name": "gymnasium", "gymnasium": body}))()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("left", 0),
        (" Down\n", 1),
        ("RIGHT.", 2),
        ("3", 3),
        ("u", 3),
        ("l", 0),
        ("4", None),  # out of range
        ("-1", None),
        ("", None),
        ("go left", None),  # a sentence is not an action
        ("lef", None),
        ("x", None),
        ("²", None),  # a digit to str.isdigit, not a number to int()
    ],
)
def test_parse_action_hand_cases(text: str, expected: int | None) -> None:
    assert parse_action(text, ["left", "down", "right", "up"]) == expected


def test_parse_action_ambiguous_letter_is_refused() -> None:
    # Taxi-like names: "s" is south only, but with "stay" added "s" names two actions.
    assert parse_action("s", ["south", "north"]) == 0
    assert parse_action("s", ["south", "stay"]) is None
    assert parse_action("stay", ["south", "stay"]) == 1


def test_frozen_lake_text_moves_and_success() -> None:
    env = _env()
    assert env.reset(0) == "actions: left down right up\nAFFF\nFHFH\nFFFH\nHFFG\n>"
    obs, r, done, info = env.step("down")
    assert obs == "SFFF\nAHFH\nFFFH\nHFFG\n>" and r == 0.0 and not done
    assert info["state"] == 4 and not info["malformed"] and not info["success"]
    for a in ["down", "right", "down", "right"]:
        obs, r, done, info = env.step(a)
    obs, r, done, info = env.step("r")
    assert (r, done, info["success"], info["moves"]) == (1.0, True, True, 6)


def test_hole_ends_the_episode_as_failure() -> None:
    env = _env()
    env.reset(0)
    env.step("down")
    _, r, done, info = env.step("right")  # (1, 1) is a hole
    assert (r, done, info["success"], info["truncated"]) == (0.0, True, False, False)


def test_unparsable_reply_is_a_wasted_step() -> None:
    env = _env(max_steps=3)
    first = env.reset(0)
    obs, r, done, info = env.step("jump!")
    assert info["malformed"] and info["state"] == 0 and r == 0.0 and not done
    assert obs == first.split("\n", 1)[1]  # the same state, without the actions line
    env.step("??")
    _, _, done, info = env.step("also bad")
    assert done and info["truncated"] and not info["success"] and info["moves"] == 3


def test_seeds_are_reproducible_and_maps_differ_per_seed() -> None:
    a, b = _env(random_map_size=4), _env(random_map_size=4)
    first = [a.reset(s) for s in range(20)]
    assert first == [b.reset(s) for s in range(20)]
    assert len(set(first)) > 5  # random maps: the seed draws the map
    assert a.reset(2**31 + 3) == b.reset(2**31 + 3)


def test_slippery_dynamics_follow_the_seed() -> None:
    def play(seed: int) -> list[int]:
        env = _env(make_kwargs={"is_slippery": True})
        env.reset(seed)
        states = []
        for _ in range(8):
            _, _, done, info = env.step("right")
            states.append(info["state"])
            if done:
                break
        return states

    assert play(7) == play(7)
    assert len({tuple(play(s)) for s in range(10)}) > 1


@pytest.mark.parametrize("seed", range(12))
def test_bfs_expert_solves_random_maps_in_the_shortest_path(seed: int) -> None:
    env = _env(random_map_size=4)
    env.reset(seed)
    rng = np.random.default_rng(0)
    done, moves = False, 0
    while not done:
        _, _, done, info = env.step(env.expert_action(rng))
        moves += 1
    assert info["success"]
    row, col = 3, 3  # the goal; no path is shorter than the Manhattan distance from (0, 0)
    assert moves >= row + col


def test_shortest_path_hand_table() -> None:
    # 0 -a0-> 1 -a0-> 2 (goal, reward 1); a1 from 0 jumps straight to a losing end.
    table = {
        0: {0: [(1.0, 1, 0.0, False)], 1: [(1.0, 3, 0.0, True)]},
        1: {0: [(1.0, 2, 1.0, True)], 1: [(1.0, 0, 0.0, False)]},
    }
    assert shortest_path(table, 0, 0.0) == 0
    assert shortest_path(table, 1, 0.0) == 0
    assert shortest_path(table, 0, 5.0) is None  # no reward above the threshold


def test_taxi_renderer_expert_and_state_key() -> None:
    env = _env(id="Taxi-v4", make_kwargs={})
    text = env.reset(5)
    assert text.startswith("actions: south north east west pickup dropoff\n+---------+")
    assert "T" in text and "passenger at R, destination Y" in text
    rng = np.random.default_rng(0)
    done = False
    while not done:
        _, r, done, info = env.step(env.expert_action(rng))
    assert info["success"] and r == 20.0
    assert env.state_key() == info["state"]


def test_success_reward_mode_and_ansi_renderer() -> None:
    env = _env(id="Taxi-v4", make_kwargs={}, reward="success", renderer="ansi")
    text = env.reset(5)
    assert "\x1b" not in text and "+---------+" in text
    _, r, _, _ = env.step("north")
    assert r == 0.0  # Taxi's own -1 per step is replaced by the success reward


def test_plugin_renderer(tmp_path) -> None:
    (tmp_path / "render.py").write_text("def cell(env, obs):\n    return f'cell {obs}'\n")
    env = _env(renderer=f"{tmp_path}/render.py:cell", list_actions=False)
    assert env.reset(0) == "cell 0\n>"
    # a relative file path is resolved against the config file's folder, as env.name is
    (tmp_path / "c.yaml").write_text(
        "env: {name: gymnasium, gymnasium: {renderer: render.py:cell}}"
    )
    cfg = load_config(str(tmp_path / "c.yaml"), [])
    assert cfg.env.gymnasium.renderer == f"{tmp_path / 'render.py'}:cell"


def test_errors_are_one_line_and_name_the_key() -> None:
    with pytest.raises(InputError, match=r"env.gymnasium.id='NoSuchEnv-v0'"):
        _env(id="NoSuchEnv-v0")
    with pytest.raises(InputError, match="action_names has 2 names; 'FrozenLake-v1' has 4"):
        _env(action_names=["a", "b"])
    with pytest.raises(InputError, match="Discrete"):
        _env(id="MountainCarContinuous-v0", make_kwargs={})
    with pytest.raises(InputError, match="make_kwargs"):
        _env(make_kwargs={"colour": "red"})
    with pytest.raises(InputError, match="random_map_size is for FrozenLake"):
        _env(id="Taxi-v4", make_kwargs={}, random_map_size=4)


def test_config_refuses_render_mode_and_bad_renderer() -> None:
    with pytest.raises(ConfigError, match=r"env\.gymnasium\.make_kwargs"):
        load_config(None, ["env.name=gymnasium", "env.gymnasium.make_kwargs={render_mode: ansi}"])
    with pytest.raises(ConfigError, match=r"env\.gymnasium\.renderer"):
        load_config(None, ["env.name=gymnasium", "env.gymnasium.renderer=pretty"])
    with pytest.raises(ConfigError, match=r"env\.gymnasium\.action_names"):
        load_config(None, ["env.name=gymnasium", "env.gymnasium.action_names=[a, A]"])
