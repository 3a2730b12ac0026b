"""End-to-end GRPO: gyre against TRL's ``GRPOTrainer``, side by side on the same CPU.

Same task, model, batch and hyper-parameters on both sides. Two tasks:

- default: single-turn arithmetic (``gyre.envs.ArithmeticEnv``, operands 0..``--max-operand``,
  ``+-``: ``"7+5="`` -> ``"12"``, reward 1 iff the integer written is right) on gyre's tiny Llama
  (char tokenizer), warm-started by a short shared SFT (gyre's ``sft_step`` on expert
  demonstrations) so that reward is not stuck at 0; prompts are BOS + text on both sides;
  answers stop at a newline or EOS (TRL: the newline id is added to the model's
  ``generation_config.eos_token_id``); step k uses the same P task seeds on both sides;
- ``--model DIR``: a Hugging Face instruct model with a chat template, untouched (no SFT), on a
  prompt dataset (``--tasks``, default ``examples/smollm2-math/tasks.jsonl``), each prompt one
  user message rendered by the model's own template on both sides (TRL: a conversational
  dataset); step k trains on rows k*P .. k*P+P-1 on both sides, the held-out rows are the
  file's last ``--eval-tasks``; replies stop at the template's end-of-turn (``<|im_end|>``);
  reward ``gyre.rewards.math_answer`` on both sides (``bench/vs_trl_chat.py``). The bench
  asserts that both sides generate from the same prompt token ids.

On both:

- model: both sides load the very same folder, in fp32;
- batch: P prompts x G generations per step (default 8 x 8), at most ``--max-new-tokens``
  tokens, temperature ``--temperature``, top-p 1, no top-k;
- weights: gyre's engine samples from the trainer's own parameters
  (``engine.weight_sync=shared``; TRL generates with its training model too);
  ``--gyre-weight-sync memory`` gives the engine a copy synced after every step;
- update: one fused AdamW step per batch (TRL's default ``adamw_torch_fused``; lr ``--lr``,
  constant, weight decay 0, grad-norm clip 1.0), PPO-clip eps 0.2, group-normalised
  advantages, per-sequence-then-mean loss (TRL ``loss_type="grpo"``, gyre
  ``seq-mean-token-mean``), no reference model (TRL ``beta=0``), no KL;
- TRL: ``use_cpu=True, bf16=False``, no vLLM, no checkpoints, no logging backends, its default
  gradient (activation) checkpointing on (``--trl-no-grad-ckpt`` turns it off: TRL then skips
  the recomputed forward in backward, at the cost of memory).

Timing: wall time of the training steps only (TRL: from the first ``on_step_begin`` to the last
``on_step_end`` of a callback; gyre: the same span around its step loop: rollout, reward,
advantages, update, weight sync). Each side runs ``--repeats`` times, alternating, and the
fastest run counts (other load can only slow a run down). samples/s = P x G x steps / seconds.
Reward: each side's mean training reward over its steps, and a held-out evaluation of both
final models with the same gyre engine and seeds, compared task by task: the paired difference
gyre - TRL, its standard error, and a verdict ("equal" within 2 standard errors, else "better"
or "worse"). The held-out score is the reward of one sampled answer (temperature
``--temperature``) to each of ``--eval-tasks`` tasks; with ``--model`` also of the greedy
answer (the more meaningful figure for a real model), and the untouched model's scores.

Run::

    pip install -e '.[bench]'        # TRL is a benchmark-only extra
    python bench/vs_trl.py           # tiny model: 1 thread, 8 x 8, 20 steps
    python bench/vs_trl.py --quick   # smoke test
    python bench/vs_trl.py --perf share_prefix=false  # gyre without tree packing
    python bench/vs_trl.py --model DIR  # an instruct model: 8 x 8, 10 steps, 64 new tokens
    python bench/vs_trl.py --model DIR --quick  # smoke test: 2 x 2, 2 steps, 8 held-out rows

The last line of output is one JSON object with every figure and the ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from gyre.algos import get_advantage_fn
from gyre.config import ModelConfig, TrainConfig, load_config
from gyre.engines import TorchEngine
from gyre.engines.factory import torch_engine_options
from gyre.errors import InputError
from gyre.models.build import count_parameters, create_tiny_checkpoint, load_pretrained
from gyre.models.lean import enable_activation_checkpointing
from gyre.trainer.batch import collate
from gyre.trainer.scoring import ScoringOptions
from gyre.trainer.update import policy_update

sys.path.insert(0, str(Path(__file__).parent))
from vs_trl_tasks import (
    DEFAULT_TASKS,
    ArithmeticTask,
    ChatTask,
    prompt_ids,
    trl_prompt_ids,
    warm_start,
)

# Per-task defaults of the flags left unset: the tiny model's, and an instruct model's
# (--model: examples/smollm2-math/config.yaml's lr, temperature and reply budget).
DEFAULTS = {
    "tiny": {"max_new_tokens": 32, "steps": 20, "lr": 3e-4, "temperature": 1.0,
             "eval_tasks": 2048, "repeats": 5, "sft_steps": 300, "max_operand": 9},
    "model": {"max_new_tokens": 64, "steps": 10, "lr": 5e-6, "temperature": 0.8,
              "eval_tasks": 200, "repeats": 1},
}  # fmt: skip


def _require_trl() -> Any:
    try:
        import trl
    except ImportError as e:  # pragma: no cover - exercised by hand
        raise SystemExit(
            "bench/vs_trl.py needs TRL: pip install 'gyre[bench]'  (benchmark-only extra)"
        ) from e
    return trl


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


def evaluate(task: Any, model: torch.nn.Module, tok: Any, args: argparse.Namespace):
    return task.evaluate(model, tok, args.eval_tasks, args.max_new_tokens, args.temperature)


# -- gyre -------------------------------------------------------------------------------------
def run_gyre(path: Path, task: Any, args: argparse.Namespace) -> dict[str, Any]:
    model, tok = load_pretrained(path, torch.device("cpu"))
    # weight_sync "shared" (gyre's engine.weight_sync=shared, as TRL samples from its training
    # model): the engine samples from the trainer's parameters; "memory" copies them each step
    shared = args.gyre_weight_sync == "shared"
    perf = args.perf_config  # --perf KEY=VALUE: the run config's perf.* keys (gyre side)
    if perf.activation_checkpointing:  # as a gyre run sets it on its policy
        enable_activation_checkpointing(model)
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
    rewards: list[float] = []
    first_prompts: list[list[int]] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        params = task.sampling(tok, args.temperature, args.max_new_tokens, args.seed + step)
        seeds = task.seeds(step, args.prompts)
        trajs = task.play(engine, tok, seeds, args.group_size, params, perf, step)
        r = torch.tensor([t.reward for t in trajs])
        adv = adv_fn(r, torch.tensor([t.group_id for t in trajs]), eps=1e-6)
        batch = collate(trajs, tok.pad_token_id, torch.device("cpu"))
        policy_update(model, opt, batch, adv, settings, scoring=ScoringOptions.from_perf(perf))
        if shared:
            engine.weights_changed(version=step + 1)
        else:
            engine.load_weights(model.state_dict(), version=step + 1)
        rewards.append(float(r.mean()))
        if step == 0:
            first_prompts = prompt_ids(trajs, args.group_size)
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "rewards": rewards,
        "eval": evaluate(task, model, tok, args),
        "prompt_ids": first_prompts,
    }


# -- TRL --------------------------------------------------------------------------------------
def trl_config(args: argparse.Namespace, workdir: Path) -> Any:
    """TRL's settings: the same batch, sampling and update as gyre's (module docstring)."""
    trl = _require_trl()
    return trl.GRPOConfig(
        output_dir=str(workdir / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        per_device_train_batch_size=args.prompts * args.group_size,
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
        temperature=args.temperature,
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


def run_trl(path: Path, task: Any, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    trl = _require_trl()
    from datasets import Dataset
    from transformers import TrainerCallback

    model, tok = load_pretrained(path, torch.device("cpu"))
    task.trl_setup(model, tok)
    seeds = [s for step in range(args.steps) for s in task.seeds(step, args.prompts)]
    data = Dataset.from_dict(task.trl_rows(seeds))

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
        reward_funcs=task.trl_reward,
        args=trl_config(args, workdir),
        train_dataset=data,
        processing_class=tok,
        callbacks=[clock],
    )
    # the ids TRL will generate from for step 0's prompts, checked against gyre's
    first_prompts = trl_prompt_ids(trainer, list(data["prompt"][: args.prompts]))
    # the prompts are taken in order: step k sees the same tasks as gyre's step k
    trainer.train()
    assert clock.start is not None and clock.end is not None
    rewards = [float(h["reward"]) for h in trainer.state.log_history if "reward" in h]
    return {
        "seconds": clock.end - clock.start,
        "rewards": rewards,
        "eval": evaluate(task, trainer.model, tok, args),
        "prompt_ids": first_prompts,
        "trl": trl.__version__,
    }


# -- driver -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a Hugging Face instruct model folder with a chat template (default: gyre's tiny "
        "Llama on raw-text arithmetic)",
    )
    p.add_argument(
        "--tasks",
        type=Path,
        default=None,
        help=f"--model: the prompt dataset, JSONL {{prompt, answer}} (default {DEFAULT_TASKS})",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=8, help="distinct prompts per step (P)")
    p.add_argument("--group-size", type=int, default=8, help="generations per prompt (G)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        help="completion budget on both sides (default: 32 tiny model, 64 --model)",
    )
    p.add_argument("--steps", type=int, help="GRPO steps on each side (default 20; --model 10)")
    p.add_argument("--max-operand", type=int, help="tiny model: operands in [0, N] (default 9)")
    p.add_argument("--lr", type=float, help="default 3e-4; --model 5e-6")
    p.add_argument("--temperature", type=float, help="sampling (default 1.0; --model 0.8)")
    p.add_argument(
        "--sft-steps", type=int, help="tiny model: shared warm start (default 300, 0: none)"
    )
    p.add_argument(
        "--eval-tasks",
        type=int,
        help="held-out tasks, one sampled answer each (default 2048; --model: the last 200 "
        "rows of --tasks, greedy and sampled)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, help="runs per side, alternated; best (default 5; 1)")
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
    mode = "model" if args.model is not None else "tiny"
    if mode == "model":
        for name in ("sft_steps", "max_operand"):  # the instruct model is the start, as is
            if getattr(args, name) is not None:
                p.error(f"--{name.replace('_', '-')} is for the tiny model; --model takes none")
        args.tasks = args.tasks or DEFAULT_TASKS
    elif args.tasks is not None:
        p.error("--tasks needs --model (the tiny model's task is raw-text arithmetic)")
    for name, value in DEFAULTS[mode].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.quick and mode == "tiny":
        args.prompts, args.group_size, args.steps = 2, 4, 2
        args.sft_steps, args.eval_tasks, args.max_new_tokens = 5, 8, 4
        args.repeats = 1
    elif args.quick:
        args.prompts, args.group_size, args.steps = 2, 2, 2
        args.eval_tasks, args.max_new_tokens, args.repeats = 8, 16, 1
    for name in ("threads", "prompts", "steps", "max_new_tokens", "eval_tasks", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.group_size < 2:
        p.error("--group-size must be at least 2 (group-relative advantages)")
    return args


def model_folder(args: argparse.Namespace, work: Path) -> Path:
    """The model folder both sides load: ``--model``, or the tiny model after its warm start."""
    if args.model is not None:
        return args.model
    base = create_tiny_checkpoint(ModelConfig(), work / "tiny", args.seed)
    return warm_start(base, work / "warm", args.sft_steps, args.seed, args.max_operand)


def make_task(args: argparse.Namespace, tok: Any, work: Path) -> ArithmeticTask | ChatTask:
    if args.model is None:
        return ArithmeticTask(args.max_operand, args.seed)
    try:
        task = ChatTask(args.tasks, args.eval_tasks, tok, work / "reward_failures.jsonl")
    except InputError as exc:  # a bad dataset row or path: the one-line error names it
        raise SystemExit(f"--tasks: {exc}") from None
    task.check_size(args.prompts * args.steps)
    return task


def check_prompts(gyre: list[list[int]], trl: list[list[int]]) -> None:
    """Both sides must generate from the very same prompt ids."""
    if gyre != trl:
        bad = next(i for i, (a, b) in enumerate(zip(gyre, trl, strict=True)) if a != b)
        raise SystemExit(
            f"prompt {bad} of step 0 differs: gyre {gyre[bad]} vs TRL {trl[bad]} token ids"
        )


def eval_figures(task_eval: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """``<prefix>eval_reward`` (sampled) and, where measured, ``<prefix>eval_reward_greedy``."""
    out = {f"{prefix}eval_reward": round(float(np.mean(task_eval["sampled"])), 4)}
    if "greedy" in task_eval:
        out[f"{prefix}eval_reward_greedy"] = round(float(np.mean(task_eval["greedy"])), 4)
    return out


def build_report(
    args: argparse.Namespace, g_runs: list[dict], t_runs: list[dict], start: dict, params: int
) -> dict[str, Any]:
    """Every figure of the run (the JSON line); the fastest run of each side counts."""
    g = min(g_runs, key=lambda r: r["seconds"])
    t = min(t_runs, key=lambda r: r["seconds"])
    samples = args.prompts * args.group_size * args.steps
    report: dict[str, Any] = {
        "bench": "vs_trl",
        "model": str(args.model) if args.model else "tiny",
        "threads": args.threads,
        "prompts": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "steps": args.steps,
        "lr": args.lr,
        "temperature": args.temperature,
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
        **eval_figures(start, "start_"),
        "gyre_train_reward_mean": round(float(np.mean(g["rewards"])), 4),
        "trl_train_reward_mean": round(float(np.mean(t["rewards"])), 4) if t["rewards"] else None,
        **eval_figures(g["eval"], "gyre_"),
        **eval_figures(t["eval"], "trl_"),
        "eval_tasks": args.eval_tasks,
        "eval_reward_gyre_minus_trl": reward_verdict(g["eval"]["sampled"], t["eval"]["sampled"]),
        "model_params": params,
        "trl_gradient_checkpointing": not args.trl_no_grad_ckpt,
        "gyre_perf": args.perf_config.model_dump(),
        "gyre_weight_sync": args.gyre_weight_sync,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "quick": args.quick,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "trl": t["trl"],
    }
    if "greedy" in g["eval"]:
        verdict = reward_verdict(g["eval"]["greedy"], t["eval"]["greedy"])
        report["eval_reward_greedy_gyre_minus_trl"] = verdict
    if args.model is None:
        report.update(max_operand=args.max_operand, sft_steps=args.sft_steps)
    else:
        report.update(tasks=str(args.tasks), train_rows=args.prompts * args.steps, sft_steps=0)
        report["prompt_ids_checked"] = len(g["prompt_ids"])
    return report


def print_report(report: dict[str, Any]) -> None:
    r = report
    what = "tiny model" if r["model"] == "tiny" else r["model"]
    print(
        f"GRPO end to end, {r['prompts']}x{r['group_size']} per step, {r['steps']} steps, "
        f"{r['threads']} thread(s), {what} ({r['model_params']:,} params)"
    )
    print(f"{'side':<6}{'s/step':>9}{'samples/s':>11}{'train reward':>14}{'eval reward':>13}")
    for side in ("gyre", "trl"):
        tr = r[f"{side}_train_reward_mean"]
        tr = float("nan") if tr is None else tr
        sps, rate = r[f"{side}_s_per_step"], r[f"{side}_samples_per_s"]
        print(f"{side:<6}{sps:>9.3f}{rate:>11.1f}{tr:>14.3f}{r[f'{side}_eval_reward']:>13.3f}")
    start = r["start_eval_reward"]
    print(f"ratio gyre/TRL samples/s: {r['ratio']:.2f}x  (start eval reward {start:.3f})")
    for mode, key in (("sampled", "eval_reward_gyre_minus_trl"),
                      ("greedy", "eval_reward_greedy_gyre_minus_trl")):  # fmt: skip
        if key in r:
            v = r[key]
            start = r[f"start_{key.split('_gyre')[0]}"]
            print(
                f"held-out {mode} reward gyre - TRL over {r['eval_tasks']} paired tasks: "
                f"{v['diff']:+.4f} (s.e. {v['se']:.4f}): {v['verdict']}  (start {start:.3f})"
            )
    print(json.dumps(report))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _require_trl()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gyre-vs-trl-") as tmp:
        work = Path(tmp)
        path = model_folder(args, work)
        model, tok = load_pretrained(path, torch.device("cpu"))
        task = make_task(args, tok, work)
        try:
            start = evaluate(task, model, tok, args)
            g_runs, t_runs = [], []
            for _ in range(args.repeats):  # alternated, so background load hits both sides alike
                g_runs.append(run_gyre(path, task, args))
                t_runs.append(run_trl(path, task, args, work))
                check_prompts(g_runs[-1]["prompt_ids"], t_runs[-1]["prompt_ids"])
        finally:
            task.close()
    report = build_report(args, g_runs, t_runs, start, count_parameters(model))
    print_report(report)
    return report


if __name__ == "__main__":
    main()
