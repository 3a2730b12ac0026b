"""The training loop, read top to bottom in one sitting.

``train(cfg)`` = build or load the policy -> (optional) SFT warm start -> evaluate -> GRPO steps
-> evaluate -> write ``final/``. One GRPO step is seven numbered phases, each one call:

    1. rollout     env x engine episodes for ``tasks_per_step`` tasks x ``group_size`` samples
    2. reward      the env's sparse reward, summed per episode, plus any configured reward
                   functions (gyre.rewards: weighted, sandboxed if asked)
    3. advantages  the named estimator (GRPO by default; docs/algorithms.md)
    4. update      the named policy loss (PPO-clip by default), optional KL to a frozen reference
    5. sync        copy the new weights into the engine (in process), version-stamped
    6. log         metrics to every sink (console, JSONL, telemetry.*), samples, periodic eval
    7. checkpoint  every ``checkpoint.every`` steps
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.checkpoint import find_resume, list_checkpoints, load_checkpoint_state, save_checkpoint
from gyre.config import Config, dump_config, resolve_run_dir
from gyre.critic import ValueModel
from gyre.dapo import apply_overlong, sample_groups
from gyre.engines import TorchEngine
from gyre.envs import env_factory
from gyre.envs.base import Env
from gyre.evaluate import evaluate, train_seed
from gyre.model import create_tiny_checkpoint, load_pretrained, resolve_device
from gyre.policy import collate
from gyre.rewards import build_rewarder
from gyre.rollout import RolloutStats, demonstrate, run_episodes, stop_ids
from gyre.telemetry import ConsoleSink, JsonlSink, MetricsSink, MultiSink, timed
from gyre.telemetry.factory import build_telemetry
from gyre.trainer import sft_step
from gyre.types import SamplingParams, Trajectory
from gyre.update import batch_advantages, policy_update, prepare_batch, settings_from_config

STREAM_SFT, STREAM_GRPO = 1, 2


def setup(cfg: Config, fresh_check: bool = False) -> tuple[Path, torch.device]:
    """Resolve the run dir, threads, device and global seeds; write the resolved config.

    With ``fresh_check``, refuse (before writing anything) a run that would start from scratch
    in a directory that already holds checkpoints.
    """
    run_dir = resolve_run_dir(cfg)
    if fresh_check and cfg.run.resume == "never" and list_checkpoints(run_dir):
        raise FileExistsError(
            f"run.dir '{run_dir}' already holds checkpoints; pass run.resume=auto to continue it "
            "or choose a new run.dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.run.threads or os.cpu_count() or 1)
    random.seed(cfg.run.seed)
    np.random.seed(cfg.run.seed % 2**32)
    torch.manual_seed(cfg.run.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir, resolve_device(cfg.run.device)


def _sampling(cfg: Config, tokenizer: Any, seed: int | None) -> SamplingParams:
    s = cfg.train.sampling
    return SamplingParams(s.temperature, s.top_p, s.max_new_tokens, stop_ids(tokenizer), seed)


def run_eval(cfg: Config, engine: TorchEngine, tokenizer: Any) -> dict[str, float]:
    """Held-out evaluation of the engine's current weights with the run's settings."""
    if cfg.eval.episodes == 0:
        return {}
    return evaluate(
        engine,
        env_factory(cfg.env),
        tokenizer,
        cfg.eval.episodes,
        cfg.train.sampling.temperature,
        cfg.train.sampling.max_new_tokens,
        sampled=cfg.eval.sampled,
        seed=cfg.run.seed,
        top_p=cfg.train.sampling.top_p,
    )


def _console(cfg: Config, total: int, title: str) -> ConsoleSink | None:
    return None if cfg.log.console == "off" else ConsoleSink(total, cfg.log.console, title)


def base_model_path(cfg: Config, run_dir: Path) -> Path:
    """``model.path`` if given, else the tiny default built (once) under ``<run.dir>/init``."""
    if cfg.model.path:
        return Path(cfg.model.path)
    init = run_dir / "init"
    if not (init / "config.json").is_file():
        create_tiny_checkpoint(cfg.model, init, cfg.run.seed)
    return init


def run_sft(cfg: Config, run_dir: Path, device: torch.device, base: Path) -> Path:
    """Supervised warm start on noisy-expert demonstrations; writes ``<run.dir>/sft/``."""
    out_dir = run_dir / "sft"
    model, tokenizer = load_pretrained(base, device)
    make_env = env_factory(cfg.env)
    rng = np.random.default_rng([cfg.run.seed, STREAM_SFT])
    demos = [
        demonstrate(
            make_env, tokenizer, train_seed(cfg.run.seed, STREAM_SFT, k), cfg.sft.noise, rng
        )
        for k in range(cfg.sft.demos)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.sft.warmup_steps))
    )
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "sft_metrics.jsonl")]
    console = _console(cfg, cfg.sft.steps, "SFT")
    if console:
        sinks.append(console)
    sink = MultiSink(*sinks)
    order = np.random.default_rng([cfg.run.seed, STREAM_SFT, 1])
    perm = order.permutation(len(demos))
    cursor = 0
    for step in range(1, cfg.sft.steps + 1):
        idx = []
        for _ in range(cfg.sft.batch_size):
            if cursor == len(perm):
                perm, cursor = order.permutation(len(demos)), 0
            idx.append(int(perm[cursor]))
            cursor += 1
        batch = collate([demos[i] for i in idx], tokenizer.pad_token_id, device)
        metrics = sft_step(model, opt, batch, cfg.train.micro_batch_size, cfg.train.max_grad_norm)
        sched.step()
        sink.log(step, metrics)
    sink.close()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# -- phases shared by every runner (the Ray runner calls these from its actors and driver) ------
def rollout_seed(cfg: Config, step: int, round_: int = 0) -> int:
    """The sampler seed of GRPO step ``step`` (1-based), rollout round ``round_``."""
    return (cfg.run.seed * 1_000_003 + step + round_ * 7_919) % 2**31


def update_phase(
    cfg: Config,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trajs: list[Trajectory],
    pad_token_id: int,
    ref_model: torch.nn.Module | None,
    value_model: ValueModel | None = None,
    metrics: dict[str, float] | None = None,
    comm: Any = None,
) -> dict[str, float]:
    """Phases 3-4: collate, (DAPO overlong shaping,) advantages and the policy update.

    Under data parallelism ``trajs`` is this rank's shard of whole groups and ``comm`` (see
    ``gyre.distributed``) makes the loss weights global and sums the gradients over ranks.
    """
    m = {} if metrics is None else metrics
    device = next(model.parameters()).device
    algo, settings = cfg.train.algo, settings_from_config(cfg.train)
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    batch = collate(trajs, pad_token_id, device)
    shaped = apply_overlong(rewards, trajs, batch, cfg.train.dapo, cfg.train.sampling, m)
    m.update(prepare_batch(model, batch, settings, ref_model, value_model))
    adv, adv_m = batch_advantages(
        algo.advantage, shaped, groups, batch, settings,
        eps=cfg.train.adv_eps, gamma=algo.gamma, lam=algo.lam,
    )  # fmt: skip
    m.update(adv_m)
    gen = torch.Generator()
    gen.manual_seed(cfg.run.seed * 100_003 + step)
    reduce_counts = comm.reduce_counts if comm is not None else None
    sync_grads = comm.sync_gradients if comm is not None else None
    upd = policy_update(
        model, optimizer, batch, adv, settings, ref_model, gen, value_model,
        reduce_counts=reduce_counts, sync_grads=sync_grads,
    )  # fmt: skip
    m.update(upd)
    return m


def rollout_metrics(trajs: list[Trajectory], group_size: int) -> dict[str, float]:
    """Phase 6's rollout statistics of one training batch (groups of ``group_size``)."""
    rewards = torch.tensor([t.reward for t in trajs])
    grouped = rewards.view(-1, group_size)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/success_rate": float(np.mean([t.success for t in trajs])),
        "rollout/turns_mean": float(np.mean([t.num_turns for t in trajs])),
        "rollout/response_tokens_mean": float(np.mean([t.num_generated for t in trajs])),
        "rollout/frac_reward_zero_std": float((grouped.std(dim=1) == 0).float().mean()),
    }


def _task_rollout(
    cfg: Config,
    state: dict[str, Any],
    make_env: Callable[[], Env],
    engine: TorchEngine,
    tokenizer: Any,
    step: int,
    stats: RolloutStats,
) -> Callable[[int, int], list[Trajectory]]:
    """``generate(n_tasks, round)``: play ``group_size`` episodes of the next ``n_tasks`` training
    tasks (advancing the data cursor). Round 0 uses the step's sampling seed as before."""

    def generate(n_tasks: int, round_: int) -> list[Trajectory]:
        seeds = [train_seed(cfg.run.seed, STREAM_GRPO, state["cursor"] + k) for k in range(n_tasks)]
        state["cursor"] += n_tasks
        params = _sampling(cfg, tokenizer, seed=rollout_seed(cfg, step, round_))
        return run_episodes(make_env, engine, tokenizer, seeds, cfg.train.group_size, params, stats)

    return generate


def _scored_rounds(
    generate: Callable[[int, int], list[Trajectory]],
    rewarder: Any,
    tokenizer: Any,
    step: int,
    metrics: dict[str, float],
) -> Callable[[int, int], list[Trajectory]]:
    """Wrap a rollout round so its trajectories get their final (reward-function) reward."""

    def play(n: int, rnd: int) -> list[Trajectory]:
        out = generate(n, rnd)
        with timed(metrics, "time/reward_s"):
            metrics.update(rewarder.score(out, tokenizer, step))
        return out

    return play


def train(cfg: Config, sink: MetricsSink | None = None) -> dict[str, Any]:
    """SFT (if ``sft.steps``) then GRPO for ``train.steps``; returns the run summary."""
    if cfg.runner != "local":  # distribution is the runner's concern; this module stays Ray-free
        from gyre.runners import get_runner

        return get_runner(cfg.runner)(cfg, sink)
    t_start = time.perf_counter()
    run_dir, device = setup(cfg, fresh_check=True)
    # Built before any training so a bad reward config or a sandbox that cannot isolate fails now.
    rewarder = build_rewarder(cfg.reward, run_dir / "reward_failures.jsonl")
    resume_from = find_resume(run_dir, cfg.run.resume)
    state: dict[str, Any] = {"cursor": 0, "evals": {}}
    if resume_from is not None:
        policy_path = resume_from / "model"
    else:
        policy_path = base_model_path(cfg, run_dir)
        if cfg.sft.steps > 0:
            policy_path = run_sft(cfg, run_dir, device, policy_path)

    model, tokenizer = load_pretrained(policy_path, device)
    engine = TorchEngine(copy.deepcopy(model), tokenizer.pad_token_id, seed=cfg.run.seed)
    ref_model = copy.deepcopy(model).eval() if cfg.train.kl_coef > 0 else None
    if ref_model is not None and resume_from is not None:
        # The reference is the policy GRPO started from, not the checkpoint's.
        start = run_dir / "sft" if (run_dir / "sft").is_dir() else base_model_path(cfg, run_dir)
        ref_model, _ = load_pretrained(start, device)
        ref_model.eval()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    start_step = 0
    if resume_from is not None:
        state = load_checkpoint_state(resume_from, optimizer)
        start_step = int(state["step"])
        engine.version = int(state.get("policy_version", start_step))

    out = build_telemetry(cfg, run_dir, tokenizer, extra=sink)  # telemetry.*: jsonl, tb, ...

    if "before" not in state["evals"]:
        state["evals"]["before"] = run_eval(cfg, engine, tokenizer)
        out.log(start_step, dict(state["evals"]["before"]))
    make_env = env_factory(cfg.env)
    algo, dapo = cfg.train.algo, cfg.train.dapo
    value_model = None
    if algo.advantage == "gae":
        value_model = ValueModel(model, algo.value_model, algo.critic_lr)
        if resume_from is not None:
            value_model.load(resume_from)
    for step in range(start_step + 1, cfg.train.steps + 1):
        m: dict[str, float] = {}
        # 1. rollout (with DAPO dynamic sampling: more rounds until the groups have variance)
        stats = RolloutStats()
        with timed(m, "time/rollout_s"):
            generate = _task_rollout(cfg, state, make_env, engine, tokenizer, step, stats)
            # Dynamic sampling filters on the final reward, so each round is scored as it
            # comes back (phase 2 then has nothing left to do).
            score_rounds = rewarder is not None and dapo.dynamic_sampling
            reward_m: dict[str, float] = {}
            if score_rounds:
                generate = _scored_rounds(generate, rewarder, tokenizer, step, reward_m)
            trajs, dapo_m = sample_groups(
                generate, cfg.train.tasks_per_step, dynamic=dapo.dynamic_sampling,
                max_rounds=dapo.max_rounds,
            )  # fmt: skip
        m.update(dapo_m)
        # 2. reward
        if rewarder is not None and not score_rounds:  # t.reward becomes the weighted total
            with timed(m, "time/reward_s"):
                m.update(rewarder.score(trajs, tokenizer, step))
        m.update(reward_m)
        with timed(m, "time/train_s"):
            # 3. advantages (after DAPO's overlong shaping / truncation masking, if enabled)
            # 4. update
            update_phase(
                cfg, step, model, optimizer, trajs, tokenizer.pad_token_id, ref_model,
                value_model, metrics=m,
            )  # fmt: skip
        # 5. weight sync
        with timed(m, "time/sync_s"):
            engine.load_weights(model.state_dict(), version=step)
        # 6. log
        m.update(rollout_metrics(trajs, cfg.train.group_size))
        m["perf/rollout_tokens_per_s"] = stats.tokens_per_s
        m["policy_version"] = float(engine.version)
        out.trajectories(step, trajs)  # samples.jsonl, per-episode histograms
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
            with timed(m, "time/eval_s"):
                m.update(run_eval(cfg, engine, tokenizer))
        out.log(step, m)
        # 7. checkpoint
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            ckpt = save_checkpoint(
                run_dir,
                step,
                model,
                tokenizer,
                optimizer,
                {**state, "policy_version": engine.version},
                cfg.checkpoint.keep,
            )
            if value_model is not None:
                value_model.save(ckpt)

    after = run_eval(cfg, engine, tokenizer)
    state["evals"]["after"] = after
    out.log(cfg.train.steps, dict(after))
    if cfg.train.steps > start_step and (
        not cfg.checkpoint.every or cfg.train.steps % cfg.checkpoint.every
    ):
        ckpt = save_checkpoint(
            run_dir,
            cfg.train.steps,
            model,
            tokenizer,
            optimizer,
            {**state, "policy_version": engine.version},
            cfg.checkpoint.keep,
        )
        if value_model is not None:
            value_model.save(ckpt)
    final = run_dir / "final"
    if final.exists():
        shutil.rmtree(final)
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    out.close()
    if rewarder is not None:
        rewarder.close()
    summary = {
        "run_dir": str(run_dir),
        "steps": cfg.train.steps,
        "sft_steps": cfg.sft.steps,
        "before": state["evals"]["before"],
        "after": after,
        "wall_s": time.perf_counter() - t_start,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
