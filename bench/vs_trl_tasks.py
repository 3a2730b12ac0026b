"""The two tasks of ``bench/vs_trl.py``: what each side trains on, stops at and is scored by.

Both tasks give the driver the same interface: ``seeds(step, P)`` (step k's tasks),
``sampling(...)``, ``play(...)`` (gyre's episodes, scored), ``evaluate(...)`` (held-out rewards
per task), and TRL's side: ``trl_setup`` (stop tokens), ``trl_rows`` (the dataset of the same
tasks, in the same order) and ``trl_reward``.

:class:`ArithmeticTask` (the tiny model): raw-text arithmetic, BOS + text prompts, newline stops.

:class:`ChatTask` (``--model DIR``): a JSONL prompt dataset (``examples/smollm2-math/tasks.jsonl``
format: ``prompt``, ``answer``) loaded exactly as a gyre run with ``env.name=dataset``,
``env.dataset.messages: true`` loads it: each prompt becomes one user message, rendered by the
model's own chat template on both sides (TRL: a conversational dataset whose ``prompt`` is that
message list, so TRL applies the template itself). Step k trains on rows ``k*P .. k*P+P-1``
(the first P x steps rows, in order, on both sides); the held-out rows are the file's last
``--eval-tasks`` rows (``env.dataset.eval_rows``), never trained on. A reply ends at the
template's end-of-turn token (``<|im_end|>`` for ChatML) on both sides. The reward is
``gyre.rewards.math_answer`` on both sides: gyre's reward path (``reward.functions``, env weight
0) calls it with the decoded prompts, the decoded completions and the ``answer`` column; TRL's
reward function calls it with the prompt's text, the completion's text and the same ``answer``
column (it reads only the last two). gyre's side is its real message-mode rollout:
:func:`gyre.rollout.tools.message_mode` builds the chat mode from the run config,
:func:`gyre.rollout.core.run_stops` the stop tokens and :func:`gyre.rewards.build_rewarder` the
reward functions, as ``gyre train`` does.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gyre.config import Config, PerfConfig
from gyre.engines import TorchEngine
from gyre.envs import ArithmeticEnv, env_factory
from gyre.models.build import load_pretrained
from gyre.rewards import build_rewarder
from gyre.rewards.math_answer import math_answer
from gyre.rollout.core import run_stops
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.rollout.evaluate import eval_seeds
from gyre.rollout.tools import message_mode
from gyre.trainer.batch import collate
from gyre.trainer.sft import sft_step
from gyre.types import SamplingParams, Trajectory

DEFAULT_TASKS = Path(__file__).resolve().parents[1] / "examples" / "smollm2-math" / "tasks.jsonl"
MATH_ANSWER = "gyre.rewards.math_answer:math_answer"


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


class ArithmeticTask:
    """The tiny model's task: raw-text arithmetic, BOS + text prompts, newline stops.

    The same interface as :class:`vs_trl_chat.ChatTask` (the ``--model`` task)."""

    def __init__(self, max_operand: int, seed: int) -> None:
        self.make_env = env_maker(max_operand)
        self.seed = seed

    def seeds(self, step: int, prompts: int) -> list[int]:
        return task_seeds(self.seed, step, prompts)

    def sampling(self, tok: Any, temperature: float, max_new: int, seed: int) -> SamplingParams:
        return SamplingParams(temperature, 1.0, max_new, stop_ids(tok), seed=seed)

    def play(
        self,
        engine: Any,
        tok: Any,
        seeds: Sequence[int],
        group_size: int,
        params: SamplingParams,
        perf: PerfConfig,
        step: int = 0,
    ) -> list[Trajectory]:
        return run_episodes(
            self.make_env, engine, tok, seeds, group_size, params, continuous=perf.continuous
        )

    def evaluate(
        self, model: torch.nn.Module, tok: Any, tasks: int, max_new: int, temperature: float
    ) -> dict[str, list[float]]:
        """The reward of one sampled answer to each of ``tasks`` held-out tasks; the same tasks
        and sampling seeds for every model, so two models' lists pair up."""
        engine = TorchEngine(copy.deepcopy(model), tok.pad_token_id, seed=0)
        params = self.sampling(tok, temperature, max_new, 12345)
        seeds = [5_000_000 + k for k in range(tasks)]
        trajs = run_episodes(self.make_env, engine, tok, seeds, 1, params)
        return {"sampled": [float(t.reward) for t in trajs]}

    def trl_setup(self, model: torch.nn.Module, tok: Any) -> None:
        from tokenizers import processors

        # Same prompt tokens as gyre (BOS + text): TRL tokenizes plain-text prompts with specials.
        tok._tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, tok.bos_token_id)]
        )
        model.generation_config.eos_token_id = list(stop_ids(tok))

    def trl_rows(self, seeds: Sequence[int]) -> dict[str, list[Any]]:
        env = self.make_env()
        prompts, answers = [], []
        for s in seeds:
            prompts.append(env.reset(s))
            answers.append(env.answer)
        return {"prompt": prompts, "answer": answers}

    @staticmethod
    def trl_reward(completions: list[str], answer: list[int], **_: Any) -> list[float]:
        out = []
        for text, ans in zip(completions, answer, strict=True):
            try:
                out.append(1.0 if int(text.split("\n")[0].strip()) == ans else 0.0)
            except ValueError:
                out.append(0.0)
        return out

    def close(self) -> None:
        pass


def chat_run_config(tasks: Path, eval_rows: int) -> Config:
    """The gyre run config of the task: the dataset env in message mode, rewarded by
    ``math_answer`` alone (the same keys as ``examples/smollm2-math/config.yaml``)."""
    return Config.model_validate(
        {
            "env": {
                "name": "dataset",
                "dataset": {"path": str(tasks), "eval_rows": eval_rows, "messages": True},
            },
            "reward": {"env_weight": 0.0, "functions": [{"fn": MATH_ANSWER}]},
        }
    )


class ChatTask:
    """The ``--model`` task: chat-templated prompts from a dataset, the ``math_answer`` reward.

    Built once per benchmark from the model's tokenizer; both sides and every repeat share it."""

    def __init__(self, tasks: Path, eval_rows: int, tokenizer: Any, failure_log: Path) -> None:
        self.cfg = chat_run_config(tasks, eval_rows)
        self.make_env, self.chat, _ = message_mode(self.cfg, tokenizer, env_factory(self.cfg.env))
        if self.chat is None:  # pragma: no cover - messages: true always gives message mode
            raise SystemExit(f"--tasks {tasks}: not a message-mode dataset")
        self.stops = run_stops(self.cfg, tokenizer, self.chat)
        self.rewarder = build_rewarder(self.cfg.reward, failure_log)
        env = self.make_env()
        self.rows = len(env.tasks)
        self.train_rows = self.rows - eval_rows

    def check_size(self, train_rows: int) -> None:
        """The training rows must come before the held-out ones."""
        if train_rows > self.train_rows:
            raise SystemExit(
                f"--prompts x --steps = {train_rows} training rows, but "
                f"{self.cfg.env.dataset.path} has {self.train_rows} rows before the "
                f"{self.cfg.env.dataset.eval_rows} held-out ones (--eval-tasks)"
            )

    # -- gyre -----------------------------------------------------------------------------
    def seeds(self, step: int, prompts: int) -> list[int]:
        """Training seeds of step ``step``: the dataset env's seed ``i`` is row ``i``."""
        return list(range(step * prompts, (step + 1) * prompts))

    def sampling(self, tok: Any, temperature: float, max_new: int, seed: int) -> SamplingParams:
        s = self.stops
        return SamplingParams(temperature, 1.0, max_new, s.token_ids, seed, stop_strings=s.strings)

    def play(
        self,
        engine: Any,
        tok: Any,
        seeds: Sequence[int],
        group_size: int,
        params: SamplingParams,
        perf: PerfConfig,
        step: int = 0,
    ) -> list[Trajectory]:
        """Episodes of ``seeds`` through gyre's message-mode rollout, scored by its rewarder."""
        trajs = run_episodes(
            self.make_env,
            engine,
            tok,
            seeds,
            group_size,
            params,
            continuous=perf.continuous,
            chat=self.chat,
        )
        if self.rewarder is not None and trajs:
            self.rewarder.score(trajs, tok, step)
        return trajs

    def evaluate(
        self, model: torch.nn.Module, tok: Any, tasks: int, max_new: int, temperature: float
    ) -> dict[str, list[float]]:
        """The ``math_answer`` reward of one greedy and one sampled (at ``temperature``,
        seed 12345) answer to each of the ``tasks`` held-out rows; the same rows and sampling
        seeds for every model, so two models' lists pair up."""
        engine = TorchEngine(copy.deepcopy(model), tok.pad_token_id, seed=0)
        seeds, perf = eval_seeds(tasks), PerfConfig()
        out = {}
        for mode, temp in (("greedy", 0.0), ("sampled", temperature)):
            trajs = self.play(engine, tok, seeds, 1, self.sampling(tok, temp, max_new, 12345), perf)
            out[mode] = [float(t.reward) for t in trajs]
        return out

    # -- TRL ------------------------------------------------------------------------------
    def trl_setup(self, model: torch.nn.Module, tok: Any) -> None:
        """TRL stops where gyre does: the template's end-of-turn token (and EOS)."""
        model.generation_config.eos_token_id = list(self.stops.token_ids)

    def trl_rows(self, seeds: Sequence[int]) -> dict[str, list[Any]]:
        """TRL's conversational dataset of the rows of ``seeds``: ``prompt`` is the message
        list the gyre env gives for that row, ``answer`` its reference (as text)."""
        env = self.make_env()
        prompts, answers = [], []
        for i in seeds:
            prompts.append(env.reset(i))
            answers.append(env.task.answer)
        return {"prompt": prompts, "answer": answers}

    @staticmethod
    def trl_reward(prompts: list[Any], completions: list[Any], answer: list[str], **_: Any):
        """TRL's reward function: ``math_answer`` on the completions' text (TRL hands a
        conversational dataset's completions as ``[{"role": "assistant", "content": ...}]``)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        prompt_texts = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        return math_answer(prompt_texts, texts, answer=answer)

    def close(self) -> None:
        if self.rewarder is not None:
            self.rewarder.close()


def prompt_ids(trajs: Sequence[Trajectory], group_size: int) -> list[list[int]]:
    """The prompt ids (tokens before the first policy token) of each group's first episode."""
    out = []
    for t in trajs[::group_size]:
        first = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.token_ids)
        out.append(list(t.token_ids[:first]))
    return out


def trl_prompt_ids(trainer: Any, prompts: list[Any]) -> list[list[int]]:
    """The prompt ids TRL generates from: its own tokenisation of the dataset's prompts."""
    ids = trainer._tokenize_prompts(prompts)[0]  # TRL's path for text and message prompts
    return [list(map(int, row)) for row in ids]
