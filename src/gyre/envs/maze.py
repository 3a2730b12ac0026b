"""Text grid mazes with a move budget and a sparse reward.

The maze is an ``size x size`` grid of cells; a fraction ``wall_density`` of them are walls.
``reset(seed)`` draws walls, a start and a goal from ``seed`` alone (rejection sampling until the
goal is reachable and the shortest path is at least ``min_distance`` moves). The move budget is
``floor(budget_factor * shortest)``, at most twice the shortest path.

Observations come in four documented formats (``observation=``):

``compass``. The first observation is the whole grid, then the agent's view; every
later observation is only the agent's view::

    ..G##         <- the grid, rows top to bottom (first observation only)
    ..###
    #.A##
    #####
    #####
    .###u2r0>     <- the agent's view (every turn)

The view lists the cells around the agent, nearest first: with ``view=1`` the four
cells up, down, left and right; with ``view=2`` those four, then the eight cells two moves away,
row by row (see :func:`compass_offsets`). Then comes the goal's offset and the prompt ``>``.
``u2r0`` says the goal is 2 rows up and 0 columns right (``u``/``d`` then ``l``/``r``, each
with a count).

``exits`` (the default, with ``view=2``): the same information as ``compass``, written as a
text adventure writes a room's exits: the whole grid once, then every turn the open moves (the
letters of the neighbours that are not walls, in the order u, d, l, r), each followed by its
cell character, then a space, the goal offset and ``>``::

    r.l+ u2r0>    <- open: right (free) and left (already visited); goal 2 up, 0 right

Walls are simply absent, so the letter the policy writes is one it can copy from the view.
With ``view=1`` it lists only the open moves, as above; with ``view=2`` (the default) the view
also looks one move further: each open move is followed by the moves that are open from that
neighbour, in upper case and without the way back, the entries are separated by spaces, and the
goal offset comes first, so that the exits sit next to the prompt::

    u2r0 r.UD l+>  <- goal 2 up; right is free and from there up and down are open; left is a
                      dead end

That is the 12 cells within two moves (what ``compass`` shows with ``view=2``), grouped by the
move that leads to them; no search is involved.

``window``: every turn, a ``(2 * view + 1)`` square window centred on the agent (``A``), then
the offset and ``>``. ``grid``: every turn, the whole grid, then the offset and ``>``.

Cell characters: ``#`` wall (or outside the grid), ``.`` free, ``+`` free and already visited
in this episode, ``G`` the goal, ``A`` the agent.

Action format: one of ``u``, ``d``, ``l``, ``r`` (up, down, left, right). Case and surrounding
whitespace are ignored, and the full words ``up``/``down``/``left``/``right`` are accepted too.
Every action uses one move of the budget:
- a move into a wall or off the grid leaves the agent in place;
- a malformed action (anything else) also leaves the agent in place: a wasted move.

Reward: 1.0 on the step that reaches the goal within the budget (the episode ends), else 0.0; the
episode also ends when the budget is spent.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# gyre.config.base, not gyre.config: gyre.config builds its tree lazily (gyre.config.envs).
from gyre.config.base import ConfigError
from gyre.config.maze import MazeConfig

MOVES = {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}
WORDS = {"up": "u", "down": "d", "left": "l", "right": "r"}
OBSERVATIONS = ("compass", "exits", "window", "grid")
DEMONSTRATORS = ("shortest", "greedy", "lookahead", "careful")


def _check_choice(name: str, value: str, allowed: Any) -> None:
    if value not in allowed:
        raise ValueError(f"maze {name} must be one of {', '.join(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Teacher:
    """The maze's SFT demonstrator: ``name``'s move each turn or, with ``mix``, another
    demonstrator drawn per turn with its probability (the rest of the probability goes to
    ``name``); the names are those of ``DEMONSTRATORS`` (see :meth:`MazeEnv.expert_action`)."""

    name: str = "shortest"
    mix: Mapping[str, float] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mix", dict(self.mix or {}))  # a copy; None: no mix
        _check_choice("demonstrator", self.name, DEMONSTRATORS)
        for name, p in self.mix.items():
            _check_choice("demonstrator_mix key", name, DEMONSTRATORS)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"maze demonstrator_mix[{name!r}] must lie in [0, 1], got {p}")
        if sum(self.mix.values()) > 1.0 + 1e-9:
            raise ValueError(f"maze demonstrator_mix {self.mix} sums to more than 1")

    def pick(self, rng: np.random.Generator) -> str:
        """This turn's demonstrator: one ``rng`` draw when there is a mix, none otherwise."""
        if not self.mix:
            return self.name
        u, acc = rng.random(), 0.0
        for other, p in self.mix.items():
            acc += p
            if u < acc:
                return other
        return self.name


def parse_action(text: str) -> str | None:
    """Map the policy's text to a move letter, or None when malformed."""
    a = text.strip().lower()
    a = WORDS.get(a, a)
    return a if a in MOVES else None


def compass_offsets(radius: int) -> list[tuple[int, int]]:
    """Cells the compass view lists: every (dr, dc) with 1 <= |dr| + |dc| <= radius, nearest
    first; the four neighbours in the order u, d, l, r, then each farther ring row by row."""
    out = list(MOVES.values())
    for dist in range(2, radius + 1):
        out += [
            (dr, dc)
            for dr in range(-dist, dist + 1)
            for dc in range(-dist, dist + 1)
            if abs(dr) + abs(dc) == dist
        ]
    return out


def bfs_distances(walls: np.ndarray, target: tuple[int, int]) -> np.ndarray:
    """Moves from every cell to ``target`` (-1 where unreachable or a wall)."""
    n, m = walls.shape
    dist = np.full((n, m), -1, dtype=np.int64)
    dist[target] = 0
    queue = deque([target])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            rr, cc = r + dr, c + dc
            if 0 <= rr < n and 0 <= cc < m and not walls[rr, cc] and dist[rr, cc] < 0:
                dist[rr, cc] = dist[r, c] + 1
                queue.append((rr, cc))
    return dist


class MazeEnv:
    """One maze episode at a time. See the module docstring for the exact rules."""

    def __init__(
        self,
        size: int = 5,
        wall_density: float = 0.3,
        min_distance: int = 4,
        budget_factor: float = 2.0,
        view: int = 1,
        observation: str = "compass",
        teacher: Teacher | None = None,
    ) -> None:
        if size < 2:
            raise ValueError(f"maze size must be at least 2, got {size}")
        if not 1.0 <= budget_factor <= 2.0:
            raise ValueError(f"budget_factor must lie in [1, 2], got {budget_factor}")
        self.size = size
        self.wall_density = wall_density
        self.min_distance = min_distance
        self.budget_factor = budget_factor
        _check_choice("observation", observation, OBSERVATIONS)
        if observation == "exits" and view not in (1, 2):
            raise ValueError(
                f"the exits observation looks one or two moves ahead (view=1 or 2), got view={view}"
            )
        self.view = view
        self.observation = observation
        self.teacher = teacher if teacher is not None else Teacher()
        self.blocked = False  # the last move went into a wall (info["invalid"])
        self.visited: set[tuple[int, int]] = set()
        self.walls = np.zeros((size, size), dtype=bool)
        self.pos = self.start = self.goal = (0, 0)
        self.shortest = self.budget = self.moves = self.bumps = 0
        self.done = True
        self._dist = np.zeros((size, size), dtype=np.int64)

    @classmethod
    def from_config(cls, cfg: MazeConfig) -> MazeEnv:
        """The maze a run's ``env.maze`` section describes."""
        fields = cfg.model_dump()
        teacher = Teacher(fields.pop("demonstrator"), fields.pop("demonstrator_mix"))
        return cls(**fields, teacher=teacher)

    # -- generation ---------------------------------------------------------------------------
    def generate(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        n = self.size
        for _ in range(10_000):
            walls = rng.random((n, n)) < self.wall_density
            free = np.argwhere(~walls)
            if len(free) < 2:
                continue
            i, j = rng.choice(len(free), size=2, replace=False)
            start, goal = tuple(int(x) for x in free[i]), tuple(int(x) for x in free[j])
            dist = bfs_distances(walls, goal)
            if dist[start] >= self.min_distance:
                self.walls, self.start, self.goal, self._dist = walls, start, goal, dist
                self.shortest = int(dist[start])
                self.budget = int(self.budget_factor * self.shortest)
                return
        raise ConfigError(
            f"could not draw a maze for seed {seed} in 10000 tries: env.maze.min_distance="
            f"{self.min_distance} is too far for env.maze.size={n} with env.maze.wall_density="
            f"{self.wall_density}; lower one of them"
        )

    # -- protocol -------------------------------------------------------------------------------
    def reset(self, seed: int) -> str:
        self.generate(seed)
        self.pos = self.start
        self.visited = {self.start}
        self.moves = self.bumps = 0
        self.done = self.blocked = False
        return self.render(first=True)

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self.done:
            raise RuntimeError("step() called on a finished episode; call reset() first")
        move = parse_action(action)
        self.moves += 1
        self.blocked = False
        if move is not None:
            dr, dc = MOVES[move]
            r, c = self.pos[0] + dr, self.pos[1] + dc
            if 0 <= r < self.size and 0 <= c < self.size and not self.walls[r, c]:
                self.pos = (r, c)
                self.visited.add(self.pos)
            else:
                self.bumps += 1
                self.blocked = True
        success = self.pos == self.goal
        self.done = success or self.moves >= self.budget
        info = {
            "success": success,
            "moves": self.moves,
            "shortest": self.shortest,
            "budget": self.budget,
            "malformed": move is None,
            "bumps": self.bumps,  # moves so far into a wall or off the grid (well-formed ones)
            "invalid": move is None or self.blocked,  # this action changed nothing
            "state": self.state_key(),
        }
        return self.render(), (1.0 if success else 0.0), self.done, info

    def state_key(self) -> tuple[int, int]:
        """The agent's cell: the anchor-state key of turn-level credit (GiGPO). Within one task
        (one seed: the same walls and goal) the cell is what the next move's outcome depends
        on; a move into a wall leaves the key unchanged."""
        return (int(self.pos[0]), int(self.pos[1]))

    def render_episode(self, seed: int, actions: Sequence[str]) -> dict[str, Any]:
        """The maze of ``seed`` replayed with ``actions``, for ``samples.jsonl`` (the report
        draws it): ``{"maze": {size, walls, start, goal, budget, shortest, positions},
        "success": bool}``. The sample writer's optional env hook."""
        self.reset(seed)
        walls = ["".join("#" if w else "." for w in row) for row in self.walls]
        start, goal = list(self.start), list(self.goal)
        positions, success = [], False
        for a in actions:
            _, _, done, info = self.step(a)
            positions.append(list(self.pos))
            success = bool(info.get("success", False))
            if done:
                break
        maze = {"size": self.size, "walls": walls, "start": start, "goal": goal}
        maze |= {"budget": self.budget, "shortest": self.shortest, "positions": positions}
        return {"maze": maze, "success": success}

    def _cell(self, r: int, c: int) -> str:
        if not (0 <= r < self.size and 0 <= c < self.size) or self.walls[r, c]:
            return "#"
        if (r, c) == self.pos:
            return "A"
        if (r, c) == self.goal:
            return "G"
        return "+" if (r, c) in self.visited else "."

    def _offset(self) -> str:
        dr, dc = self.goal[0] - self.pos[0], self.goal[1] - self.pos[1]
        return f"{'u' if dr < 0 else 'd'}{abs(dr)}{'l' if dc < 0 else 'r'}{abs(dc)}"

    def _exits(self) -> str:
        """The open moves with their cells; with ``view=2`` each is followed by the moves that
        are open from that neighbour (upper case, the way back left out) and a space."""
        out = []
        for name, (dr, dc) in MOVES.items():
            r, c = self.pos[0] + dr, self.pos[1] + dc
            cell = self._cell(r, c)
            if cell == "#":
                continue
            if self.view == 1:
                out.append(name + cell)
                continue
            onward = "".join(
                nxt.upper()
                for nxt, (dr2, dc2) in MOVES.items()
                if (dr2, dc2) != (-dr, -dc) and self._cell(r + dr2, c + dc2) != "#"
            )
            out.append(name + cell + onward)
        return ("" if self.view == 1 else " ").join(out)

    def _grid(self) -> list[str]:
        return ["".join(self._cell(r, c) for c in range(self.size)) for r in range(self.size)]

    def render(self, first: bool = False) -> str:
        """The observation text (see the module docstring for the four formats)."""
        pr, pc = self.pos
        if self.observation == "compass":
            near = "".join(self._cell(pr + dr, pc + dc) for dr, dc in compass_offsets(self.view))
            view = near + self._offset() + ">"
            return "\n".join([*self._grid(), view]) if first else view
        if self.observation == "exits":
            if self.view == 1:
                view = self._exits() + " " + self._offset() + ">"
            else:  # the exits next to the prompt: measured to train faster (docs/results/maze.md)
                view = self._offset() + " " + self._exits() + ">"
            return "\n".join([*self._grid(), view]) if first else view
        if self.observation == "window":
            rows = [
                "".join(self._cell(r, c) for c in range(pc - self.view, pc + self.view + 1))
                for r in range(pr - self.view, pr + self.view + 1)
            ]
        else:
            rows = self._grid()
        return "\n".join([*rows, self._offset() + ">"])

    # -- demonstrations -------------------------------------------------------------------------
    def expert_action(self, rng: np.random.Generator) -> str:
        """The teacher's move (:class:`Teacher`): its demonstrator's or, with a mix, that of
        one demonstrator drawn per turn (one ``rng`` draw a turn).

        ``shortest``: a move along a shortest path. Ties go to the move that also shrinks the
        larger of the row/column offsets to the goal, then to the order u, d, l, r
        (deterministic). ``greedy``: :meth:`greedy_action`. ``lookahead``: the same, but a
        neighbour that is a dead end (no open move onward, and not the goal) comes last.
        ``careful``: lookahead, and among the moves left an unvisited cell comes first.
        """
        return self.move_of(self.teacher.pick(rng))

    def move_of(self, demonstrator: str) -> str:
        """One demonstrator's move here (a name of ``DEMONSTRATORS``), no draw."""
        if demonstrator in ("greedy", "lookahead", "careful"):
            careful = demonstrator == "careful"
            return self.greedy_action(demonstrator != "greedy", prefer_unvisited=careful)
        here = self._dist[self.pos]
        gr, gc = self.goal
        best = []
        for name, (dr, dc) in MOVES.items():
            r, c = self.pos[0] + dr, self.pos[1] + dc
            if 0 <= r < self.size and 0 <= c < self.size and not self.walls[r, c]:
                if self._dist[r, c] == here - 1:
                    best.append((max(abs(gr - r), abs(gc - c)), "udlr".index(name), name))
        return min(best)[2]

    def greedy_action(self, avoid_dead_ends: bool = False, prefer_unvisited: bool = False) -> str:
        """The legal move whose cell is closest to the goal in Manhattan distance (ties: the
        order u, d, l, r). It never walks into a wall, but it does not know the cells it has
        visited, so it can shuttle between two cells until the budget is spent. With
        ``avoid_dead_ends`` a neighbour from which no move leads on (what the ``exits`` view
        with ``view=2`` shows as an entry without upper-case letters), other than the goal,
        is taken only when every legal move is one. With ``prefer_unvisited`` (after the dead-end
        rule) a cell not yet visited in this episode comes before a visited one."""
        gr, gc = self.goal
        best = []
        for name, (dr, dc) in MOVES.items():
            r, c = self.pos[0] + dr, self.pos[1] + dc
            if self._open(r, c):
                dead = avoid_dead_ends and self._dead_end(dr, dc)
                seen = prefer_unvisited and (r, c) in self.visited
                best.append((dead, seen, abs(gr - r) + abs(gc - c), "udlr".index(name), name))
        return min(best)[-1] if best else "u"  # boxed in: every move is a bump

    def _open(self, r: int, c: int) -> bool:
        return 0 <= r < self.size and 0 <= c < self.size and not self.walls[r, c]

    def random_action(self, rng: np.random.Generator) -> str:
        """A demonstration's noise move: uniform over u, d, l, r."""
        return str(rng.choice(list(MOVES)))

    def _dead_end(self, dr: int, dc: int) -> bool:
        r, c = self.pos[0] + dr, self.pos[1] + dc
        if not self._open(r, c) or (r, c) == self.goal:
            return False
        return not any(self._open(r + a, c + b) for a, b in MOVES.values() if (a, b) != (-dr, -dc))
