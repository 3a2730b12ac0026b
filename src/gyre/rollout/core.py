"""The :class:`Rollout`: engine(s), env factory, reward functions and dynamic sampling.

    generate(step) -> (trajectories, metrics)   phases 1-2 of a local step: the next tasks of
                                                the run's task stream, played, scored, and with
                                                DAPO dynamic sampling refilled
    play(first_task, num_tasks, seed)           one contiguous block of tasks (a Ray *share*),
                                                played and scored
    evaluate() -> metrics                       held-out success of the engine's weights
    sync(model, version) / load_weights(...)    keep the engine at the trainer's version

The local runner holds one; each Ray rollout worker holds one (``runners/actors.py``), so a
reward function, a LoRA policy or an HTTP engine works the same on both. Task ``i`` of GRPO is
seed ``train_seed(run.seed, STREAM_GRPO, i)``; every trajectory gets ``group_id = i`` and
``traj_id = "i:j"`` (sample j), so a task's samples can be traced and trained only once.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.config import Config
from gyre.engines.base import Engine
from gyre.engines.factory import build_engine, initial_sync, run_torch_engine
from gyre.engines.sync import WeightSync
from gyre.envs import env_factory
from gyre.rewards import build_rewarder
from gyre.rollout.chat import ChatMode
from gyre.rollout.context import check_prompts, context_limit
from gyre.rollout.dapo import sample_groups
from gyre.rollout.episodes import EpisodeOptions, RolloutStats, run_episodes
from gyre.rollout.evaluate import EvalSettings, evaluate, train_seed
from gyre.rollout.recorded import RecordedSource
from gyre.rollout.replay import LevelReplay
from gyre.rollout.stops import Stops, derive_stops
from gyre.rollout.tools import message_metrics, message_mode
from gyre.rollout.window import window_of
from gyre.telemetry import timed
from gyre.types import SamplingParams, Trajectory

STREAM_SFT, STREAM_GRPO = 1, 2


def rollout_seed(cfg: Config, step: int, round_: int = 0) -> int:
    """The sampler seed of GRPO step ``step`` (1-based), rollout round ``round_``."""
    return (cfg.run.seed * 1_000_003 + step + round_ * 7_919) % 2**31


def run_stops(cfg: Config, tokenizer: Any, chat: ChatMode | None = None) -> Stops:
    """The run's stop tokens and strings: ``rollout.*`` or derived from the tokenizer (in
    message mode: the chat template's end-of-turn token and EOS, no newline stops)."""
    if chat is not None and not cfg.rollout.stop_tokens:
        ids = chat.template.stop_ids()
        return Stops(ids, tuple(cfg.rollout.stop_strings), (chat.template.end_id,))
    return derive_stops(tokenizer, cfg.rollout.stop_tokens, cfg.rollout.stop_strings)


def sampling_params(
    cfg: Config, tokenizer: Any, seed: int | None, chat: ChatMode | None = None
) -> SamplingParams:
    s, stops = cfg.train.sampling, run_stops(cfg, tokenizer, chat)
    return SamplingParams(
        s.temperature,
        s.top_p,
        s.max_new_tokens,
        stops.token_ids,
        seed,
        stop_strings=stops.strings,
    )


def rollout_metrics(trajs: list[Trajectory], group_size: int) -> dict[str, float]:
    """A training batch's rollout statistics (groups of ``group_size``)."""
    rewards = torch.tensor([t.reward for t in trajs])
    grouped = rewards.view(-1, group_size)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/success_rate": float(np.mean([t.success for t in trajs])),
        "rollout/turns_mean": float(np.mean([t.num_turns for t in trajs])),
        "rollout/response_tokens_mean": float(np.mean([t.num_generated for t in trajs])),
        "rollout/frac_reward_zero_std": float((grouped.std(dim=1) == 0).float().mean()),
        "rollout/failed_episodes": float(sum(bool(t.info.get("failed")) for t in trajs)),
        **message_metrics(trajs),
        **greedy_metrics(trajs),
        **retry_metrics(trajs),
    }


def retry_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """``train.sampling.retry_temperature``: the share of turns sampled at it."""
    if not any("retried_turns" in t.info for t in trajs):
        return {}
    turns = sum(t.num_turns for t in trajs)
    retried = sum(int(t.info.get("retried_turns", 0)) for t in trajs)
    return {"rollout/retried_turn_frac": retried / max(turns, 1)}


def greedy_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """``train.sampling.greedy_per_group``: how the greedy episodes of the step's groups did."""
    greedy = [t for t in trajs if t.info.get("greedy")]
    if not greedy:
        return {}
    return {"rollout/greedy_success_rate": float(np.mean([t.success for t in greedy]))}


def recorded_source(cfg: Config, tokenizer: Any, engine: Engine) -> RecordedSource | None:
    """``train.source``'s recording, checked against the run's vocab and sampling."""
    if not cfg.train.source:
        return None
    s, config = cfg.train.sampling, engine.model.config if engine.features.in_process else None
    vocab = max(len(tokenizer), int(getattr(config, "vocab_size", 0)))
    src = RecordedSource(cfg.train.source, cfg.train.group_size, vocab, s.temperature, s.top_p)
    print(src.describe(), flush=True)
    return src


def with_greedy_episodes(sampled: list[Trajectory], greedy: list[Trajectory]) -> list[Trajectory]:
    """Groups of ``G - 1`` sampled episodes (task-major) each followed by the task's greedy one
    (``train.sampling.greedy_per_group``). The greedy sampler picks its tokens with probability
    1, so their rollout log-probs become 0.0: with ``train.algo.rollout_is`` the token's weight
    is then pi_old(token), the importance ratio of the tempered policy to the greedy one."""
    per = len(sampled) // max(len(greedy), 1)
    out: list[Trajectory] = []
    for k, g in enumerate(greedy):
        g.rollout_logprobs = [0.0] * len(g.rollout_logprobs)
        g.info["greedy"] = True
        out += [*sampled[k * per : (k + 1) * per], g]
    return out


class Rollout:
    """Plays the run's tasks with its engine and scores them (env reward + reward functions)."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        tokenizer: Any,
        syncer: WeightSync | None = None,
        rewarder: Any = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.syncer = syncer
        self.rewarder = rewarder
        # Message-mode envs get the chat template (and the tools' wrapper): rollout/tools.py.
        self.make_env, self.chat, self.toolbox = message_mode(cfg, tokenizer, env_factory(cfg.env))
        self.window = window_of(cfg.rollout)  # rollout.history_turns (rollout/window.py)
        # train.source: recorded episodes instead of env x engine (rollout/recorded.py)
        self.recorded = recorded_source(cfg, tokenizer, engine)
        if self.chat is None and self.recorded is None:  # raw text: the first prompt must fit
            check_prompts(cfg, self.make_env, tokenizer, context_limit(engine))
        self.next_task = 0  # the local task stream's position (tasks consumed so far)
        replay = cfg.train.level_replay
        self.replay = LevelReplay(replay, cfg.run.seed) if replay.prob > 0 else None

    @classmethod
    def build(
        cls,
        cfg: Config,
        run_dir: Path,
        model: torch.nn.Module,
        tokenizer: Any,
        owns_model: bool = False,
        failure_log: str = "reward_failures.jsonl",
    ) -> Rollout:
        """The engine for ``cfg.engine`` over ``model`` and the reward functions of ``cfg.reward``.

        ``owns_model``: ``model`` is this rollout's own copy (a Ray worker loaded it), so the
        in-process engine runs it as is; otherwise it is the trainer's policy and the engine
        gets a copy (or, with ``engine.weight_sync=shared``, the very same parameters).
        """
        if owns_model and cfg.engine.kind == "torch":
            engine: Engine = run_torch_engine(cfg, model, tokenizer)
            syncer = None
        else:
            engine, syncer = build_engine(cfg, model, tokenizer, run_dir)
        # Built before any training, so a bad reward config or a sandbox that cannot isolate
        # fails now.
        rewarder = build_rewarder(cfg.reward, run_dir / failure_log)
        return cls(cfg, engine, tokenizer, syncer, rewarder)

    # -- playing ------------------------------------------------------------------------------
    def play(
        self,
        first_task: int,
        num_tasks: int,
        seed: int,
        m: dict[str, float] | None = None,
        step: int = 0,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """``group_size`` episodes of each of the tasks ``first_task ..`` (+ ``num_tasks``),
        sampled with ``seed``, then scored by the reward functions (``m`` gets their metrics)."""
        return self.play_tasks(range(first_task, first_task + num_tasks), seed, m, step)

    def play_tasks(
        self,
        tasks: Sequence[int],
        seed: int,
        m: dict[str, float] | None = None,
        step: int = 0,
    ) -> tuple[list[Trajectory], RolloutStats]:
        """:meth:`play` of any task indices (level replay mixes old ones with new ones)."""
        cfg, G = self.cfg, self.cfg.train.group_size
        stats = RolloutStats()
        if self.recorded is not None:  # scored already: the agent's or --reward-fn's reward
            return self.recorded.play(tasks, m, int(self.engine.version)), stats
        seeds = [train_seed(cfg.run.seed, STREAM_GRPO, k) for k in tasks]
        params = sampling_params(cfg, self.tokenizer, seed, self.chat)
        greedy = cfg.train.sampling.greedy_per_group
        mode: EpisodeOptions = {
            "continuous": cfg.perf.continuous,
            "chat": self.chat,
            "window": self.window,
            "group_ids": tasks,  # a task's index in the run's task stream is its group
        }
        play = functools.partial(run_episodes, self.make_env, self.engine, self.tokenizer, seeds)
        retry = cfg.train.sampling.retry_temperature
        trajs = play(G - greedy, params, stats, retry_temperature=retry, **mode)
        if greedy:
            greedy_params = dataclasses.replace(params, temperature=0.0)
            trajs = with_greedy_episodes(trajs, play(1, greedy_params, stats, **mode))
        for i, t in enumerate(trajs):
            t.traj_id = f"{t.group_id}:{i % G}"
        if self.rewarder is not None:  # t.reward becomes the weighted total
            m = {} if m is None else m
            with timed(m, "time/reward_s"):
                m.update(self.rewarder.score(trajs, self.tokenizer, step))
        return trajs, stats

    def generate(self, step: int) -> tuple[list[Trajectory], dict[str, float]]:
        """Phases 1-2 of a local step: ``train.tasks_per_step`` groups of the next tasks, scored;
        with DAPO dynamic sampling, more rounds until the groups have reward variance."""
        cfg = self.cfg
        m: dict[str, float] = {}
        totals = RolloutStats()

        used: set[int] = set()  # level replay: tasks already in this step

        def round_(n_tasks: int, rnd: int) -> list[Trajectory]:
            if self.replay is None:
                tasks, new = list(range(self.next_task, self.next_task + n_tasks)), n_tasks
            else:
                tasks, new = self.replay.draw(n_tasks, self.next_task, step, rnd, used)
                used.update(tasks)
            trajs, stats = self.play_tasks(tasks, rollout_seed(cfg, step, rnd), m, step)
            self.next_task += new
            if self.replay is not None:
                for t in trajs:
                    if t.group_id < self.next_task - new:  # a replay: traj ids stay unique
                        t.traj_id += f"@{step}"
                self.replay.update(trajs)
                m["rollout/replayed_tasks"] = m.get("rollout/replayed_tasks", 0.0) + n_tasks - new
                m["rollout/replay_buffer"] = float(len(self.replay.scores))
            for k in ("seconds", "generated_tokens", "turns", "failed_episodes"):
                setattr(totals, k, getattr(totals, k) + getattr(stats, k))
            return trajs

        dapo = cfg.train.dapo
        with timed(m, "time/rollout_s"):
            trajs, dapo_m = sample_groups(
                round_,
                cfg.train.tasks_per_step,
                dynamic=dapo.dynamic_sampling,
                max_rounds=dapo.max_rounds,
            )
        m.update(dapo_m)
        m["perf/rollout_tokens_per_s"] = totals.tokens_per_s
        return trajs, m

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation (``eval/*``) and validation (``val/*``, when
        ``eval.validation_episodes``) of the engine's current weights with the run's settings."""
        cfg, out = self.cfg, {}
        if self.recorded is not None:  # the agent's tasks are not gyre's to play
            return out
        s = cfg.train.sampling
        settings = EvalSettings(
            s.temperature,
            s.max_new_tokens,
            sampled=cfg.eval.sampled,
            seed=cfg.run.seed,
            top_p=s.top_p,
            continuous=cfg.perf.continuous,
            stops=run_stops(cfg, self.tokenizer, self.chat),
            chat=self.chat,
            window=self.window,
        )
        for split, n in (("eval", cfg.eval.episodes), ("val", cfg.eval.validation_episodes)):
            if n:
                play = (self.engine, self.make_env, self.tokenizer)
                out.update(evaluate(*play, n, settings, split, score=self._score_eval))
        return out

    def _score_eval(self, trajs: list[Trajectory]) -> None:
        """Held-out episodes get the run's reward (reward functions), as training's do."""
        if self.rewarder is not None:
            self.rewarder.score(trajs, self.tokenizer)

    # -- weights ------------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return int(self.engine.version)

    def generators(self) -> dict[str, Any]:
        """RNG state that carries from step to step (the in-process engine's sampler)."""
        return {"engine": self.engine.generator} if self.engine.features.in_process else {}

    def start_sync(self, model: torch.nn.Module, sft_base: Path | None) -> None:
        """Before the first rollout of a disk-synced run, give every engine the policy."""
        if self.syncer is not None:
            initial_sync(self.syncer, model, self.engine.version, sft_base)

    def sync_due(self, step: int) -> bool:
        return self.syncer is not None and self.syncer.due(step, self.cfg.train.steps)

    def sync(self, model: torch.nn.Module, version: int) -> dict[str, float]:
        """Phase 5 in one process: the trainer's ``model`` -> the engine, as ``version``."""
        assert self.syncer is not None
        return self.syncer.sync(model, version)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Tensors from a trainer in another process (a Ray broadcast)."""
        self.engine.load_weights(state, version)

    def follow(self, path: str, version: int) -> None:
        """An HTTP engine whose servers were given ``version`` (from ``path``) by the trainer:
        point this client's requests at it without pushing it again."""
        self.engine.adopt(path, version, lora=self.cfg.model.lora is not None)

    def close(self) -> None:
        if self.toolbox is not None:
            self.toolbox.close()
        if self.rewarder is not None:
            self.rewarder.close()
        if self.engine.features.remote:
            self.engine.close()
