"""How well can a policy do on the default mazes when it sees only part of the map?

Simulates a hand-written navigator on the same maze distribution as ``gyre train`` (5 x 5, 30 %
walls, start-goal >= 4 moves, budget = 2 x shortest path): it knows the walls inside its view
(a diamond or a square of the given radius around it), assumes every cell it has not seen is
free, and takes the first move of a shortest path to the goal under that assumption (ties go to
unvisited cells, then the order u, d, l, r). With ``memory`` it also remembers every wall it has
seen earlier in the episode. No learning involved: these are upper bounds for what an
observation format lets a policy do, measured, not argued.

    python scripts/maze_ceilings.py --episodes 2000
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from gyre.envs.maze import MOVES, MazeEnv, bfs_distances


def success_rate(radius: int, shape: str, memory: bool, episodes: int, seed0: int = 10**6) -> float:
    """Fraction of ``episodes`` mazes the navigator solves within the move budget."""
    env = MazeEnv()
    solved = 0
    for k in range(episodes):
        env.reset(seed0 + k)
        n = env.size
        known = np.zeros((n, n), dtype=bool)
        info: dict = {"success": False}
        while not env.done:
            if not memory:
                known[:] = False
            pr, pc = env.pos
            for dr in range(-radius, radius + 1):
                for dc in range(-radius, radius + 1):
                    if shape == "diamond" and abs(dr) + abs(dc) > radius:
                        continue
                    if 0 <= pr + dr < n and 0 <= pc + dc < n:
                        known[pr + dr, pc + dc] = True
            free = ~(env.walls & known)
            dist = bfs_distances(env.walls & known, env.goal)
            dist[dist < 0] = 10**6  # cut off from the goal by the walls it knows
            options = []
            for i, (name, (dr, dc)) in enumerate(MOVES.items()):
                r, c = pr + dr, pc + dc
                if 0 <= r < n and 0 <= c < n and free[r, c]:
                    options.append((dist[r, c], (r, c) in env.visited, i, name))
            _, _, _, info = env.step(min(options)[3])
        solved += bool(info["success"])
    return solved / episodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=2000)
    args = parser.parse_args()
    rows = []
    for radius, shape in [(1, "diamond"), (1, "square"), (2, "diamond"), (2, "square")]:
        for memory in (False, True):
            rate = success_rate(radius, shape, memory, args.episodes)
            rows.append({"radius": radius, "shape": shape, "memory": memory, "success": rate})
            print(f"radius {radius} {shape:7s} memory={memory!s:5s} success {rate:.3f}", flush=True)
    print(json.dumps({"episodes": args.episodes, "rows": rows}))


if __name__ == "__main__":
    main()
