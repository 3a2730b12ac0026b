"""The training loop, read top to bottom in one sitting.

``train(cfg)`` = build or load the policy -> (optional) SFT warm start -> evaluate -> GRPO steps
-> evaluate -> write ``final/``. One GRPO step is seven numbered phases, each one call:

    1. rollout     env x engine episodes for ``tasks_per_step`` tasks x ``group_size`` samples
    2. reward      the env's sparse reward, summed per episode
    3. advantages  group-relative (GRPO)
    4. update      PPO-clip on the policy's tokens, optional k3 KL to a frozen reference
    5. sync        copy the new weights into the engine (in process), version-stamped
    6. log         metrics to every sink (console, JSONL), periodic held-out eval
    7. checkpoint  every ``checkpoint.every`` steps
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.algos import get_advantage_fn
from gyre.checkpoint import find_resume, list_checkpoints, load_checkpoint_state, save_checkpoint
from gyre.config import Config, dump_config, resolve_run_dir
from gyre.engines import TorchEngine
from gyre.envs import env_factory
from gyre.evaluate import evaluate, train_seed
from gyre.model import create_tiny_checkpoint, load_pretrained, resolve_device
from gyre.policy import collate
from gyre.rollout import RolloutStats, demonstrate, run_episodes, stop_ids
from gyre.telemetry import ConsoleSink, JsonlSink, MetricsSink, MultiSink, timed
from gyre.trainer import GRPOSettings, grpo_update, sft_step
from gyre.types import SamplingParams, Trajectory

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


# -- phases shared by every runner (the Ray runner calls these from its actors / driver) -------
def rollout_seed(cfg: Config, step: int) -> int:
    """The sampler seed of GRPO step ``step`` (1-based)."""
    return (cfg.run.seed * 1_000_003 + step) % 2**31


def grpo_settings(cfg: Config) -> GRPOSettings:
    return GRPOSettings(
        clip_eps=cfg.train.clip_eps,
        kl_coef=cfg.train.kl_coef,
        mini_batches=cfg.train.mini_batches,
        micro_batch_size=cfg.train.micro_batch_size,
        max_grad_norm=cfg.train.max_grad_norm,
        temperature=cfg.train.sampling.temperature,
        top_p=cfg.train.sampling.top_p,
        loss_agg=cfg.train.loss_agg,
    )


def advantages_phase(cfg: Config, trajs: list[Trajectory]) -> torch.Tensor:
    """Phases 2-3: episode rewards -> group-relative advantages, (N,)."""
    rewards = torch.tensor([t.reward for t in trajs])
    groups = torch.tensor([t.group_id for t in trajs])
    return get_advantage_fn("grpo")(rewards, groups, eps=cfg.train.adv_eps)


def update_phase(
    cfg: Config,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trajs: list[Trajectory],
    adv: torch.Tensor,
    pad_token_id: int,
    ref_model: torch.nn.Module | None,
    comm: Any = None,
) -> dict[str, float]:
    """Phase 4: collate and update. Under data parallelism ``trajs`` is this rank's shard."""
    device = next(model.parameters()).device
    batch = collate(trajs, pad_token_id, device)
    gen = torch.Generator()
    gen.manual_seed(cfg.run.seed * 100_003 + step)
    settings = grpo_settings(cfg)
    return grpo_update(model, optimizer, batch, adv.to(device), settings, ref_model, gen, comm)


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


def open_sinks(cfg: Config, run_dir: Path, sink: MetricsSink | None = None) -> MultiSink:
    """metrics.jsonl, the console (unless off) and an optional caller's sink."""
    sinks: list[MetricsSink] = [JsonlSink(run_dir / "metrics.jsonl")]
    console = _console(cfg, cfg.train.steps, "GRPO")
    if console:
        sinks.append(console)
    if sink is not None:
        sinks.append(sink)
    return MultiSink(*sinks)


def train(cfg: Config, sink: MetricsSink | None = None) -> dict[str, Any]:
    """SFT (if ``sft.steps``) then GRPO for ``train.steps``; returns the run summary."""
    if cfg.runner != "local":  # distribution is the runner's concern; this module stays Ray-free
        from gyre.runners import get_runner

        return get_runner(cfg.runner)(cfg, sink)
    t_start = time.perf_counter()
    run_dir, device = setup(cfg, fresh_check=True)
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

    out = open_sinks(cfg, run_dir, sink)

    if "before" not in state["evals"]:
        state["evals"]["before"] = run_eval(cfg, engine, tokenizer)
        out.log(start_step, dict(state["evals"]["before"]))
    make_env = env_factory(cfg.env)
    for step in range(start_step + 1, cfg.train.steps + 1):
        m: dict[str, float] = {}
        # 1. rollout
        seeds = [
            train_seed(cfg.run.seed, STREAM_GRPO, state["cursor"] + k)
            for k in range(cfg.train.tasks_per_step)
        ]
        state["cursor"] += cfg.train.tasks_per_step
        stats = RolloutStats()
        with timed(m, "time/rollout_s"):
            trajs = run_episodes(
                make_env,
                engine,
                tokenizer,
                seeds,
                cfg.train.group_size,
                _sampling(cfg, tokenizer, seed=rollout_seed(cfg, step)),
                stats,
            )
        # 2. reward, 3. advantages
        adv = advantages_phase(cfg, trajs)
        # 4. update
        with timed(m, "time/train_s"):
            m.update(
                update_phase(
                    cfg, step, model, optimizer, trajs, adv, tokenizer.pad_token_id, ref_model
                )
            )
        # 5. weight sync
        with timed(m, "time/sync_s"):
            engine.load_weights(model.state_dict(), version=step)
        # 6. log
        m.update(rollout_metrics(trajs, cfg.train.group_size))
        m["perf/rollout_tokens_per_s"] = stats.tokens_per_s
        m["policy_version"] = float(engine.version)
        if cfg.eval.every and step % cfg.eval.every == 0 and step != cfg.train.steps:
            with timed(m, "time/eval_s"):
                m.update(run_eval(cfg, engine, tokenizer))
        out.log(step, m)
        # 7. checkpoint
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
            save_checkpoint(
                run_dir,
                step,
                model,
                tokenizer,
                optimizer,
                {**state, "policy_version": engine.version},
                cfg.checkpoint.keep,
            )

    after = run_eval(cfg, engine, tokenizer)
    state["evals"]["after"] = after
    out.log(cfg.train.steps, dict(after))
    if cfg.train.steps > start_step and (
        not cfg.checkpoint.every or cfg.train.steps % cfg.checkpoint.every
    ):
        save_checkpoint(
            run_dir,
            cfg.train.steps,
            model,
            tokenizer,
            optimizer,
            {**state, "policy_version": engine.version},
            cfg.checkpoint.keep,
        )
    final = run_dir / "final"
    if final.exists():
        shutil.rmtree(final)
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    out.close()
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
