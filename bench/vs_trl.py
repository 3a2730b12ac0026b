"""End-to-end GRPO: gyre against TRL's ``GRPOTrainer``, side by side on the same CPU.

Same task, model, batch and hyper-parameters on both sides:

- task: single-turn arithmetic (``gyre.envs.ArithmeticEnv``, operands 0..``--max-operand``,
  ``+-``: ``"7+5="`` -> ``"12"``, reward 1 iff the integer written is right); step k uses the
  same P task seeds on both sides;
- model: gyre's tiny Llama (char tokenizer), warm-started by a short shared SFT (gyre's
  ``sft_step`` on expert demonstrations) so that reward is not stuck at 0; both sides load the
  very same folder;
- batch: P prompts x G generations per step (default 8 x 8), at most ``--max-new-tokens``
  tokens, stopping at a newline or EOS (TRL: the newline id is added to the model's
  ``generation_config.eos_token_id``), temperature 1, top-p 1, no top-k;
- weights: gyre's engine samples from the trainer's own parameters
  (``engine.weight_sync=shared``; TRL generates with its training model too);
  ``--gyre-weight-sync memory`` gives the engine a copy synced after every step;
- update: one fused AdamW step per batch (TRL's default ``adamw_torch_fused``; lr ``--lr``,
  weight decay 0, grad-norm clip 1.0), PPO-clip
  eps 0.2, group-normalised advantages, per-sequence-then-mean loss (TRL ``loss_type="grpo"``,
  gyre ``seq-mean-token-mean``), no reference model (TRL ``beta=0``), no KL;
- TRL: ``use_cpu=True, bf16=False``, no vLLM, no checkpoints, no logging backends, its default
  gradient (activation) checkpointing on (``--trl-no-grad-ckpt`` turns it off: TRL then skips
  the recomputed forward in backward, at the cost of memory).

Timing: wall time of the training steps only (TRL: from the first ``on_step_begin`` to the last
``on_step_end`` of a callback; gyre: the same span around its step loop: rollout, advantages,
update, weight sync). Each side runs ``--repeats`` times, alternating, and the fastest run
counts (other load can only slow a run down). samples/s = P x G x steps / seconds. Reward:
each side's mean training reward over its steps, and a held-out evaluation of both final
models with the same gyre engine and seeds (mean reward of one sampled answer, temperature 1,
to each of ``--eval-tasks`` tasks), compared task by task: the paired difference gyre - TRL,
its standard error, and a verdict ("equal" within 2 standard errors, else "better" or
"worse").

Run::

    pip install -e '.[bench]'        # TRL is a benchmark-only extra
    python bench/vs_trl.py           # 1 thread, 8 x 8, 10 steps
    python bench/vs_trl.py --quick   # smoke test
    python bench/vs_trl.py --perf share_prefix=false  # gyre without tree packing

The last line of output is one JSON object with every figure and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from gyre.algos import get_advantage_fn
from gyre.config import ModelConfig, TrainConfig, load_config
from gyre.engines import TorchEngine
from gyre.engines.factory import torch_engine_options
from gyre.envs import ArithmeticEnv
from gyre.models.build import count_parameters, create_tiny_checkpoint, load_pretrained
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.trainer.batch import collate
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.sft import sft_step
from gyre.trainer.update import policy_update
from gyre.types import SamplingParams


def _require_trl() -> Any:
    try:
        import trl
    except ImportError as e:  # pragma: no cover - exercised by hand
        raise SystemExit(
            "bench/vs_trl.py needs TRL: pip install 'gyre[bench]'  (benchmark-only extra)"
        ) from e
    return trl


def task_seeds(seed: int, step: int, prompts: int) -> list[int]:
    return [10_000 * seed + 100 * step + k for k in range(prompts)]


def env_maker(max_operand: int) -> Callable[[], ArithmeticEnv]:
    return functools.partial(ArithmeticEnv, max_operand=max_operand, ops="+-")


def warm_start(base: Path, out: Path, steps: int, seed: int, max_operand: int) -> Path:
    """A short SFT on expert answers, shared by both sides (so GRPO has a reward signal)."""
    model, tok = load_pretrained(base, torch.device("cpu"))
    make_env = env_maker(max_operand)
    if steps > 0:
        rng = np.random.default_rng(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
        for k in range(steps):
            demos = [
                demonstrate(make_env, tok, 1_000_000 + 64 * k + j, 0.0, rng) for j in range(32)
            ]
            sft_step(model, opt, collate(demos, tok.pad_token_id, torch.device("cpu")), 32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def evaluate_rewards(
    model: torch.nn.Module, tok: Any, tasks: int, max_new: int, max_operand: int
) -> list[float]:
    """The reward of one sampled answer (temperature 1) to each of ``tasks`` held-out tasks;
    the same tasks and sampling seeds for every model, so two models' lists pair up."""
    engine = TorchEngine(copy.deepcopy(model), tok.pad_token_id, seed=0)
    params = SamplingParams(1.0, 1.0, max_new, stop_ids(tok), seed=12345)
    seeds = [5_000_000 + k for k in range(tasks)]
    trajs = run_episodes(env_maker(max_operand), engine, tok, seeds, 1, params)
    return [float(t.reward) for t in trajs]


def reward_verdict(gyre: Sequence[float], trl: Sequence[float]) -> dict[str, Any]:
    """Paired comparison of two models' held-out rewards on the same tasks: the mean
    difference gyre - TRL, its standard error, and a verdict: "better" / "worse" when the
    difference is beyond 2 standard errors, else "equal" (within sampling noise)."""
    d = np.asarray(gyre, dtype=float) - np.asarray(trl, dtype=float)
    n = len(d)
    diff = float(d.mean()) if n else 0.0
    se = float(d.std(ddof=1) / np.sqrt(n)) if n > 1 else float("inf")
    verdict = "better" if diff > 2 * se else "worse" if diff < -2 * se else "equal"
    return {"diff": round(diff, 4), "se": round(se, 4), "verdict": verdict}


# -- gyre -------------------------------------------------------------------------------------
def run_gyre(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    model, tok = load_pretrained(path, torch.device("cpu"))
    # weight_sync "shared" (gyre's engine.weight_sync=shared, as TRL samples from its training
    # model): the engine samples from the trainer's parameters; "memory" copies them each step
    shared = args.gyre_weight_sync == "shared"
    perf = args.perf_config  # --perf KEY=VALUE: the run config's perf.* keys (gyre side)
    engine = TorchEngine(
        model if shared else copy.deepcopy(model),
        tok.pad_token_id,
        seed=args.seed,
        options=torch_engine_options(perf),
    )
    # fused: the same AdamW kernel as TRL (transformers defaults to optim="adamw_torch_fused")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    # one optimizer step per batch with the engine's log-probs as the old policy, as TRL does
    settings = TrainConfig.model_validate(
        {
            "clip_eps": 0.2,
            "mini_batches": 1,
            "micro_batch_size": args.prompts * args.group_size,
            "max_grad_norm": 1.0,
            "loss_agg": "seq-mean-token-mean",
            "algo": {"old_logprobs": "rollout"},
        }
    )
    adv_fn = get_advantage_fn("grpo")
    stops = stop_ids(tok)
    rewards: list[float] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        params = SamplingParams(1.0, 1.0, args.max_new_tokens, stops, seed=args.seed + step)
        trajs = run_episodes(
            env_maker(args.max_operand),
            engine,
            tok,
            task_seeds(args.seed, step, args.prompts),
            args.group_size,
            params,
            continuous=perf.continuous,
        )
        r = torch.tensor([t.reward for t in trajs])
        adv = adv_fn(r, torch.tensor([t.group_id for t in trajs]), eps=1e-6)
        batch = collate(trajs, tok.pad_token_id, torch.device("cpu"))
        policy_update(model, opt, batch, adv, settings, scoring=ScoringOptions.from_perf(perf))
        if shared:
            engine.weights_changed(version=step + 1)
        else:
            engine.load_weights(model.state_dict(), version=step + 1)
        rewards.append(float(r.mean()))
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "rewards": rewards,
        "eval_rewards": evaluate_rewards(
            model, tok, args.eval_tasks, args.max_new_tokens, args.max_operand
        ),
    }


# -- TRL --------------------------------------------------------------------------------------
def run_trl(path: Path, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    trl = _require_trl()
    from datasets import Dataset
    from tokenizers import processors
    from transformers import TrainerCallback

    model, tok = load_pretrained(path, torch.device("cpu"))
    # Same prompt tokens as gyre (BOS + text): TRL tokenizes plain-text prompts with specials.
    tok._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)]
    )
    model.generation_config.eos_token_id = list(stop_ids(tok))
    env = env_maker(args.max_operand)()
    prompts, answers = [], []
    for step in range(args.steps):
        for s in task_seeds(args.seed, step, args.prompts):
            prompts.append(env.reset(s))
            answers.append(env.answer)
    data = Dataset.from_dict({"prompt": prompts, "answer": answers})

    def reward(completions: list[str], answer: list[int], **_: Any) -> list[float]:
        out = []
        for text, ans in zip(completions, answer, strict=True):
            try:
                out.append(1.0 if int(text.split("\n")[0].strip()) == ans else 0.0)
            except ValueError:
                out.append(0.0)
        return out

    n = args.prompts * args.group_size
    cfg = trl.GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        gradient_checkpointing=not args.trl_no_grad_ckpt,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        loss_type="grpo",
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        shuffle_dataset=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )

    class Clock(TrainerCallback):
        start: float | None = None
        end: float | None = None

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if self.start is None:
                self.start = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.end = time.perf_counter()

    clock = Clock()
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    # the prompts are taken in order: step k sees the same tasks as gyre's step k
    trainer.train()
    assert clock.start is not None and clock.end is not None
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    trained = trainer.model
    return {
        "seconds": clock.end - clock.start,
        "rewards": rewards,
        "eval_rewards": evaluate_rewards(
            trained, tok, args.eval_tasks, args.max_new_tokens, args.max_operand
        ),
        "trl": trl.__version__,
    }


# -- driver -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per step (P)")
    p.add_argument("--group-size", type=int, default=8, help="generations per prompt (G)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=32,
        help="completion budget on both sides (the issue's <= 32; answers stop at a newline)",
    )
    p.add_argument("--steps", type=int, default=20, help="GRPO steps on each side")
    p.add_argument("--max-operand", type=int, default=9, help="operands in [0, N], ops +-")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--sft-steps", type=int, default=300, help="shared warm start (0: none)")
    p.add_argument(
        "--eval-tasks", type=int, default=2048, help="held-out tasks (one sampled answer each)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="runs per side, alternated; best")
    p.add_argument(
        "--trl-no-grad-ckpt",
        action="store_true",
        help="TRL without its default gradient checkpointing (faster, more memory)",
    )
    p.add_argument(
        "--gyre-weight-sync",
        choices=["shared", "memory"],
        default="shared",
        help="gyre's engine: sample from the trainer's parameters (engine.weight_sync=shared, "
        "as TRL does) or from a copy synced each step (memory)",
    )
    p.add_argument(
        "--perf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="gyre's training run: a perf.* config key, e.g. share_prefix=false (repeatable)",
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes: smoke test")
    args = p.parse_args(argv)
    try:
        args.perf_config = load_config(None, [f"perf.{item}" for item in args.perf]).perf
    except ValueError as exc:
        p.error(str(exc))
    if args.quick:
        args.prompts, args.group_size, args.steps = 2, 4, 2
        args.sft_steps, args.eval_tasks, args.max_new_tokens = 5, 8, 4
        args.repeats = 1
    for name in ("threads", "prompts", "steps", "max_new_tokens", "eval_tasks", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.group_size < 2:
        p.error("--group-size must be at least 2 (group-relative advantages)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _require_trl()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gyre-vs-trl-") as tmp:
        work = Path(tmp)
        base = create_tiny_checkpoint(ModelConfig(), work / "tiny", args.seed)
        warm = warm_start(base, work / "warm", args.sft_steps, args.seed, args.max_operand)
        model, _ = load_pretrained(warm, torch.device("cpu"))
        start_reward = float(
            np.mean(
                evaluate_rewards(model, _, args.eval_tasks, args.max_new_tokens, args.max_operand)
            )
        )
        g_runs, t_runs = [], []
        for _ in range(args.repeats):  # alternated, so background load hits both sides alike
            g_runs.append(run_gyre(warm, args))
            t_runs.append(run_trl(warm, args, work))
        g = min(g_runs, key=lambda r: r["seconds"])
        t = min(t_runs, key=lambda r: r["seconds"])
    samples = args.prompts * args.group_size * args.steps
    verdict = reward_verdict(g["eval_rewards"], t["eval_rewards"])
    report: dict[str, Any] = {
        "bench": "vs_trl",
        "threads": args.threads,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.steps,
        "lr": args.lr,
        "max_operand": args.max_operand,
        "samples": samples,
        "repeats": args.repeats,
        "gyre_seconds_all": [round(r["seconds"], 3) for r in g_runs],
        "trl_seconds_all": [round(r["seconds"], 3) for r in t_runs],
        "gyre_seconds": round(g["seconds"], 3),
        "trl_seconds": round(t["seconds"], 3),
        "gyre_samples_per_s": round(samples / g["seconds"], 2),
        "trl_samples_per_s": round(samples / t["seconds"], 2),
        "ratio": round(t["seconds"] / g["seconds"], 3),
        "gyre_s_per_step": round(g["seconds"] / args.steps, 4),
        "trl_s_per_step": round(t["seconds"] / args.steps, 4),
        "start_eval_reward": round(start_reward, 4),
        "gyre_train_reward_mean": round(float(np.mean(g["rewards"])), 4),
        "trl_train_reward_mean": round(float(np.mean(t["rewards"])), 4) if t["rewards"] else None,
        "gyre_eval_reward": round(float(np.mean(g["eval_rewards"])), 4),
        "trl_eval_reward": round(float(np.mean(t["eval_rewards"])), 4),
        "eval_tasks": args.eval_tasks,
        "eval_reward_gyre_minus_trl": verdict,
        "model_params": count_parameters(model),
        "sft_steps": args.sft_steps,
        "trl_gradient_checkpointing": not args.trl_no_grad_ckpt,
        "gyre_perf": args.perf_config.model_dump(),
        "gyre_weight_sync": args.gyre_weight_sync,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": t["trl"],
    }
    print(
        f"GRPO end to end, {args.prompts}x{args.group_size} per step, {args.steps} steps, "
        f"{args.threads} thread(s), tiny model ({report['model_params']:,} params)"
    )
    print(f"{'side':<6}{'s/step':>9}{'samples/s':>11}{'train reward':>14}{'eval reward':>13}")
    for side in ("gyre", "trl"):
        tr = report[f"{side}_train_reward_mean"]
        tr = float("nan") if tr is None else tr
        sps, rate = report[f"{side}_s_per_step"], report[f"{side}_samples_per_s"]
        print(f"{side:<6}{sps:>9.3f}{rate:>11.1f}{tr:>14.3f}{report[f'{side}_eval_reward']:>13.3f}")
    print(
        f"ratio gyre/TRL samples/s: {report['ratio']:.2f}x  (start eval reward {start_reward:.3f})"
    )
    print(
        f"held-out reward gyre - TRL over {args.eval_tasks} paired tasks: {verdict['diff']:+.4f}"
        f" (s.e. {verdict['se']:.4f}): {verdict['verdict']}"
    )
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
