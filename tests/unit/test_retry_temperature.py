"""``train.sampling.retry_temperature``: a turn after an invalid action (the env's
``info["invalid"]``) is sampled at its own temperature; engines take a request's own
``temperature`` (``GenerationRequest.temperature``)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from gyre.config import ConfigError, load_config
from gyre.engines import TorchEngine
from gyre.engines.base import EngineFeatures
from gyre.engines.http_engine import HttpEngine
from gyre.envs.maze import MazeEnv
from gyre.rollout.core import rollout_metrics
from gyre.rollout.episodes import run_episodes
from gyre.types import Completion, GenerationRequest, SamplingParams

PROMPT = [1, 5, 9, 12, 3]


def _params(temperature: float, seed: int | None = None, n: int = 6) -> SamplingParams:
    return SamplingParams(temperature, 1.0, n, (), seed)


def test_a_request_temperature_replaces_the_batch_one(make_tiny_model):
    model = make_tiny_model(seed=3, sharp=True)
    engine = TorchEngine(model, 0, seed=0)
    own = GenerationRequest(PROMPT, seed=11, temperature=0.0)  # greedy inside a T=1 batch
    other = GenerationRequest(PROMPT, seed=12)
    mixed = engine.generate([other, own], _params(1.0))
    greedy = engine.generate([GenerationRequest(PROMPT, seed=11)], _params(0.0))[0]
    alone = engine.generate([GenerationRequest(PROMPT, seed=12)], _params(1.0))[0]
    assert mixed[1].token_ids == greedy.token_ids
    assert mixed[1].logprobs == pytest.approx(greedy.logprobs, abs=1e-4)
    # the batch's own rows are unchanged by a neighbour at another temperature
    assert mixed[0].token_ids == alone.token_ids
    assert mixed[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    hot = engine.generate([GenerationRequest(PROMPT, seed=5, temperature=2.0)], _params(0.6))[0]
    ref = engine.generate([GenerationRequest(PROMPT, seed=5)], _params(2.0))[0]
    assert hot.token_ids == ref.token_ids  # the same keyed draws at the same temperature
    assert hot.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert mixed[0].logprobs != pytest.approx(hot.logprobs, abs=1e-3)


def test_top_logprobs_are_under_each_request_temperature(make_tiny_model):
    model = make_tiny_model(seed=3, sharp=True)
    engine = TorchEngine(model, 0, seed=0)
    p = SamplingParams(1.0, 1.0, 2, (), None, top_logprobs=3)
    a, b = engine.generate(
        [GenerationRequest(PROMPT, seed=1), GenerationRequest(PROMPT, seed=1, temperature=0.5)], p
    )
    assert a.top_logprobs and b.top_logprobs
    # at 0.5 the best token's share is larger than at 1.0
    assert max(b.top_logprobs[0].values()) > max(a.top_logprobs[0].values())


class Wall:
    """A user's env, outside the package: ``"b"`` bumps (invalid), ``"g"`` reaches the goal,
    anything else is a legal move that changes nothing of note."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, seed: int) -> str:
        self.turn = 0
        return "go:"

    def step(self, action: str):
        self.turn += 1
        done = self.turn >= 4
        return "!" if "b" in action else ".", 0.0, done, {"invalid": "b" in action}


class ScriptEngine:
    """Answers every turn from a script and records each request's temperature."""

    version = 0
    features = EngineFeatures(per_request_temperature=True)

    def __init__(self, tokenizer, actions: list[str]):
        self.tok, self.actions, self.seen = tokenizer, actions, []

    def generate(self, requests, params):
        out = []
        for _ in requests:
            ids = self.tok.encode(self.actions[len(self.seen)], add_special_tokens=False)
            self.seen.append(_temp(requests[len(out)]))
            out.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return out

    def release(self, sessions):
        pass


def _temp(req: GenerationRequest) -> float | None:
    return req.temperature


def test_the_turn_after_an_invalid_action_is_retried_hotter(tokenizer):
    engine = ScriptEngine(tokenizer, ["b\n", "b\n", "u\n", "b\n"])
    trajs = run_episodes(
        lambda: Wall(), engine, tokenizer, [0], 1, _params(0.6), continuous=False,
        retry_temperature=2.5,
    )  # fmt: skip
    assert engine.seen == [None, 2.5, 2.5, None]
    assert trajs[0].info["retried_turns"] == 2
    m = rollout_metrics(trajs, 1)
    assert m["rollout/retried_turn_frac"] == pytest.approx(2 / 4)
    off = ScriptEngine(tokenizer, ["b\n", "b\n", "u\n", "b\n"])
    plain = run_episodes(lambda: Wall(), off, tokenizer, [0], 1, _params(0.6), continuous=False)
    assert off.seen == [None] * 4 and "retried_turns" not in plain[0].info
    assert "rollout/retried_turn_frac" not in rollout_metrics(plain, 1)


def test_an_engine_without_per_request_temperature_is_refused(tokenizer):
    engine = ScriptEngine(tokenizer, ["u\n"] * 4)
    engine.features = EngineFeatures(per_request_temperature=False)
    with pytest.raises(ValueError, match=r"retry_temperature.*per_request_temperature"):
        run_episodes(lambda: Wall(), engine, tokenizer, [0], 1, _params(0.6), retry_temperature=2)


def test_retries_with_a_byte_level_bpe_model_and_continuous_batching():
    """A real tokenizer (the move and its newline are BPE tokens) through the in-process engine:
    the retried turns' rollout log-probs are those of the hotter distribution."""
    from helpers import bpe_chat_tokenizer, tiny_qwen2

    tok = bpe_chat_tokenizer()
    model = tiny_qwen2(tok, seed=1).eval()
    engine = TorchEngine(model, tok.pad_token_id, seed=0)
    stops = (tok.convert_tokens_to_ids("Ċ"), tok.eos_token_id)
    params = SamplingParams(0.6, 1.0, 3, stops, 9)
    envs: list[Logged] = []

    def make() -> Logged:
        envs.append(Logged(size=5))
        return envs[-1]

    trajs = run_episodes(make, engine, tok, [3, 4], 4, params, retry_temperature=3.0)
    assert sum(t.info["retried_turns"] for t in trajs) > 0
    for t, env in zip(trajs, envs, strict=True):  # every invalid turn but the last is retried
        assert len(env.invalid) == t.num_turns
        assert t.info["retried_turns"] == sum(env.invalid[:-1])
    m = rollout_metrics(trajs, 4)
    assert 0 < m["rollout/retried_turn_frac"] < 1


class Logged(MazeEnv):
    """The maze, remembering which of its steps were invalid."""

    def reset(self, seed: int) -> str:
        self.invalid: list[bool] = []
        return super().reset(seed)

    def step(self, action: str):
        out = super().step(action)
        self.invalid.append(out[3]["invalid"])
        return out


def test_maze_info_says_which_actions_were_invalid():
    env = MazeEnv(size=5)
    env.reset(0)
    r, c = env.pos
    moves = {"u": (-1, 0), "d": (1, 0), "l": (0, -1), "r": (0, 1)}
    blocked = next(m for m, (dr, dc) in moves.items() if not env._open(r + dr, c + dc))
    assert env.step(blocked)[3]["invalid"] is True
    assert env.step("jump")[3]["invalid"] is True  # unparsable: wastes the turn
    legal = next(m for m, (dr, dc) in moves.items() if env._open(r + dr, c + dc))
    assert env.step(legal)[3]["invalid"] is False


def test_http_engine_sends_a_request_temperature_in_its_body():
    engine = object.__new__(HttpEngine)
    engine.api, engine._workers = "openai", ThreadPoolExecutor(2)
    engine.timeout_s, engine.max_retries, engine.servers = 5.0, 0, []
    sent: list[float] = []

    def complete(prompt, params, images):
        sent.append(params.temperature)
        return Completion([7], [-0.1], "stop")

    engine._complete = complete
    engine.generate(
        [GenerationRequest([1, 2]), GenerationRequest([1, 2], temperature=1.7)], _params(0.6)
    )
    assert sorted(sent) == [0.6, 1.7]
    engine._workers.shutdown()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (["train.sampling.retry_temperature=0.001"], "retry_temperature"),
        (["train.sampling.retry_temperature=-1"], "retry_temperature"),
        (["train.sampling.retry_temperature=2", "train.algo.old_logprobs=rollout"], "old_logprobs"),
    ],
)
def test_bad_settings_name_the_field(extra, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, extra)


def test_a_maze_run_with_retries_and_clamped_self_loops_logs_their_shares(tmp_path):
    """Both bump levers in one short run: the retries' share and the self-loop turns' share
    (``train.algo.self_loop_advantage=nonpositive``, the turns whose advantage is clamped)."""
    import gyre.runners

    run = tmp_path / "run"
    cfg = load_config(None, [
        "model.hidden_size=32", "model.num_layers=2", "model.intermediate_size=64",
        "sft.steps=20", "sft.demos=100", "sft.batch_size=16", "sft.lr=0.01",
        "train.steps=2", "train.tasks_per_step=4", "train.group_size=4",
        "train.sampling.retry_temperature=2.0", "train.algo.rollout_is=truncate",
        "train.algo.self_loop_advantage=nonpositive",
        "eval.episodes=4", "eval.every=0", "checkpoint.every=0", "log.console=off",
        "run.threads=1", f"run.dir={run}",
    ])  # fmt: skip
    gyre.runners.train(cfg)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/retried_turn_frac" in r]
    assert len(steps) == 2
    assert all(0.0 < r["rollout/retried_turn_frac"] < 1.0 for r in steps)
    # a retried turn follows a bump, and a bump keeps the cell: self-loops are there too
    assert all(0.0 < r["train/self_loop_turn_frac"] < 1.0 for r in steps)
    assert np.isfinite([r["train/loss"] for r in rows if "train/loss" in r]).all()
    assert torch.isfinite(torch.tensor([r["rollout/reward_mean"] for r in steps])).all()
