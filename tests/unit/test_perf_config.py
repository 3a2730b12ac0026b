"""The ``perf:`` config section: its defaults are the previous behaviour, and every key reaches
the engine / rollout code it switches (explicitly, as arguments; no environment variables)."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml

from gyre.config import ConfigError, describe_fields, dump_config, load_config
from gyre.engines import TorchEngine
from gyre.engines.engine_options import EngineOptions
from gyre.engines.factory import build_engine, torch_engine_options
from gyre.envs.maze import MazeEnv
from gyre.rollout.episodes import run_episodes, stop_ids
from gyre.rollout.evaluate import EvalSettings, evaluate
from gyre.types import GenerationRequest, SamplingParams

PERF_KEYS = {
    "train_lean_forward": True,
    "engine_lean_forward": True,
    "pack": True,
    "logprob_chunk": 1024,
    "activation_checkpointing": False,
    "share_prefix": True,
    "score_trim": True,
    "shared_prefix_attention": True,
    "prefix_sharing": True,
    "compaction": True,
    "compact_min": 0.5,
    "compile_decode": False,
    "continuous": True,
}


def test_perf_defaults_and_descriptions():
    cfg = load_config()
    assert cfg.perf.model_dump() == PERF_KEYS
    lines = {line.split(" = ")[0]: line for line in describe_fields()}
    for key in PERF_KEYS:
        line = lines[f"perf.{key}"]
        assert len(line.split("# ", 1)[1]) > 20, line  # a real description, not "None"
    # written to config.yaml with the rest of the run config
    assert yaml.safe_load(dump_config(cfg))["perf"] == PERF_KEYS


@pytest.mark.parametrize("key", ["train.lean_forward", "train.share_prefix", "engine.lean_forward"])
def test_old_keys_moved_to_perf(key):
    with pytest.raises(ConfigError, match=f"unknown config key '{key}'"):
        load_config(None, [f"{key}=false"])


def test_bad_perf_values_name_the_key():
    with pytest.raises(ConfigError, match=r"perf\.logprob_chunk"):
        load_config(None, ["perf.logprob_chunk=-1"])
    with pytest.raises(ConfigError, match=r"perf\.compact_min"):
        load_config(None, ["perf.compact_min=2"])


def test_engine_options_defaults_are_the_engine_defaults(tokenizer, make_tiny_model):
    """The engine a default run builds is the engine ``TorchEngine(model, pad)`` always was."""
    opts = torch_engine_options(load_config().perf)
    assert opts == EngineOptions()
    assert TorchEngine(make_tiny_model(), tokenizer.pad_token_id).options == opts
    assert (opts.prefix_sharing, opts.compaction, opts.compact_min) == (True, True, 0.5)
    assert (opts.compile_decode, opts.lean_forward, opts.shared_prefix_attention) == (
        False,
        True,
        True,
    )


def test_perf_keys_reach_the_built_engine(tmp_path, tokenizer, make_tiny_model):
    cfg = load_config(
        None,
        [
            "perf.prefix_sharing=false",
            "perf.compaction=false",
            "perf.compact_min=0.25",
            "perf.engine_lean_forward=false",
            "perf.shared_prefix_attention=false",
            "perf.compile_decode=true",
        ],
    )
    engine, _ = build_engine(cfg, make_tiny_model(), tokenizer, tmp_path)
    opts = engine.options
    assert (opts.prefix_sharing, opts.compaction, opts.compact_min) == (False, False, 0.25)
    assert opts.lean_forward is False and engine.runner.lean() is None
    assert opts.shared_prefix_attention is False and opts.compile_decode is True


def _group_requests(tokenizer) -> list[GenerationRequest]:
    prompt = [
        tokenizer.bos_token_id,
        *tokenizer.encode("#.A..\n#####\nu3l1>", add_special_tokens=False),
    ]
    return [GenerationRequest(prompt, seed=j) for j in range(4)]


def test_shared_prefix_attention_switch_reaches_decode(tokenizer, make_tiny_model, monkeypatch):
    """perf.shared_prefix_attention=false: a forked group never takes the grouped decode layout
    (spied on), and the sampled tokens are the same."""
    from gyre.models.lean_decode import _Group

    calls = []
    real = _Group.attend
    monkeypatch.setattr(_Group, "attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = make_tiny_model(seed=21, sharp=True)
    params = SamplingParams(1.0, 1.0, 6, ())
    outs = {}
    for flag in ("true", "false"):
        perf = load_config(None, [f"perf.shared_prefix_attention={flag}"]).perf
        engine = TorchEngine(
            copy.deepcopy(model), tokenizer.pad_token_id, options=torch_engine_options(perf)
        )
        calls.clear()
        outs[flag] = [c.token_ids for c in engine.generate(_group_requests(tokenizer), params)]
        assert bool(calls) == (flag == "true")
    assert outs["true"] == outs["false"]


class _CountingEngine(TorchEngine):
    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.continuous_calls = 0

    def generate_continuous(self, requests, params, on_complete=None):
        # generate() is generate_continuous(..., None): count only the rollout's own calls
        self.continuous_calls += on_complete is not None
        return super().generate_continuous(requests, params, on_complete)


def _maze() -> MazeEnv:
    return MazeEnv(size=5, wall_density=0.3, min_distance=4, budget_factor=1.5)


def test_continuous_switch_reaches_rollout_and_eval(tokenizer, make_tiny_model):
    """run_episodes / evaluate use continuous batching by default (perf.continuous) and turns
    in lockstep when it is off; the trajectories are the same either way."""
    engine = _CountingEngine(make_tiny_model(seed=2), tokenizer.pad_token_id)
    params = SamplingParams(1.0, 1.0, 4, stop_ids(tokenizer), seed=7)
    on = run_episodes(_maze, engine, tokenizer, [1, 4], 2, params)
    assert engine.continuous_calls == 1
    off = run_episodes(_maze, engine, tokenizer, [1, 4], 2, params, continuous=False)
    assert engine.continuous_calls == 1
    assert [t.token_ids for t in on] == [t.token_ids for t in off]
    evaluate(engine, _maze, tokenizer, 2, EvalSettings(1.0, 4, sampled=False, continuous=False))
    assert engine.continuous_calls == 1
    evaluate(engine, _maze, tokenizer, 2, EvalSettings(1.0, 4, sampled=False))
    assert engine.continuous_calls == 2


def test_rollout_evaluate_and_play_pass_perf_continuous(tokenizer, make_tiny_model):
    from gyre.rollout import Rollout

    engine = _CountingEngine(make_tiny_model(seed=2), tokenizer.pad_token_id)
    base = ["eval.episodes=2", "eval.sampled=false", "env.maze.size=5", "train.group_size=2"]
    off = Rollout(load_config(None, [*base, "perf.continuous=false"]), engine, tokenizer)
    off.evaluate()
    off.play(0, 1, seed=3)
    assert engine.continuous_calls == 0
    on = Rollout(load_config(None, base), engine, tokenizer)
    on.evaluate()
    assert engine.continuous_calls == 1
    on.play(0, 1, seed=3)
    assert engine.continuous_calls == 2


def test_ray_rollout_worker_engine_takes_perf(tmp_path, tiny_cfg):
    """The Ray rollout worker (driven in process) builds its engine from cfg.perf too."""
    from gyre.models.build import create_tiny_checkpoint
    from gyre.runners.actors import RolloutWorker

    path = create_tiny_checkpoint(tiny_cfg, tmp_path / "m", seed=0)
    cfg = load_config(None, ["perf.engine_lean_forward=false", "perf.prefix_sharing=false"])
    threads = torch.get_num_threads()
    try:
        worker = RolloutWorker(cfg, str(path), 0)
    finally:
        torch.set_num_threads(threads)  # the worker sets its actor's thread count
    engine = worker.rollout.engine
    assert engine.options.lean_forward is False and engine.options.prefix_sharing is False
    assert engine.options.compaction is True  # the default


def test_no_numeric_env_switch_is_read(monkeypatch, tokenizer, make_tiny_model):
    """The old GYRE_* switches do nothing any more: the defaults hold whatever the env says."""
    for name in ("GYRE_LEAN", "GYRE_PACK", "GYRE_COMPACTION", "GYRE_PREFIX_SHARING"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("GYRE_COMPILE_DECODE", "1")
    engine = TorchEngine(make_tiny_model(), tokenizer.pad_token_id)
    opts = engine.options
    assert opts.prefix_sharing and opts.compaction and not opts.compile_decode
    assert engine.runner.lean() is not None
