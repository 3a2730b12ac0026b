"""Any registered gymnasium env with a Discrete action space, as a multi-turn text env.

``env.name=gymnasium`` with ``env.gymnasium.id`` (``FrozenLake-v1``, ``Taxi-v4``, ...). Needs
the ``gymnasium`` extra (``pip install 'gyre[gymnasium]'``).

**Text.** Every observation is the state as text (the *renderer*, ``env.gymnasium.renderer``)
followed by ``prompt`` (``">"``); the first one starts with ``actions: left down right up``
(``list_actions``). Renderers:

- ``frozen_lake``: the map, one row a line, with the agent's cell written ``A``
  (``S`` start, ``F`` frozen, ``H`` hole, ``G`` goal)::

      AFFF
      FHFH
      FFFH
      HFFG
      >

- ``taxi``: the Taxi map with the taxi written ``T`` and a status line
  (``passenger at R, destination B`` / ``passenger in taxi, destination B``).
- ``ansi``: the env's own ``render_mode="ansi"`` text with the colour codes removed (FrozenLake
  and Taxi mark the agent only by colour, hence the two renderers above); ``ansi_raw`` keeps the
  codes (a byte-level tokenizer reads them; gyre's char tokenizer maps ESC to ``<unk>``).
- ``obs``: ``str(observation)`` (a Discrete observation is its index).
- ``module:fn`` / ``file.py:fn``: your ``fn(env, obs) -> str`` (``env`` the gymnasium env).
- ``auto``: ``frozen_lake`` / ``taxi`` for those envs, else ``ansi`` where the env renders it,
  else ``obs``.

**Actions.** The reply (stripped, lower-cased, a trailing ``.`` dropped) is an action name
(``env.gymnasium.action_names``, derived when empty), its index (``"2"``), or a name's first
letter where no other name shares it (``l`` for ``left``). Anything else is a **wasted step**,
as in the maze: the env is not stepped, the state stays, the step counts against ``max_steps``
and ``info["malformed"]`` is True.

**Episodes.** ``reset(seed)`` is ``env.reset(seed=seed)``, so an episode is a pure function of
the seed (also for slippery dynamics). With ``random_map_size > 0`` FrozenLake draws a new map
per seed, so held-out seeds (``2^31 + i``) are maps training never saw. The episode ends when
the env terminates or truncates, or after ``max_steps`` turns. **Success** is a termination
(not a truncation) on a step whose reward is above ``success_threshold`` (0): FrozenLake's goal,
Taxi's drop-off. The reward is the env's (``reward: env``) or 1.0 on success (``success``).

**GiGPO.** ``info["state"]`` and ``state_key()`` are the observation index for Discrete
observation spaces (None otherwise).

**Demonstrations.** Envs whose unwrapped env has a transition table ``P`` (gymnasium's toy-text
envs: FrozenLake, Taxi, CliffWalking) get an expert: the first action of a shortest path, by
breadth-first search over the most likely outcome of each action, to a successful termination.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from gyre.config.adapters import GymnasiumConfig
from gyre.errors import InputError

MISSING = "env.name=gymnasium needs the gymnasium package: pip install 'gyre[gymnasium]'"
DEFAULT_ACTIONS = {
    "FrozenLakeEnv": ["left", "down", "right", "up"],
    "TaxiEnv": ["south", "north", "east", "west", "pickup", "dropoff"],
    "CliffWalkingEnv": ["up", "right", "down", "left"],
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TAXI_LOCS = "RGYB"


def import_gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError:
        raise InputError(MISSING) from None
    return gymnasium


def parse_action(text: str, names: list[str]) -> int | None:
    """The action index the reply names, or None (a wasted step); see the module docstring."""
    t = text.strip().lower().removesuffix(".").strip()
    if t in names:
        return names.index(t)
    if t.isdecimal() and int(t) < len(names):
        return int(t)
    if len(t) == 1:
        hits = [i for i, n in enumerate(names) if n[0] == t]
        if len(hits) == 1:
            return hits[0]
    return None


def render_frozen_lake(env: Any, obs: Any) -> str:
    desc = env.unwrapped.desc
    row, col = divmod(int(obs), desc.shape[1])
    lines = []
    for r, cells in enumerate(desc):
        text = [c.decode() for c in cells]
        if r == row:
            text[col] = "A"
        lines.append("".join(text))
    return "\n".join(lines)


def render_taxi(env: Any, obs: Any) -> str:
    taxi_row, taxi_col, passenger, dest = env.unwrapped.decode(int(obs))
    grid = [[c.decode() for c in row] for row in env.unwrapped.desc]
    grid[1 + taxi_row][2 * taxi_col + 1] = "T"
    where = "in taxi" if passenger == 4 else f"at {_TAXI_LOCS[passenger]}"
    return (
        "\n".join("".join(r) for r in grid)
        + f"\npassenger {where}, destination "
        + (_TAXI_LOCS[dest])
    )


def _render_ansi(env: Any, obs: Any) -> str:
    return _ANSI.sub("", env.render())


def _render_ansi_raw(env: Any, obs: Any) -> str:
    return str(env.render())


def _render_obs(env: Any, obs: Any) -> str:
    return str(obs.tolist() if isinstance(obs, np.ndarray) else obs)


RENDERERS: dict[str, Callable[[Any, Any], str]] = {
    "frozen_lake": render_frozen_lake,
    "taxi": render_taxi,
    "ansi": _render_ansi,
    "ansi_raw": _render_ansi_raw,
    "obs": _render_obs,
}
_NEEDS_ANSI = ("ansi", "ansi_raw")


@functools.lru_cache(maxsize=4096)
def _random_map(size: int, p: float, seed: int) -> tuple[str, ...]:
    """FrozenLake's own random map of ``seed`` (cached: a GRPO group resets G envs alike)."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    return tuple(generate_random_map(size=size, p=p, seed=seed))


class GymnasiumEnv:
    """A gymnasium env behind the text Env protocol (see the module docstring)."""

    def __init__(self, cfg: GymnasiumConfig, renderer: str, names: list[str]) -> None:
        self.cfg = cfg
        self.renderer_name = renderer
        self.render_fn = RENDERERS.get(renderer) or _plugin_renderer(renderer)  # cached import
        self.names = names
        self.gym: Any = None if cfg.random_map_size else make_gym(cfg, renderer)
        self.obs: Any = None
        self.moves = 0
        self.limit = cfg.max_steps
        self.done = True

    def reset(self, seed: int) -> str:
        if self.cfg.random_map_size:
            desc = _random_map(self.cfg.random_map_size, self.cfg.random_map_p, seed)
            self.gym = make_gym(self.cfg, self.renderer_name, desc=list(desc))
        self.obs, _ = self.gym.reset(seed=seed)
        self.limit = self.cfg.max_steps or int(self.gym.spec.max_episode_steps or 0)
        self.moves, self.done = 0, False
        head = f"actions: {' '.join(self.names)}\n" if self.cfg.list_actions else ""
        return head + self._text()

    def _text(self) -> str:
        return self.render_fn(self.gym, self.obs).rstrip("\n") + "\n" + self.cfg.prompt

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        index = parse_action(action, self.names)
        self.moves += 1
        reward, terminated, truncated = 0.0, False, False
        if index is not None:
            self.obs, r, terminated, truncated, _ = self.gym.step(index)
            reward = float(r)
        success = bool(terminated) and reward > self.cfg.success_threshold
        self.done = bool(terminated or truncated) or self.moves >= self.limit
        info = {
            "success": success,
            "moves": self.moves,
            "malformed": index is None,
            "truncated": self.done and not terminated,
            "state": self.state_key(),
        }
        if self.cfg.reward == "success":
            reward = 1.0 if success else 0.0
        return ("" if self.done else self._text()), reward, self.done, info

    def state_key(self) -> int | None:
        """The observation index (Discrete observation spaces), the anchor state of GiGPO."""
        obs = self.obs
        return int(obs) if isinstance(obs, int | np.integer) else None


class GymnasiumDemoEnv(GymnasiumEnv):
    """A :class:`GymnasiumEnv` whose env has a transition table ``P``: it can demonstrate."""

    def expert_action(self, rng: np.random.Generator) -> str:
        path = shortest_path(self.gym.unwrapped.P, int(self.obs), self.cfg.success_threshold)
        return self.names[path] if path is not None else self.random_action(rng)

    def random_action(self, rng: np.random.Generator) -> str:
        return self.names[int(rng.integers(len(self.names)))]


def shortest_path(table: dict[int, dict[int, list]], start: int, threshold: float) -> int | None:
    """The first action of a shortest path from ``start`` to a successful termination (reward
    above ``threshold``) over each action's most likely outcome; None when there is none."""
    first: dict[int, int | None] = {start: None}
    queue = deque([start])
    while queue:
        s = queue.popleft()
        for a, outcomes in table[s].items():
            _, nxt, reward, terminated = max(outcomes, key=lambda o: o[0])
            act = a if first[s] is None else first[s]
            if terminated and reward > threshold:
                return act
            if not terminated and nxt not in first:
                first[nxt] = act
                queue.append(nxt)
    return None


def _plugin_renderer(spec: str) -> Callable[[Any, Any], str]:
    from gyre.plugins import load_object

    fn = load_object(spec, "env.gymnasium.renderer")
    if not callable(fn):
        raise InputError(f"env.gymnasium.renderer={spec!r} is a {type(fn).__name__}, not callable")
    return fn


def make_gym(cfg: GymnasiumConfig, renderer: str, **extra: Any) -> Any:
    gym = import_gymnasium()
    mode = {"render_mode": "ansi"} if renderer in _NEEDS_ANSI else {}
    try:
        return gym.make(cfg.id, **cfg.make_kwargs, **extra, **mode)
    except gym.error.Error as exc:  # unknown / deprecated id, missing dependency
        raise InputError(f"env.gymnasium.id={cfg.id!r}: {exc}") from None
    except TypeError as exc:
        raise InputError(
            f"env.gymnasium.make_kwargs={cfg.make_kwargs} for {cfg.id!r}: {exc}"
        ) from None


def gymnasium_factory(cfg: GymnasiumConfig) -> Callable[[], GymnasiumEnv]:
    """Check the env once (id, action space, renderer, names), then build one per episode."""
    gym = import_gymnasium()
    if cfg.random_map_size and "desc" in cfg.make_kwargs:
        raise InputError("env.gymnasium.random_map_size > 0 draws the map; drop make_kwargs.desc")
    probe = make_gym(cfg, "obs")
    if cfg.random_map_size and type(probe.unwrapped).__name__ != "FrozenLakeEnv":
        raise InputError(f"env.gymnasium.random_map_size is for FrozenLake, not {cfg.id!r}")
    space = probe.action_space
    if not isinstance(space, gym.spaces.Discrete):
        raise InputError(
            f"env.gymnasium.id={cfg.id!r} has action space {space}; gyre's adapter needs a "
            "Discrete one (its actions are named in text)"
        )
    kind = type(probe.unwrapped).__name__
    n = int(space.n)
    names = cfg.action_names or DEFAULT_ACTIONS.get(kind) or [str(i) for i in range(n)]
    if len(names) != n:
        raise InputError(f"env.gymnasium.action_names has {len(names)} names; {cfg.id!r} has {n}")
    renderer = cfg.renderer
    if renderer == "auto":
        auto = {"FrozenLakeEnv": "frozen_lake", "TaxiEnv": "taxi"}
        ansi = "ansi" in probe.metadata.get("render_modes", [])
        renderer = auto.get(kind, "ansi" if ansi else "obs")
    if not cfg.max_steps and not probe.spec.max_episode_steps:
        raise InputError(f"env.gymnasium.id={cfg.id!r} has no time limit; set max_steps")
    cls = GymnasiumDemoEnv if hasattr(probe.unwrapped, "P") else GymnasiumEnv
    cls(cfg, renderer, names).reset(0)  # a bad renderer fails now, not in the first rollout
    return lambda: cls(cfg, renderer, names)
