"""Cost of the reproducible gather in the trainer's scorer, and its effect on the bits.

``gyre.trainer.scoring.gather_states`` picks the hidden state that predicts each scored token
with ``index_select`` on the flattened (rows x width, H) states. It replaced advanced indexing,
``hidden[rows, cols]``, whose backward (``index_put_`` with accumulate) adds float gradients with
parallel atomics at more than one thread: tree packing repeats positions (a group's shared
prompt's last state predicts every answer's first token), so the repeated rows summed in a
varying order and two identical GRPO updates gave different weights.

This script times one GRPO update (phases 3-4 as the loop runs them: the old-logprob recompute and
the maze config's 4 mini-batch AdamW steps, seq-mean-token-mean) on the tiny default model
(hidden 128, 4 layers) for a fixed batch shaped like the maze run's: ``--tasks`` groups of
``--group`` answers sharing a prompt, rows shuffled as a mini-batch's are. Both gathers run from
the same initial state, alternating, ``--repeats`` times each; the figure is the best (fastest)
run of each (load on the machine only slows a run down), with the median next to it. It also
counts the distinct final weights each gather produced over its repeats (1 = reproducible).

Run::

    python bench/deterministic.py                 # 2 threads, 7 repeats
    python bench/deterministic.py --threads 1 --repeats 5
    python bench/deterministic.py --quick         # smoke test

The last line is one JSON object with every figure and the ratio (index_select / indexing).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gyre.trainer.scoring as scoring
from gyre.config import Config, load_config
from gyre.models.build import create_tiny_checkpoint, load_pretrained
from gyre.trainer.advantages import batch_advantages
from gyre.trainer.batch import collate
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.update import policy_update, prepare_batch
from gyre.types import Trajectory

ROOT = Path(__file__).resolve().parents[1]


def indexing(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The former gather: advanced indexing (its backward races at > 1 thread)."""
    return hidden[rows, cols]


def grpo_update(
    cfg: Config, model: torch.nn.Module, opt: torch.optim.Optimizer, trajs: list[Trajectory]
) -> None:
    """Phases 3-4 of a GRPO step, as the loop runs them: collate, old-logprob recompute,
    GRPO advantages, the policy update."""
    train, scoring = cfg.train, ScoringOptions.from_perf(cfg.perf)
    batch = collate(trajs, 0, torch.device("cpu"))
    prepare_batch(model, batch, train, scoring=scoring)
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    adv, _ = batch_advantages(cfg.train.algo.advantage, rewards, groups, batch, train)
    gen = torch.Generator().manual_seed(1)
    policy_update(model, opt, batch, adv, train, generator=gen, scoring=scoring)


def maze_like_batch(tasks: int, group: int, prompt: int, seed: int = 0) -> list[Trajectory]:
    """``tasks`` groups of ``group`` rows: a shared prompt, then 4-12 turns of a 4-token action
    (in the loss) and a 12-token observation (not), rewards 0/1 within each group."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(tasks):
        head = [1, *torch.randint(4, 90, (prompt - 1,), generator=g).tolist()]
        for j in range(group):
            ids, mask = list(head), [0] * prompt
            for _ in range(int(torch.randint(4, 13, (1,), generator=g))):
                ids += torch.randint(4, 90, (4,), generator=g).tolist()
                mask += [1] * 4
                ids += torch.randint(4, 90, (12,), generator=g).tolist()
                mask += [0] * 12
            lps = [-1.0 * m for m in mask]
            out.append(Trajectory(ids, mask, lps, float(j % 2), k, 0, 1, False, k))
    return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=60, help="shared prompt tokens per group")
    ap.add_argument("--quick", action="store_true", help="2 repeats of a 4-task batch")
    a = ap.parse_args()
    if a.quick:
        a.repeats, a.tasks = 2, 4
    torch.set_num_threads(a.threads)
    cfg = load_config(ROOT / "examples/maze/config.yaml", [])
    with tempfile.TemporaryDirectory() as tmp:
        create_tiny_checkpoint(cfg.model, Path(tmp) / "m", cfg.run.seed)
        model, _ = load_pretrained(Path(tmp) / "m", torch.device("cpu"))
    trajs = maze_like_batch(a.tasks, a.group, a.prompt)
    state = copy.deepcopy(model.state_dict())
    variants = {"index_select": scoring.gather_states, "indexing": indexing}
    times: dict[str, list[float]] = {k: [] for k in variants}
    digests: dict[str, set[str]] = {k: set() for k in variants}
    try:
        for _ in range(a.repeats):
            for name, fn in variants.items():
                scoring.gather_states = fn
                model.load_state_dict(state)
                opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
                t0 = time.perf_counter()
                grpo_update(cfg, model, opt, trajs)
                times[name].append(time.perf_counter() - t0)
                h = hashlib.sha256()
                for v in model.state_dict().values():
                    h.update(v.detach().contiguous().numpy().tobytes())
                digests[name].add(h.hexdigest()[:16])
    finally:
        scoring.gather_states = variants["index_select"]
    res = {
        "threads": a.threads,
        "repeats": a.repeats,
        "rows": len(trajs),
        "tokens": sum(len(t.token_ids) for t in trajs),
        "scored_tokens": sum(sum(t.loss_mask) for t in trajs),
    }
    for name in variants:
        best, med = min(times[name]), statistics.median(times[name])
        res[name] = {"best_s": best, "median_s": med, "distinct_weights": len(digests[name])}
        print(
            f"{name:>12}: best {best:.3f} s  median {med:.3f} s  "
            f"distinct final weights over {a.repeats} runs: {len(digests[name])}"
        )
    res["ratio_best"] = res["index_select"]["best_s"] / res["indexing"]["best_s"]
    res["ratio_median"] = res["index_select"]["median_s"] / res["indexing"]["median_s"]
    print(
        f"index_select / indexing: best {res['ratio_best']:.3f}, median {res['ratio_median']:.3f}"
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
