"""Why does a visual-maze policy fail? Greedy play on held-out mazes with ``describe`` on; at
every turn, is the reply's description (the text maze's compass line) what the picture shows,
and is its move the demonstrator's? With a mixed teacher (``env.maze.demonstrator_mix``) each
rule is scored on its own, and on the turns where the rules disagree.

    python scripts/visual_maze_probe.py RUN_DIR [--episodes 100] [--model final|sft|...]

Prints the turns' shares (description exact, each of its fields right, the move the teacher's --
any of its rules' --, each rule's, bumps), on the turns where the rules disagree the share that
took each, and the failed episodes counted by their first move other than the teacher's: after
a wrong description, after a right one, or none (docs/results/visual-maze.md).
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path
from typing import Any

import torch

from gyre.config import load_config
from gyre.engines.factory import run_torch_engine
from gyre.models.build import load_pretrained
from gyre.rollout import Rollout
from gyre.rollout.core import run_stops
from gyre.rollout.episodes import run_episodes
from gyre.rollout.evaluate import eval_seeds
from gyre.types import SamplingParams

FIELDS = ("up", "down", "left", "right", "goal offset")


def _fields(line: str) -> list[str]:
    """A compass line ``'.#.+d1l3>'``: the four neighbours' marks, then the goal's offset."""
    return [line[k : k + 1] for k in range(4)] + [line[4:]]


def probe(run_dir: Path, model_dir: str = "final", episodes: int = 100) -> dict[str, Any]:
    cfg = load_config(run_dir / "config.yaml", ["log.console=off"])
    if not cfg.env.visual_maze.describe:
        raise SystemExit("this probe reads the description: the run needs describe: true")
    model, tok = load_pretrained(run_dir / model_dir, torch.device("cpu"))
    engine = run_torch_engine(cfg, model, tok)
    ro = Rollout(cfg, engine, tok)
    stops = run_stops(cfg, tok, ro.chat)
    params = SamplingParams(
        temperature=0.0, max_new_tokens=cfg.train.sampling.max_new_tokens,
        stop_token_ids=stops.token_ids, stop_strings=stops.strings,
    )  # fmt: skip
    seeds = eval_seeds(episodes)
    trajs = run_episodes(ro.make_env, engine, tok, seeds, 1, params, chat=ro.chat, window=ro.window)
    turns: collections.Counter[str] = collections.Counter()
    fails: collections.Counter[str] = collections.Counter()
    rules = [cfg.env.maze.demonstrator, *cfg.env.maze.demonstrator_mix]
    split: collections.Counter[str] = collections.Counter()
    for traj, seed in zip(trajs, seeds, strict=True):
        env = ro.make_env()
        env.reset(seed)
        first = None
        for a, b in traj.turn_spans:
            reply = tok.decode(traj.token_ids[a:b], skip_special_tokens=True).strip()
            said, right = reply.rsplit(" ", 1)[0], env.description()
            move = reply.split()[-1:]
            wants = {rule: [env.maze.move_of(rule)] for rule in rules}
            move_ok = move in wants.values()
            turns["turns"] += 1
            turns["description exact"] += said == right
            for name, x, y in zip(FIELDS, _fields(said), _fields(right), strict=True):
                turns[name] += x == y
            turns["move = teacher's"] += move_ok
            if len(rules) > 1:
                for rule, want in wants.items():
                    turns[f"move = {rule}'s"] += move == want
                if len({w[0] for w in wants.values()}) > 1:  # the rules disagree here
                    split["turns"] += 1
                    for rule, want in wants.items():
                        split[rule] += move == want
            bumps = env.maze.bumps
            env.step(reply)
            turns["bump"] += env.maze.bumps > bumps
            if first is None and not move_ok:
                first = "after a wrong description" if said != right else "after a right one"
        if not traj.success:
            fails[first or "every move the teacher's"] += 1
    n = max(turns.pop("turns"), 1)
    k = split.pop("turns", 0)
    shares = {r: round(split[r] / max(k, 1), 3) for r in rules}
    disagree = {"turns": k, **shares} if len(rules) > 1 else {}
    return {
        "episodes": len(trajs),
        "success": sum(t.success for t in trajs) / max(len(trajs), 1),
        "turns": n,
        "turn shares": {k: round(v / n, 3) for k, v in turns.items()},
        "failures by first move not the teacher's": dict(fails),
        **({"where the rules disagree, the move": disagree} if disagree else {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--episodes", type=int, default=100)
    ap.add_argument("--model", default="final", help="the run's model folder to probe")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for key, value in probe(args.run_dir, args.model, args.episodes).items():
        print(f"{key}: {value}")


if __name__ == "__main__":
    main()
