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
    7. checkpoint  every ``checkpoint.every`` steps (resumable from any kill: docs/operations.md)
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

from gyre.checkpoint.resume import (
    Checkpointer,
    FaultAbort,
    ResumePlan,
    StopGuard,
    TaskCursor,
    cached,
    preempt_if_requested,
    rewind_metrics,
)
from gyre.checkpoint.store import load_into, write_file_atomically, write_model_dir
from gyre.config import Config, dump_config, resolve_run_dir
from gyre.engines import TorchEngine, build_engine, initial_sync
from gyre.envs import env_factory
from gyre.envs.base import Env
from gyre.models.build import create_tiny_checkpoint, load_pretrained, resolve_device
from gyre.models.lora import AdapterDisabled, load_policy, trainable_parameters
from gyre.rewards import build_rewarder
from gyre.rollout.dapo import apply_overlong, sample_groups
from gyre.rollout.episodes import RolloutStats, demonstrate, run_episodes, stop_ids
from gyre.rollout.evaluate import evaluate, train_seed
from gyre.telemetry import ConsoleSink, JsonlSink, MetricsSink, MultiSink, timed
from gyre.telemetry.factory import build_telemetry
from gyre.trainer import scoring
from gyre.trainer.batch import collate
from gyre.trainer.critic import ValueModel
from gyre.trainer.sft import sft_step
from gyre.trainer.update import batch_advantages, policy_update, prepare_batch
from gyre.types import SamplingParams, Trajectory

STREAM_SFT, STREAM_GRPO = 1, 2


def setup(cfg: Config, fresh_check: bool = False) -> tuple[Path, torch.device]:
    """Resolve the run dir, threads, device and global seeds; write the resolved config.

    With ``fresh_check``, refuse (before writing anything) a run that would start from scratch
    in a directory that already holds one (unless ``run.overwrite``).
    """
    if cfg.run.dir.startswith("file://"):
        cfg.run.dir = cfg.run.dir[len("file://") :]
    elif "://" in cfg.run.dir:
        raise ValueError(
            f"run.dir={cfg.run.dir!r}: the run directory must be a local or shared-filesystem "
            "path; put checkpoints on object storage with checkpoint.dir=<fsspec URL>"
        )
    run_dir = resolve_run_dir(cfg)
    if fresh_check:
        Checkpointer(cfg, run_dir).check_fresh()
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.run.threads or os.cpu_count() or 1)
    scoring.configure(cfg.train.lean_forward, cfg.train.share_prefix)
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
        stage = run_dir / ".tmp_init"
        shutil.rmtree(stage, ignore_errors=True)
        create_tiny_checkpoint(cfg.model, stage, cfg.run.seed)
        stage.rename(init)  # never a half-written init/ after a kill
    return init


def run_sft(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    base: Path,
    ckpt: Checkpointer | None = None,
    resume: ResumePlan | None = None,
    guard: StopGuard | None = None,
) -> Path:
    """Supervised warm start on noisy-expert demonstrations; writes ``<run.dir>/sft/``.

    Resumable: every ``checkpoint.sft_every`` steps (and on a stop signal) the model,
    optimizer, LR scheduler, data cursor and RNGs go to an ``sft_NNNNNN`` checkpoint.
    """
    out_dir = run_dir / "sft"
    metrics_path = run_dir / "sft_metrics.jsonl"
    ckpt = ckpt or Checkpointer(cfg, run_dir)
    resuming = resume is not None and resume.phase == "sft" and resume.ckpt is not None
    model, tokenizer = load_pretrained(resume.ckpt / "model" if resuming else base, device)
    make_env = env_factory(cfg.env)
    rng = np.random.default_rng([cfg.run.seed, STREAM_SFT])
    demo_key = {
        "seed": cfg.run.seed,
        "env": cfg.env.model_dump(),
        "n": cfg.sft.demos,
        "noise": cfg.sft.noise,
        "vocab": tokenizer.get_vocab(),
    }
    demos = cached(
        run_dir / "sft_demos.pt",
        demo_key,
        lambda: [
            demonstrate(
                make_env, tokenizer, train_seed(cfg.run.seed, STREAM_SFT, k), cfg.sft.noise, rng
            )
            for k in range(cfg.sft.demos)
        ],
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, cfg.sft.warmup_steps))
    )
    cursor = TaskCursor(len(demos), np.random.default_rng([cfg.run.seed, STREAM_SFT, 1]))
    start, streak = 0, 0
    if resuming:
        assert resume is not None and resume.ckpt is not None
        state = load_into(resume.ckpt, opt, sched)
        cursor.load_state_dict(state["data"])
        start, streak = int(state["step"]), int(state.get("nonfinite_streak", 0))
        rewind_metrics(metrics_path, int(state["metrics_offset"]))
    else:
        rewind_metrics(metrics_path, 0)
    sinks: list[MetricsSink] = [JsonlSink(metrics_path)]
    console = _console(cfg, cfg.sft.steps, "SFT")
    if console:
        sinks.append(console)
    sink = MultiSink(*sinks)

    def save(step: int) -> str | None:
        state = {"data": cursor.state_dict(), "nonfinite_streak": streak}
        return ckpt.save("sft", step, model, tokenizer, opt, state, metrics_path, sched)

    try:
        for step in range(start + 1, cfg.sft.steps + 1):
            idx = cursor.take(cfg.sft.batch_size)
            batch = collate([demos[i] for i in idx], tokenizer.pad_token_id, device)
            lr = opt.param_groups[0]["lr"]
            metrics = sft_step(
                model, opt, batch, cfg.train.micro_batch_size, cfg.train.max_grad_norm
            )
            sched.step()
            streak = streak + 1 if metrics["sft/nonfinite_skipped"] else 0
            sink.log(step, {**metrics, "sft/lr": lr})
            _check_nonfinite(cfg, streak, "SFT", step)
            saved = None
            every = cfg.checkpoint.sft_every
            if every and step % every == 0 and step < cfg.sft.steps:
                saved = save(step)
            preempt_if_requested(guard, "sft", step, saved, lambda s=step: save(s))
    finally:
        sink.close()
    write_model_dir(out_dir, model, tokenizer)
    ckpt.drop_sft()
    return out_dir


def _check_nonfinite(cfg: Config, streak: int, phase: str, step: int) -> None:
    if streak >= cfg.faults.max_nonfinite_streak:
        raise FaultAbort(
            f"{phase} step {step}: {streak} steps in a row had a NaN/inf loss or gradient "
            f"(faults.max_nonfinite_streak={cfg.faults.max_nonfinite_streak}); aborting"
        )


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
    ``gyre.trainer.distributed``) makes the loss weights global and sums the gradients over ranks.
    """
    m = {} if metrics is None else metrics
    device = next(model.parameters()).device
    algo = cfg.train.algo
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    batch = collate(trajs, pad_token_id, device)
    shaped = apply_overlong(rewards, trajs, batch, cfg.train.dapo, cfg.train.sampling, m)
    m.update(prepare_batch(model, batch, cfg.train, ref_model, value_model))
    adv, adv_m = batch_advantages(
        algo.advantage, shaped, groups, batch, cfg.train,
        eps=cfg.train.adv_eps, gamma=algo.gamma, lam=algo.lam,
    )  # fmt: skip
    m.update(adv_m)
    gen = torch.Generator()
    gen.manual_seed(cfg.run.seed * 100_003 + step)
    reduce_counts = comm.reduce_counts if comm is not None else None
    sync_grads = comm.sync_gradients if comm is not None else None
    upd = policy_update(
        model, optimizer, batch, adv, cfg.train, ref_model, gen, value_model,
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
    cursor: TaskCursor,
    make_env: Callable[[], Env],
    engine: TorchEngine,
    tokenizer: Any,
    step: int,
    stats: RolloutStats,
) -> Callable[[int, int], list[Trajectory]]:
    """``generate(n_tasks, round)``: play ``group_size`` episodes of the next ``n_tasks`` training
    tasks (advancing the data cursor). Round 0 uses the step's sampling seed as before."""

    def generate(n_tasks: int, round_: int) -> list[Trajectory]:
        seeds = [train_seed(cfg.run.seed, STREAM_GRPO, k) for k in cursor.take(n_tasks)]
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
    """SFT (if ``sft.steps``) then GRPO for ``train.steps``; returns the run summary.

    Resumable from any kill (see docs/operations.md); SIGTERM/SIGINT stop at the end of the
    current step with a checkpoint and raise :class:`gyre.checkpoint.resume.Preempted`.
    """
    if cfg.runner != "local":  # distribution is the runner's concern; this module stays Ray-free
        from gyre.runners import get_runner

        return get_runner(cfg.runner)(cfg, sink)
    t_start = time.perf_counter()
    run_dir, device = setup(cfg, fresh_check=True)
    ckpt = Checkpointer(cfg, run_dir)
    with StopGuard() as guard:
        try:
            return _train(cfg, sink, run_dir, device, ckpt, guard, t_start)
        finally:
            ckpt.close()


def _train(
    cfg: Config,
    sink: MetricsSink | None,
    run_dir: Path,
    device: torch.device,
    ckpt: Checkpointer,
    guard: StopGuard,
    t_start: float,
) -> dict[str, Any]:
    # Built before any training so a bad reward config or a sandbox that cannot isolate fails now.
    rewarder = build_rewarder(cfg.reward, run_dir / "reward_failures.jsonl")
    plan = ckpt.plan()
    metrics_path = run_dir / "metrics.jsonl"
    state: dict[str, Any] = {"cursor": 0, "evals": {}}
    resumed = plan.phase == "grpo"
    if resumed:
        assert plan.ckpt is not None
        policy_path = plan.ckpt / "model"
    else:
        policy_path = base_model_path(cfg, run_dir)
        if cfg.sft.steps > 0:
            if plan.phase != "grpo_start":
                policy_path = run_sft(cfg, run_dir, device, policy_path, ckpt, plan, guard)
            else:
                policy_path = run_dir / "sft"
                ckpt.drop_sft()  # leftovers of a kill between sft/ and their deletion
        # GRPO starts from a known RNG state whether or not SFT ran in this process.
        random.seed(cfg.run.seed)
        np.random.seed(cfg.run.seed % 2**32)
        torch.manual_seed(cfg.run.seed)

    model, tokenizer = load_policy(cfg, run_dir, policy_path, device)
    engine, syncer = build_engine(cfg, model, tokenizer, run_dir)
    lora = cfg.model.lora is not None
    if lora:  # the reference is the same model with its adapter off: no second copy
        ref_model = AdapterDisabled(model) if cfg.train.kl_coef > 0 else None
    else:
        ref_model = copy.deepcopy(model).eval() if cfg.train.kl_coef > 0 else None
    if ref_model is not None and resumed and not lora:
        # The reference is the policy GRPO started from, not the checkpoint's.
        start = run_dir / "sft" if (run_dir / "sft").is_dir() else base_model_path(cfg, run_dir)
        ref_model, _ = load_pretrained(start, device)
        ref_model.eval()
    optimizer = torch.optim.AdamW(
        trainable_parameters(model), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay
    )
    algo, dapo = cfg.train.algo, cfg.train.dapo
    value_model = None
    if algo.advantage == "gae":
        value_model = ValueModel(model, algo.value_model, algo.critic_lr)
    # The update's generator is reseeded every step (update_phase); only the engine's sampling
    # RNG carries state from step to step.
    generators: dict[str, Any] = {}
    if getattr(engine, "_generator", None) is not None:  # in-process engine's sampling RNG
        generators["engine"] = engine._generator
    cursor = TaskCursor(None)  # GRPO tasks: an endless procedural stream (task i = seed i)
    faults = {"nonfinite_streak": 0, "nonfinite_steps": 0, "failed_episodes": 0, "episodes": 0}
    start_step = 0
    if resumed:
        assert plan.ckpt is not None
        state = load_into(plan.ckpt, optimizer, None, generators)
        start_step = int(state["step"])
        engine.version = int(state.get("policy_version", start_step))
        cursor.load_state_dict(state["data"])
        faults.update(state.get("faults", {}))
        rewind_metrics(metrics_path, int(state["metrics_offset"]))
        if value_model is not None:
            value_model.load(plan.ckpt)
    else:
        rewind_metrics(metrics_path, 0)
    sft_base = run_dir / "sft" if lora and (run_dir / "sft").is_dir() else None
    initial_sync(syncer, model, engine.version, sft_base)

    out = build_telemetry(cfg, run_dir, tokenizer, extra=sink)  # telemetry.*: jsonl, tb, ...

    def save(step: int) -> str | None:
        full = {**state, "policy_version": engine.version, "data": cursor.state_dict(),
                "faults": faults}  # fmt: skip
        return ckpt.save(
            "grpo", step, model, tokenizer, optimizer, full, metrics_path, None, generators,
            extra=value_model.save if value_model is not None else None,
        )  # fmt: skip

    try:
        if "before" not in state["evals"]:
            state["evals"]["before"] = run_eval(cfg, engine, tokenizer)
            out.log(start_step, dict(state["evals"]["before"]))
        make_env = env_factory(cfg.env)
        for step in range(start_step + 1, cfg.train.steps + 1):
            m: dict[str, float] = {}
            # 1. rollout (with DAPO dynamic sampling: more rounds until the groups have variance)
            stats = RolloutStats()
            with timed(m, "time/rollout_s"):
                generate = _task_rollout(cfg, cursor, make_env, engine, tokenizer, step, stats)
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
            state["cursor"] = cursor.consumed
            m.update(dapo_m)
            # 2. reward
            if rewarder is not None and not score_rounds:  # t.reward becomes the weighted total
                with timed(m, "time/reward_s"):
                    m.update(rewarder.score(trajs, tokenizer, step))
            m.update(reward_m)
            with timed(m, "time/train_s"):
                # 3. advantages (after DAPO's overlong shaping / truncation masking) + 4. update
                update_phase(
                    cfg, step, model, optimizer, trajs, tokenizer.pad_token_id, ref_model,
                    value_model, metrics=m,
                )  # fmt: skip
            # 5. weight sync
            if syncer.due(step, cfg.train.steps):
                with timed(m, "time/sync_s"):
                    m.update(syncer.sync(model, version=step))
            # 6. log
            _count_faults(faults, m, stats, len(trajs))
            m.update(rollout_metrics(trajs, cfg.train.group_size))
            m["perf/rollout_tokens_per_s"] = stats.tokens_per_s
            m["policy_version"] = float(engine.version)
            out.trajectories(step, trajs)  # samples.jsonl, per-episode histograms
            if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
                with timed(m, "time/eval_s"):
                    m.update(run_eval(cfg, engine, tokenizer))
            out.log(step, m)
            _check_nonfinite(cfg, faults["nonfinite_streak"], "GRPO", step)
            _check_failures(cfg, faults, step)
            # 7. checkpoint
            saved = None
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                saved = save(step)
            preempt_if_requested(guard, "grpo", step, saved, lambda s=step: save(s))

        done = start_step >= cfg.train.steps and state["evals"].get("after_step") == cfg.train.steps
        if not done:
            after = run_eval(cfg, engine, tokenizer)
            state["evals"]["after"] = after
            state["evals"]["after_step"] = cfg.train.steps
            out.log(cfg.train.steps, dict(after))
            # The end state (after-eval included) is a checkpoint too: a relaunch of a finished
            # run neither repeats the evaluation nor logs it twice.
            save(cfg.train.steps)
        after = state["evals"]["after"]
        write_model_dir(run_dir / "final", model, tokenizer)
    finally:
        out.close()
        if rewarder is not None:
            rewarder.close()
        if hasattr(engine, "close"):
            engine.close()
    summary = {
        "run_dir": str(run_dir),
        "steps": cfg.train.steps,
        "sft_steps": cfg.sft.steps,
        "before": state["evals"]["before"],
        "after": after,
        "faults": faults,
        "checkpoints": ckpt.summary(),
        "wall_s": time.perf_counter() - t_start,
    }
    write_file_atomically(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _count_faults(
    faults: dict[str, int], m: dict[str, float], stats: RolloutStats, episodes: int
) -> None:
    skipped = m.get("train/nonfinite_skipped", 0.0) > 0
    faults["nonfinite_streak"] = faults["nonfinite_streak"] + 1 if skipped else 0
    faults["nonfinite_steps"] += int(skipped)
    faults["failed_episodes"] += stats.failed_episodes
    faults["episodes"] += episodes
    m["faults/nonfinite_steps"] = float(faults["nonfinite_steps"])
    m["rollout/failed_episodes"] = float(stats.failed_episodes)


def _check_failures(cfg: Config, faults: dict[str, int], step: int) -> None:
    frac = faults["failed_episodes"] / max(faults["episodes"], 1)
    if frac > cfg.faults.max_failed_fraction:
        raise FaultAbort(
            f"GRPO step {step}: {faults['failed_episodes']} of {faults['episodes']} episodes "
            f"failed in the env ({frac:.1%} > faults.max_failed_fraction="
            f"{cfg.faults.max_failed_fraction}); see the logged tracebacks"
        )
