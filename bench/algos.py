"""Every algorithm from the same maze SFT checkpoint with the same budget, side by side.

One SFT warm start on the maze (the default demonstrations; ``--sft-steps`` of them), then for
each algorithm a fresh ``gyre.loop.train`` from that checkpoint with identical settings except
the algorithm's own keys: the same tasks, the same sampling seeds, the same number of steps,
tasks and samples per step, learning rate and threads. Reported per algorithm:

- held-out greedy success on ``--episodes`` maze seeds (``2^31 + i``) before (the SFT
  checkpoint, same for all) and after ``--steps`` steps;
- wall time of the RL steps (rollout + update + sync, from ``metrics.jsonl``; the held-out
  evaluations are excluded);
- final KL(pi_final || pi_SFT): the k3 estimator averaged over the policy tokens of
  ``--kl-episodes`` held-out episodes sampled from the final policy (temperature 1).

It is a small budget on a shared 2-core CPU: the differences between algorithms are within
seed noise for budgets this small; the table shows that each one trains, how long it takes and
how far it moves from the start, not which is best.

Run::

    python bench/algos.py                       # SFT (300 steps) + 10 algorithms, 1 thread
    python bench/algos.py --sft runs/default/sft  # reuse a maze SFT checkpoint (~14 min)
    python bench/algos.py --write-docs          # ... and replace the table in docs/algorithms.md
    python bench/algos.py --quick               # smoke test (tiny model, 1 step, a few seconds)
    python bench/algos.py --algos grpo,gae      # a subset

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gyre.algos.losses import kl_k3
from gyre.config import load_config
from gyre.engines import TorchEngine
from gyre.envs import env_factory
from gyre.loop import base_model_path, setup
from gyre.models.build import load_pretrained
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.rollout.evaluate import eval_seeds
from gyre.runners import train
from gyre.sft import run_sft
from gyre.trainer.batch import collate, token_logprobs
from gyre.types import SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs" / "algorithms.md"
BEGIN, END = "<!-- bench:algos:begin -->", "<!-- bench:algos:end -->"

# name -> (overrides, one-line description). Everything not listed is the shared default.
ALGOS: dict[str, tuple[list[str], str]] = {
    "grpo": ([], "GRPO: group std-normalised, PPO-clip 0.2, seq-mean-token-mean (the default)"),
    "dr_grpo": (
        ["train.algo.advantage=dr_grpo", "train.loss_agg=seq-mean-token-sum-norm"],
        "Dr. GRPO: mean-only advantage, constant-length normaliser",
    ),
    "rloo": (["train.algo.advantage=rloo"], "RLOO: leave-one-out baseline"),
    "reinforce_pp": (
        [
            "train.algo.advantage=reinforce_pp",
            "train.kl_coef=0.01",
            "train.algo.kl_in=reward",
            "train.algo.kl_type=k1",
        ],
        "REINFORCE++: k1 KL in the reward (0.01), batch-whitened return",
    ),
    "reinforce_pp_baseline": (
        ["train.algo.advantage=reinforce_pp_baseline"],
        "REINFORCE++-baseline: group mean, batch-whitened",
    ),
    "gae": (
        ["train.algo.advantage=gae", "train.algo.lam=0.95", "train.algo.value_model=critic"],
        "PPO + GAE (lambda 0.95), separate critic",
    ),
    "gspo": (
        ["train.algo.policy_loss=gspo", "train.clip_eps=3e-4", "train.algo.clip_eps_high=4e-4"],
        "GSPO: sequence-level ratio, eps 3e-4 / 4e-4",
    ),
    "cispo": (
        ["train.algo.policy_loss=cispo", "train.clip_eps=1.0", "train.algo.clip_eps_high=0.28"],
        "CISPO: clipped IS weight, no lower bound, eps_high 0.28",
    ),
    "reinforce": (
        ["train.algo.policy_loss=reinforce", "train.mini_batches=1"],
        "REINFORCE: GRPO advantages, no ratio, one update per batch",
    ),
    "dapo": (
        [
            "train.dapo.dynamic_sampling=true",
            "train.algo.clip_eps_high=0.28",
            "train.loss_agg=token-mean",
        ],
        "DAPO: dynamic sampling, clip-higher 0.28, token-mean",
    ),
    "gigpo": (
        ["train.algo.advantage=gigpo", "train.algo.gamma=0.95", "train.algo.gigpo_step_weight=1"],
        "GiGPO: GRPO episode advantage + anchor-state (maze cell) step advantage, gamma 0.95",
    ),
}


def _shared(args: argparse.Namespace) -> list[str]:
    out = [
        f"train.steps={args.steps}",
        f"train.tasks_per_step={args.tasks}",
        f"train.group_size={args.group}",
        f"eval.episodes={args.episodes}",
        "eval.every=0",
        "eval.sampled=false",
        "checkpoint.every=0",
        "log.console=off",
        f"run.threads={args.threads}",
        f"run.seed={args.seed}",
    ]
    if args.quick:
        out += ["model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64"]
    return out


@torch.no_grad()
def final_kl(
    final_dir: Path, sft_dir: Path, cfg: Any, episodes: int, seed: int
) -> tuple[float, float]:
    """(mean k3 KL(final || sft) per policy token, its standard error) on sampled held-out
    episodes of the final policy."""
    device = torch.device("cpu")
    final, tok = load_pretrained(final_dir, device)
    sft, _ = load_pretrained(sft_dir, device)
    engine = TorchEngine(final, tok.pad_token_id, seed=seed)
    s = cfg.train.sampling
    params = SamplingParams(s.temperature, s.top_p, s.max_new_tokens, stop_ids(tok), seed)
    seeds = eval_seeds(episodes)
    trajs = run_episodes(env_factory(cfg.env), engine, tok, seeds, 1, params)
    batch = collate(trajs, tok.pad_token_id, device)
    lp_final, _ = token_logprobs(final.eval(), batch, s.temperature, s.top_p)
    lp_sft, _ = token_logprobs(sft.eval(), batch, s.temperature, s.top_p)
    kl = kl_k3(lp_final, lp_sft) * batch.loss_mask
    per_episode = kl.sum(dim=1) / batch.loss_mask.sum(dim=1).clamp(min=1)
    mean = float(kl.sum() / batch.loss_mask.sum())
    se = float(per_episode.std() / len(trajs) ** 0.5) if len(trajs) > 1 else 0.0
    return mean, se


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    root = Path(args.out or tempfile.mkdtemp(prefix="gyre-bench-algos-"))
    shared = _shared(args)
    sft_dir = Path(args.sft) if args.sft else None
    report: dict[str, Any] = {"bench": "algos", "threads": args.threads, "results": {}}
    t0 = time.perf_counter()
    if sft_dir is None:
        sft_cfg = load_config(
            None,
            [
                *shared,
                f"run.dir={root / 'sft_run'}",
                f"sft.steps={args.sft_steps}",
                *(["sft.demos=64", "sft.batch_size=8"] if args.quick else []),
            ],
        )
        run_dir, device = setup(sft_cfg)
        sft_dir = run_sft(sft_cfg, run_dir, device, base_model_path(sft_cfg, run_dir))
    report["sft_s"] = time.perf_counter() - t0
    report["sft_dir"] = str(sft_dir)
    names = args.algos.split(",") if args.algos else list(ALGOS)
    for name in names:
        if name not in ALGOS:
            raise SystemExit(f"unknown algorithm {name!r}; valid: {', '.join(ALGOS)}")
        overrides, desc = ALGOS[name]
        run_dir = root / name
        cfg = load_config(
            None,
            [*shared, *overrides, f"model.path={sft_dir}", "sft.steps=0", f"run.dir={run_dir}"],
        )
        summary = train(cfg)
        torch.set_num_threads(args.threads)
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "train/loss" in r]
        rl_s = sum(
            r.get(k, 0.0) for r in steps for k in ("time/rollout_s", "time/train_s", "time/sync_s")
        )
        kl, kl_se = final_kl(run_dir / "final", sft_dir, cfg, args.kl_episodes, args.seed)
        res = {
            "description": desc,
            "overrides": overrides,
            "before": summary["before"].get("eval/success_greedy"),
            "after": summary["after"].get("eval/success_greedy"),
            "rl_wall_s": rl_s,
            "final_kl": kl,
            "final_kl_se": kl_se,
            "train_reward_last": steps[-1]["rollout/reward_mean"] if steps else None,
        }
        report["results"][name] = res
        print(
            f"{name:22s} before {res['before']:.3f} after {res['after']:.3f} "
            f"RL {rl_s:6.1f}s  KL {kl:.4f}",
            flush=True,
        )
    report["total_s"] = time.perf_counter() - t0
    return report


def table(report: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "| algorithm | held-out greedy success: SFT → after | change | RL wall time | "
        "final KL(π‖π_SFT) per token |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in report["results"].items():
        lines.append(
            f"| `{name}` — {r['description']} | {100 * r['before']:.1f} % → "
            f"{100 * r['after']:.1f} % | {100 * (r['after'] - r['before']):+.1f} pts | "
            f"{r['rl_wall_s']:.0f} s | {r['final_kl']:.4f} ± {r['final_kl_se']:.4f} |"
        )
    n_eval = args.episodes
    se = 100 * (0.25 / n_eval) ** 0.5
    start = f"`{args.sft}`" if args.sft else f"a fresh SFT run of {args.sft_steps} steps"
    lines += [
        "",
        f"Budget: {args.steps} steps × {args.tasks} tasks × {args.group} samples from one "
        f"maze SFT checkpoint ({start}), {n_eval} held-out greedy episodes "
        f"(a success rate's standard error is up to ±{se:.1f} points), KL on "
        f"{args.kl_episodes} sampled held-out episodes, {args.threads} torch thread(s), seed "
        f"{args.seed}. "
        + (f"SFT took {report['sft_s']:.0f} s; " if not args.sft else "")
        + f"the whole bench {report['total_s']:.0f} s.",
    ]
    return "\n".join(lines)


def write_docs(text: str, command: str) -> None:
    body = f"{BEGIN}\nMeasured with `{command}`:\n\n{text}\n{END}"
    doc = DOCS.read_text()
    if BEGIN in doc and END in doc:
        doc = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: body, doc, flags=re.S)
    else:
        doc = doc.rstrip() + "\n\n" + body + "\n"
    DOCS.write_text(doc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="RL steps per algorithm")
    p.add_argument("--tasks", type=int, default=6, help="tasks per step")
    p.add_argument("--group", type=int, default=8, help="samples per task")
    p.add_argument("--episodes", type=int, default=200, help="held-out eval episodes")
    p.add_argument("--kl-episodes", type=int, default=48, help="episodes for the final KL")
    p.add_argument("--sft-steps", type=int, default=300, help="SFT steps (when no --sft)")
    p.add_argument("--sft", default="", help="reuse this SFT checkpoint folder")
    p.add_argument("--algos", default="", help="comma-separated subset of " + ",".join(ALGOS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="", help="run directories go here (default: a temp dir)")
    p.add_argument("--write-docs", action="store_true", help="update docs/algorithms.md")
    p.add_argument("--from-json", default="", help="re-render a saved report (its last line)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny model and budget")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.tasks, args.group, args.episodes = 1, 2, 2, 4
        args.kl_episodes, args.sft_steps = 2, 2
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text().strip().splitlines()[-1])
    else:
        report = run(args)
    text = table(report, args)
    print(text)
    if args.write_docs:
        write_docs(text, "python " + " ".join(["bench/algos.py", *(argv or sys.argv[1:])]))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
