"""Why does a trained maze policy fail? Greedy play on held-out mazes, and at each failed
episode's first blocked move, the policy's probabilities of u, d, l, r (temperature 1).

    python scripts/maze_probe.py RUN_DIR [--episodes 200] [--model final|sft|...]

Prints a few blocked states (the view, the move, the four probabilities), the failures counted
by the state of their first blocked move -- (number of open moves, whether all are visited) --
or ``no bump``, and the margin p(blocked move) - p(best open move) over those states
(docs/results/maze.md, "Levers measured against the weak-teacher recipe").
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from gyre.config import load_config
from gyre.engines import TorchEngine
from gyre.envs import env_factory
from gyre.envs.maze import MOVES
from gyre.models.build import load_pretrained
from gyre.rollout.core import run_stops
from gyre.rollout.episodes import run_episodes
from gyre.rollout.evaluate import eval_seeds
from gyre.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--episodes", type=int, default=200)
    ap.add_argument("--model", default="final", help="the run's model folder to probe")
    ap.add_argument("--show", type=int, default=12, help="blocked states to print")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(f"{args.run_dir}/config.yaml", [])
    model, tok = load_pretrained(f"{args.run_dir}/{args.model}", torch.device("cpu"))
    model.eval()
    make_env = env_factory(cfg.env)
    stops = run_stops(cfg, tok)
    greedy = SamplingParams(
        0.0, 1.0, cfg.train.sampling.max_new_tokens, stops.token_ids, 0,
        stop_strings=stops.strings,
    )  # fmt: skip
    engine = TorchEngine(model, tok.pad_token_id, seed=0)
    trajs = run_episodes(make_env, engine, tok, eval_seeds(args.episodes), 1, greedy)
    ids = {m: tok.convert_tokens_to_ids(m) for m in MOVES}
    kinds: collections.Counter = collections.Counter()
    margins, shown = [], 0
    print(f"solved {sum(t.success for t in trajs)} / {args.episodes}")
    for t in (t for t in trajs if not t.success):
        env = make_env()
        env.reset(t.task_seed)
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([t.token_ids])).logits[0], -1)
        for s, e in t.turn_spans:
            view, pos = env.render(), env.pos
            move = tok.decode(t.token_ids[s:e], skip_special_tokens=True).strip()[:1]
            p = {m: float(probs[s - 1, i]) for m, i in ids.items()}
            legal = [m for m, (dr, dc) in MOVES.items() if env._open(pos[0] + dr, pos[1] + dc)]
            env.step(move)
            if env.pos != pos and move in MOVES:
                continue
            seen = all((pos[0] + MOVES[m][0], pos[1] + MOVES[m][1]) in env.visited for m in legal)
            kinds[(len(legal), seen)] += 1
            if move in p and legal:
                margins.append(p[move] - max(p[m] for m in legal))
            if shown < args.show:
                print(
                    repr(view.split("\n")[-1]),
                    "->",
                    repr(move),
                    {m: round(v, 2) for m, v in p.items()},
                )
                shown += 1
            break
        else:
            kinds["no bump"] += 1
    print(dict(kinds))
    if margins:
        q = np.quantile(margins, [0.1, 0.5, 0.9])
        print(f"p(blocked) - p(best open move): median {q[1]:.2f} (10-90 %: {q[0]:.2f}-{q[2]:.2f})")


if __name__ == "__main__":
    main()
