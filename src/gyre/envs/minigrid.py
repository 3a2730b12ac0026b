"""MiniGrid (https://minigrid.farama.org) as a message-mode env with images: ``env.name=minigrid``.

``env.minigrid.env_id`` names any registered MiniGrid env (``MiniGrid-Empty-5x5-v0``,
``MiniGrid-DoorKey-5x5-v0``, ...; the ``minigrid`` extra). Each user message is an RGB image --
the agent's 7x7 egocentric view (``image=partial``, MiniGrid's ``RGBImgPartialObsWrapper``: the
agent at the bottom centre, facing up) or the whole grid (``image=full``, ``RGBImgObsWrapper``) --
``tile_size`` pixels per tile, then a text: the env's own ``mission`` on the first turn, then
what the last action did and the steps left.

Actions are MiniGrid's, by name: ``left``, ``right`` (turn), ``forward``, ``pickup``, ``drop``,
``toggle``, ``done``; case, surrounding whitespace and a final ``.`` are ignored. Any other reply
is a wasted step: the agent does not act, but the step counts against ``max_steps``. The episode
ends when MiniGrid terminates it (goal reached, lava, ``done`` where the env ends on it) or at
``max_steps`` (truncated). Success is a terminal step with a positive reward; the reward is
MiniGrid's own (``1 - 0.9 * steps / max_steps`` on success, else 0) or, with
``reward=success``, 1.0 on success.

The demonstrator (``expert_action``) plans a shortest path by breadth-first search over (cell,
direction) with ``left`` / ``right`` / ``forward`` through the cells the agent can enter (empty,
goal, open doors; never lava), so it solves the Empty-* and FourRooms envs; where no such path
exists (a locked door, a key to fetch) it says so in one line.
"""

from __future__ import annotations

import hashlib
from collections import deque
from typing import Any

import numpy as np

from gyre.envs.base import Message
from gyre.envs.visual_maze import pil_image

ACTIONS = ("left", "right", "forward", "pickup", "drop", "toggle", "done")
_ACTION_LIST = ", ".join(ACTIONS[:-1]) + " or " + ACTIONS[-1]
_DIR_VEC = (
    (1, 0),
    (0, 1),
    (-1, 0),
    (0, -1),
)  # MiniGrid's DIR_TO_VEC: 0 right, 1 down, 2 left, 3 up


def parse_minigrid_action(text: str) -> int | None:
    """The MiniGrid action index named by the policy's text, or None when it names none."""
    a = text.strip().lower().rstrip(".").strip()
    return ACTIONS.index(a) if a in ACTIONS else None


def _import_minigrid() -> tuple[Any, Any]:
    try:
        import gymnasium
        import minigrid  # noqa: F401  (registers the MiniGrid-* ids with gymnasium)
        from minigrid import wrappers
    except ImportError as exc:
        raise ImportError(
            "env.name=minigrid needs the minigrid package: pip install 'gyre[minigrid]'"
        ) from exc
    return gymnasium, wrappers


class MiniGridEnv:
    """One MiniGrid episode at a time, in messages (see the module docstring)."""

    message_mode = True

    def __init__(
        self,
        env_id: str = "MiniGrid-Empty-5x5-v0",
        max_steps: int = 0,
        image: str = "partial",
        tile_size: int = 8,
        reward: str = "env",
    ) -> None:
        if image not in ("partial", "full"):
            raise ValueError(f"env.minigrid.image must be 'partial' or 'full', got {image!r}")
        if reward not in ("env", "success"):
            raise ValueError(f"env.minigrid.reward must be 'env' or 'success', got {reward!r}")
        gym, wrappers = _import_minigrid()
        kwargs: dict[str, Any] = {"render_mode": "rgb_array", "disable_env_checker": True}
        if max_steps:
            kwargs["max_steps"] = max_steps
        try:
            base = gym.make(env_id, **kwargs)
        except (gym.error.Error, TypeError) as exc:
            raise ValueError(f"env.minigrid.env_id={env_id!r}: {exc}") from exc
        if not hasattr(base.unwrapped, "gen_obs"):
            raise ValueError(f"env.minigrid.env_id={env_id!r} is not a MiniGrid env")
        wrap = wrappers.RGBImgPartialObsWrapper if image == "partial" else wrappers.RGBImgObsWrapper
        self.env_id, self.image, self.reward_mode = env_id, image, reward
        self.env = wrap(base, tile_size=tile_size)
        self.mission = ""
        self.done = True
        self._pixels = np.zeros((1, 1, 3), dtype=np.uint8)

    @property
    def grid_env(self) -> Any:
        """The unwrapped MiniGrid env (agent_pos, agent_dir, grid, step_count, max_steps)."""
        return self.env.unwrapped

    def pixels(self) -> np.ndarray:
        """The current observation image, ``(H, W, 3)`` uint8."""
        return self._pixels

    def _message(self, text: str) -> list[Message]:
        content = [
            {"type": "image", "image": pil_image(self._pixels)},
            {"type": "text", "text": text},
        ]
        return [{"role": "user", "content": content}]

    def reset(self, seed: int) -> list[Message]:
        obs, _ = self.env.reset(seed=seed)
        self._pixels = np.asarray(obs["image"], dtype=np.uint8)
        self.mission = str(obs["mission"])
        self.done = False
        view = (
            "The image is your view: you are at its bottom centre, facing up."
            if self.image == "partial"
            else "The image is the whole grid: you are the red triangle, pointing where you face."
        )
        steps = self.grid_env.max_steps
        return self._message(
            f"Mission: {self.mission}. {view} You have {steps} steps. Reply with one action: "
            f"{_ACTION_LIST}."
        )

    def step(self, action: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        a = parse_minigrid_action(action)
        u = self.grid_env
        before = (tuple(int(v) for v in u.agent_pos), int(u.agent_dir))
        if a is None:  # a wasted step: the agent does nothing, the clock runs
            u.step_count += 1
            obs = self.env.observation(u.gen_obs())
            reward, terminated, truncated = 0.0, False, u.step_count >= u.max_steps
        else:
            obs, reward, terminated, truncated, _ = self.env.step(a)
        self._pixels = np.asarray(obs["image"], dtype=np.uint8)
        success = bool(terminated and reward > 0)
        self.done = bool(terminated or truncated)
        if self.reward_mode == "success":
            reward = 1.0 if success else 0.0
        left = u.max_steps - u.step_count
        text = "Mission complete." if success else f"{self._said(a, before)} {left} steps left."
        info = {
            "success": success,
            "steps": int(u.step_count),
            "max_steps": int(u.max_steps),
            "malformed": a is None,
            "truncated": bool(truncated and not terminated),
            "state": self.state_key(),
        }
        return self._message(text), float(reward), self.done, info

    def _said(self, a: int | None, before: tuple[tuple[int, ...], int]) -> str:
        if a is None:
            return f"Not an action: reply {_ACTION_LIST}."
        name = ACTIONS[a]
        if name in ("left", "right"):
            return f"You turned {name}."
        if name == "forward":
            moved = tuple(int(v) for v in self.grid_env.agent_pos) != before[0]
            return "You moved forward." if moved else "Blocked: you did not move."
        return f"You chose {name}."

    def state_key(self) -> tuple[Any, ...]:
        """(cell, direction, what the agent carries, a digest of the grid's objects and their
        states): the anchor-state key of turn-level credit (GiGPO)."""
        u = self.grid_env
        grid = hashlib.blake2b(u.grid.encode().tobytes(), digest_size=8).hexdigest()
        carrying = None if u.carrying is None else (u.carrying.type, u.carrying.color)
        return (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir), carrying, grid)

    # -- demonstrations -------------------------------------------------------------------------
    def _passable(self, x: int, y: int) -> bool:
        u = self.grid_env
        if not (0 <= x < u.grid.width and 0 <= y < u.grid.height):
            return False
        obj = u.grid.get(x, y)
        return obj is None or (obj.can_overlap() and obj.type != "lava")

    def expert_action(self, rng: np.random.Generator) -> str:
        """The first action of a shortest left/right/forward path to the goal (see the module
        docstring); ties prefer forward, then left, then right."""
        u = self.grid_env
        start = (int(u.agent_pos[0]), int(u.agent_pos[1]), int(u.agent_dir))
        first: dict[tuple[int, int, int], str | None] = {start: None}
        queue = deque([start])
        while queue:
            x, y, d = state = queue.popleft()
            obj = u.grid.get(x, y)
            if obj is not None and obj.type == "goal":
                act = first[state]
                if act is not None:
                    return act
            dx, dy = _DIR_VEC[d]
            nexts = [("forward", (x + dx, y + dy, d)), ("left", (x, y, (d - 1) % 4))]
            nexts.append(("right", (x, y, (d + 1) % 4)))
            for name, nxt in nexts:
                if nxt in first or (name == "forward" and not self._passable(nxt[0], nxt[1])):
                    continue
                first[nxt] = first[state] or name
                queue.append(nxt)
        raise RuntimeError(
            f"the MiniGrid demonstrator found no open path to a goal in {self.env_id} (it does "
            "not open doors or fetch keys): set sft.steps=0"
        )

    def random_action(self, rng: np.random.Generator) -> str:
        return str(rng.choice(ACTIONS))
