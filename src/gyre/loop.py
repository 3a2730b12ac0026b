"""The training loop, read top to bottom in one sitting.

``train(cfg, placement)`` = set up the run dir -> (optional) SFT warm start -> start the placement
(build or resume the :class:`~gyre.trainer.Trainer` and :class:`~gyre.rollout.Rollout`) ->
evaluate -> GRPO steps -> evaluate -> write ``final/``. One GRPO step is seven numbered phases:

    1. rollout     engine x env episodes: ``tasks_per_step`` tasks x ``group_size`` samples
    2. reward      the env's sparse reward plus any reward functions (weighted, sandboxed if
                   asked); with DAPO dynamic sampling, rounds are scored as they come back
    3. advantages  the named estimator (GRPO by default; docs/algorithms.md)
    4. update      the named policy loss (PPO-clip by default), KL to a frozen reference, ...
    5. sync        the new weights to the engine(s), version-stamped
    6. log         metrics to every sink, samples, fault limits, periodic eval
    7. checkpoint  every ``checkpoint.every`` steps (resumable from any kill: docs/operations.md)

*Where* each phase runs is the placement's business (``gyre.runners``): ``runners/local.py``
calls the objects in this process, ``runners/ray.py`` puts them into Ray actors (rollout workers
and a data-parallel trainer group, generation overlapping training in the async modes). This
module never imports a runner or Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from gyre.checkpoint.files import replace_dir_atomically, write_file_atomically
from gyre.checkpoint.resume import (
    Checkpointer,
    ResumePlan,
    StopGuard,
    check_failures,
    check_nonfinite,
    preempt_if_requested,
    rewind_metrics,
)
from gyre.checkpoint.snapshot import seed_everything
from gyre.config import Config, dump_config, resolve_run_dir
from gyre.engines.verify import check_rollout_gap
from gyre.envs import env_factory
from gyre.errors import ensure_writable_dir
from gyre.models.build import create_tiny_checkpoint, load_tokenizer, resolve_device
from gyre.models.hub import resolve_model_path
from gyre.rollout.core import rollout_metrics
from gyre.rollout.evaluate import demonstrator_success
from gyre.sft import run_sft
from gyre.telemetry import MetricsSink, timed
from gyre.telemetry.factory import Telemetry, build_telemetry
from gyre.telemetry.signal import NoSignalWatch
from gyre.types import Trajectory


class RolledBack(Exception):
    """The placement went back to a checkpoint (a trainer group restarted): ``state`` is that
    checkpoint's ``state.json``; the loop continues from its step."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__(f"rolled back to step {state.get('step', 0)}")
        self.state = state


class Placement(Protocol):
    """Where the phases run; ``runners/local.py`` and ``runners/ray.py`` implement it."""

    stale_ok: bool  # batches may hold samples of older policy versions (async modes)

    def connect(self) -> None: ...  # before signal handlers are installed (ray.init)
    def start(
        self,
        run_dir: Path,
        policy: Path,
        ref: Path,
        plan: ResumePlan,
        out: Telemetry,
        ckpt: Checkpointer,
    ) -> None: ...
    def rollout(self, step: int) -> tuple[list[Trajectory], dict[str, float]]: ...
    def update(self, step: int, trajs: list[Trajectory]) -> dict[str, float]: ...
    def sync(self, step: int) -> dict[str, float]: ...
    def evaluate(self) -> dict[str, float]: ...
    def state(self) -> dict[str, Any]: ...  # what a checkpoint must hold beyond the loop's
    def save(self, step: int, state: dict[str, Any]) -> str | None: ...
    def write_final(self, out_dir: Path) -> None: ...
    def summary(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


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
    ensure_writable_dir(run_dir, "run.dir")  # a file or a read-only dir: one line
    torch.set_num_threads(cfg.run.threads or os.cpu_count() or 1)
    seed_everything(cfg.run.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir, resolve_device(cfg.run.device)


def base_model_path(cfg: Config, run_dir: Path) -> Path:
    """``model.path`` if given (a hub id resolved to its local snapshot), else the tiny default
    built (once) under ``<run.dir>/init``."""
    if cfg.model.path:
        return resolve_model_path(cfg.model.path)
    init = run_dir / "init"
    if not (init / "config.json").is_file():
        stage = run_dir / ".tmp_init"
        shutil.rmtree(stage, ignore_errors=True)
        if cfg.model.kind == "text":
            create_tiny_checkpoint(cfg.model, stage, cfg.run.seed)
        else:
            from gyre.models.vision_build import LMSize, create_tiny_vlm

            lm = LMSize(**cfg.model.tiny_vlm.model_dump())
            create_tiny_vlm(cfg.model.kind, stage, cfg.run.seed, lm)
        stage.rename(init)  # never a half-written init/ after a kill
    return init


def warm_start(
    cfg: Config,
    run_dir: Path,
    device: torch.device,
    ckpt: Checkpointer,
    plan: ResumePlan,
    guard: StopGuard,
) -> tuple[Path, Path]:
    """(the policy to load, the policy GRPO starts from = the KL reference): a checkpoint's
    model when resuming GRPO; else the SFT output (running SFT first if needed) or the base."""
    base = base_model_path(cfg, run_dir)
    start = base
    if cfg.sft.steps > 0:
        if plan.phase in ("grpo_start", "grpo"):
            start = run_dir / "sft"
            ckpt.drop_sft()  # leftovers of a kill between sft/ and their deletion
        else:
            start = run_sft(cfg, run_dir, device, base, ckpt, plan, guard)
    elif (run_dir / "sft").is_dir():
        start = run_dir / "sft"
    if plan.phase == "grpo":
        assert plan.ckpt is not None
        return plan.ckpt / "model", start
    seed_everything(cfg.run.seed)  # GRPO starts from a known RNG state, SFT or not
    return start, start


def train(cfg: Config, placement: Placement, sink: MetricsSink | None = None) -> dict[str, Any]:
    """SFT (if ``sft.steps``) then GRPO for ``train.steps`` on ``placement``; the run summary.

    Resumable from any kill (see docs/operations.md); SIGTERM/SIGINT stop at the end of the
    current step with a checkpoint and raise :class:`gyre.checkpoint.resume.Preempted`.
    """
    t_start = time.perf_counter()
    out: Telemetry | None = None
    ckpt: Checkpointer | None = None
    try:
        placement.connect()  # may settle config (Ray: placement fitted to the cluster) first
        run_dir, device = setup(cfg, fresh_check=True)
        ckpt = Checkpointer(cfg, run_dir)
        with StopGuard() as guard:  # after connect: ray.init installs handlers of its own
            plan = ckpt.plan()
            policy, ref = warm_start(cfg, run_dir, device, ckpt, plan, guard)
            tok, make_env = load_tokenizer(ref), env_factory(cfg.env)
            out = build_telemetry(cfg, run_dir, tok, sink, make_env=make_env)
            for note in cfg.adapted():  # values a check filled in (config.yaml holds them)
                out.message(note)
            placement.start(run_dir, policy, ref, plan, out, ckpt)
            state = _steps(cfg, placement, out, plan, run_dir, guard)
            placement.write_final(run_dir / "final")
            selected = _select_final(cfg, state, run_dir)
    finally:
        if out is not None:
            out.close()
        placement.close()
        if ckpt is not None:
            ckpt.close()
    summary = {
        "run_dir": str(run_dir),
        "steps": cfg.train.steps,
        "sft_steps": cfg.sft.steps,
        "before": state["evals"]["before"],
        "after": selected["eval"] if selected else state["evals"]["after"],
        "last": state["evals"]["after"],
        "selected": selected,
        "demonstrator": None
        if cfg.train.source
        else demonstrator_success(env_factory(cfg.env), cfg.eval.episodes),
        "faults": state["faults"],
        "checkpoints": ckpt.summary(),
        "wall_s": time.perf_counter() - t_start,
        **placement.summary(),
    }
    write_file_atomically(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _steps(
    cfg: Config,
    placement: Placement,
    out: Telemetry,
    plan: ResumePlan,
    run_dir: Path,
    guard: StopGuard,
) -> dict[str, Any]:
    """The GRPO steps between the before- and after-evaluation; returns the loop state."""
    metrics_path = run_dir / "metrics.jsonl"
    state = _loop_state(plan.state if plan.phase == "grpo" else {})
    resumed = plan.phase == "grpo"
    rewind_metrics(metrics_path, int(plan.state["metrics_offset"]) if resumed else 0)

    def save(step: int) -> str | None:
        return placement.save(step, {**state, "step": step, **placement.state()})

    if "before" not in state["evals"]:
        state["evals"]["before"] = placement.evaluate()
        _keep_best(cfg, placement, state, 0, state["evals"]["before"], run_dir)
        out.log(state["step"], dict(state["evals"]["before"]))
    step, last = state["step"], cfg.train.steps
    no_signal = NoSignalWatch(cfg.log.no_signal_steps)
    while step < last:
        step += 1
        m: dict[str, float] = {}
        try:
            # 1-2. rollout and reward (DAPO dynamic sampling scores each round as it returns)
            trajs, rollout_m = placement.rollout(step)
            m.update(rollout_m)
            # 3-4. advantages (after DAPO's overlong shaping) and the policy update
            with timed(m, "time/train_s"):
                m.update(placement.update(step, trajs))
            # 5. weight sync
            m.update(placement.sync(step))
        except RolledBack as back:  # a trainer group restarted from its latest checkpoint
            state = _loop_state(back.state)
            step = state["step"]
            continue
        # 6. log
        m.update(rollout_metrics(trajs, cfg.train.group_size))
        no_signal.update(m, out)  # every group one reward, N steps in a row: say so
        _count_faults(state["faults"], m, len(trajs))
        out.trajectories(step, trajs, trained_version=step - 1 if placement.stale_ok else None)
        if cfg.eval.every and step % cfg.eval.every == 0 and step != last:
            with timed(m, "time/eval_s"):
                m.update(placement.evaluate())
                _keep_best(cfg, placement, state, step, m, run_dir)
        out.log(step, m)
        check_nonfinite(cfg, state["faults"]["nonfinite_streak"], "GRPO", step)
        check_failures(cfg, state["faults"]["failed_episodes"], state["faults"]["episodes"], step)
        if not cfg.train.source:  # recorded episodes: another sampler's log-probs
            check_rollout_gap(cfg.faults.max_rollout_logprob_gap, m, trajs, step)
        # 7. checkpoint
        state["step"] = step
        try:
            saved = (
                save(step) if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 else None
            )
        except RolledBack as back:
            state = _loop_state(back.state)
            step = state["step"]
            continue
        preempt_if_requested(guard, "grpo", step, saved, lambda s=step: save(s))
    if not (state["step"] >= last and state["evals"].get("after_step") == last):
        state["evals"]["after"] = placement.evaluate()
        state["evals"]["after_step"] = last
        _keep_best(cfg, placement, state, last, state["evals"]["after"], run_dir)
        out.log(last, dict(state["evals"]["after"]))
        # The end state (after-eval included) is a checkpoint too: a relaunch of a finished
        # run neither repeats the evaluation nor logs it twice.
        state["step"] = last
        save(last)
    return state


def _loop_state(saved: dict[str, Any]) -> dict[str, Any]:
    """The loop's own part of a checkpoint's state: step, evaluations, fault counters."""
    faults = {"nonfinite_streak": 0, "nonfinite_steps": 0, "failed_episodes": 0, "episodes": 0}
    faults.update(saved.get("faults", {}))
    return {
        "step": int(saved.get("step", 0)),
        "evals": dict(saved.get("evals", {})),
        "faults": faults,
        "best": saved.get("best"),
    }


def _keep_best(
    cfg: Config,
    placement: Placement,
    state: dict[str, Any],
    step: int,
    m: dict[str, float],
    run_dir: Path,
) -> None:
    """``eval.select=val``: after an evaluation whose validation greedy success beats every
    earlier one, write the weights to ``<run.dir>/best`` and remember the step, its validation
    score and its held-out metrics (reported, never compared)."""
    if cfg.eval.select != "val" or "val/success_greedy" not in m:  # train.source: no eval
        return
    score = m["val/success_greedy"]
    best = state.get("best")
    if best is None or score > best["val"]:
        placement.write_final(run_dir / "best")
        held_out = {k: v for k, v in m.items() if k.startswith("eval/")}
        state["best"] = {"step": step, "val": score, "eval": held_out}


def _select_final(cfg: Config, state: dict[str, Any], run_dir: Path) -> dict[str, Any] | None:
    """``eval.select=val``: ``final/`` becomes the best-validation weights (``best/``) when
    they are not the last ones; returns the selection (step, validation score, held-out)."""
    best = state.get("best")
    if cfg.eval.select != "val" or best is None:
        return None
    if best["step"] != cfg.train.steps:
        stage = run_dir / ".tmp_final_selected"
        shutil.rmtree(stage, ignore_errors=True)
        shutil.copytree(run_dir / "best", stage)
        replace_dir_atomically(stage, run_dir / "final")
    return dict(best)


def _count_faults(faults: dict[str, int], m: dict[str, float], episodes: int) -> None:
    skipped = m.get("train/nonfinite_skipped", 0.0) > 0
    faults["nonfinite_streak"] = faults["nonfinite_streak"] + 1 if skipped else 0
    faults["nonfinite_steps"] += int(skipped)
    faults["failed_episodes"] += int(m.get("rollout/failed_episodes", 0))
    faults["episodes"] += episodes
    m["faults/nonfinite_steps"] = float(faults["nonfinite_steps"])
