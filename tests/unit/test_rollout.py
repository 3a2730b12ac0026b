"""Multi-turn rollout: the loss mask is 1 exactly on the engine's tokens, re-derived by replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gyre.engines import TorchEngine
from gyre.envs.arithmetic import ArithmeticEnv
from gyre.envs.maze import MazeEnv
from gyre.rollout.demonstrate import demonstrate
from gyre.rollout.episodes import RolloutStats, run_episodes, stop_ids
from gyre.types import SamplingParams
from helpers import RecordingEngine

MAZE = {"size": 5, "wall_density": 0.3, "min_distance": 4, "budget_factor": 1.5}


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _check_replay(trajs, rec, tokenizer, make_env, seeds, group_size, params, version):
    """Rebuild every trajectory from the recorded completions and a fresh env."""
    first = rec.calls[0]
    assert len(first.sessions) == len(trajs) == len(seeds) * group_size
    assert len(set(first.sessions)) == len(trajs), "every episode needs its own session"
    by_session = rec.per_session()
    stops = set(params.stop_token_ids)
    for i, traj in enumerate(trajs):
        turns = by_session[first.sessions[i]]
        env = make_env()
        ids = [tokenizer.bos_token_id, *_enc(tokenizer, env.reset(seeds[i // group_size]))]
        mask = [0] * len(ids)
        lps = [0.0] * len(ids)
        total, info, done = 0.0, {}, False
        generated = []
        for k, (prompt, comp) in enumerate(turns):
            assert not done, "engine called after the episode ended"
            assert prompt == ids, f"traj {i} turn {k}: prompt is not the full history"
            assert 1 <= len(comp.token_ids) <= params.max_new_tokens
            assert len(comp.logprobs) == len(comp.token_ids)
            assert (comp.finish_reason == "stop") == (comp.token_ids[-1] in stops)
            generated += comp.token_ids
            ids += comp.token_ids
            mask += [1] * len(comp.token_ids)
            lps += comp.logprobs
            text = tokenizer.decode(comp.token_ids, skip_special_tokens=True)
            obs, r, done, info = env.step(text)
            total += r
            if not done:
                obs_ids = _enc(tokenizer, obs)
                ids += obs_ids
                mask += [0] * len(obs_ids)
                lps += [0.0] * len(obs_ids)
        assert done, f"traj {i} ended before its env did"
        assert traj.token_ids == ids
        assert traj.loss_mask == mask
        assert traj.rollout_logprobs == lps
        # masked tokens are exactly the concatenated completions
        assert [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m] == generated
        assert traj.num_generated == len(generated)
        assert traj.num_turns == len(turns)
        assert traj.reward == total
        assert traj.success == bool(info["success"])
        assert traj.group_id == i // group_size
        assert traj.task_seed == seeds[i // group_size]
        assert traj.policy_version == version
        assert traj.loss_mask[0] == 0 and traj.token_ids[0] == tokenizer.bos_token_id
        for m, lp in zip(traj.loss_mask, traj.rollout_logprobs, strict=True):
            assert (lp == 0.0) if m == 0 else (lp <= 0.0)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
def test_maze_loss_mask_matches_engine_tokens(tokenizer, make_tiny_model, temperature, top_p):
    model = make_tiny_model(seed=0, sharp=True)
    rec = RecordingEngine(TorchEngine(model, tokenizer.pad_token_id, seed=0))
    rec.version = 7
    seeds = [3, 8, 21]
    group_size = 2
    params = SamplingParams(temperature, top_p, 3, stop_ids(tokenizer), seed=5)
    stats = RolloutStats()

    def make_env():
        return MazeEnv(**MAZE)

    trajs = run_episodes(make_env, rec, tokenizer, seeds, group_size, params, stats)
    _check_replay(trajs, rec, tokenizer, make_env, seeds, group_size, params, version=7)
    assert max(t.num_turns for t in trajs) > 1, "need multi-turn episodes"
    assert stats.turns == sum(t.num_turns for t in trajs)
    assert stats.generated_tokens == sum(t.num_generated for t in trajs)
    # every session is released once its episode ends
    assert sorted(rec.released) == sorted(rec.calls[0].sessions)


def test_stop_ids_are_newline_and_eos(tokenizer):
    ids = stop_ids(tokenizer)
    assert set(ids) == {tokenizer.convert_tokens_to_ids("\n"), tokenizer.eos_token_id}


def test_arithmetic_single_turn(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=1, sharp=True)
    rec = RecordingEngine(TorchEngine(model, tokenizer.pad_token_id, seed=0))
    seeds = [0, 1, 2, 3]
    params = SamplingParams(1.0, 1.0, 4, stop_ids(tokenizer), seed=0)
    trajs = run_episodes(ArithmeticEnv, rec, tokenizer, seeds, 2, params)
    assert len(rec.calls) == 1
    _check_replay(trajs, rec, tokenizer, ArithmeticEnv, seeds, 2, params, version=0)
    assert all(t.num_turns == 1 for t in trajs)


def test_demonstration_mask_covers_actions(tokenizer):
    def make_env():
        return MazeEnv(**MAZE)

    rng = np.random.default_rng(0)
    traj = demonstrate(make_env, tokenizer, 4, noise=0.0, rng=rng)
    env = make_env()
    env.reset(4)
    assert traj.success and traj.reward == 1.0 and traj.num_turns == env.shortest
    nl = tokenizer.convert_tokens_to_ids("\n")
    masked = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
    # each expert action is one letter followed by a newline
    assert len(masked) == 2 * traj.num_turns
    assert masked[1::2] == [nl] * traj.num_turns
    assert {tokenizer.decode([t]) for t in masked[0::2]} <= set("udlr")
    assert traj.token_ids[0] == tokenizer.bos_token_id and traj.loss_mask[0] == 0
    assert traj.loss_mask[-1] == 1  # the final action ends the episode: no observation after


def test_seeded_turns_draw_fresh_randomness(tokenizer, make_tiny_model):
    model = make_tiny_model(seed=0)
    with torch.no_grad():
        model.model.norm.weight.zero_()  # logits are 0: the policy is uniform at every turn
    engine = TorchEngine(model, tokenizer.pad_token_id, seed=0)
    params = SamplingParams(1.0, 1.0, 1, (), seed=5)
    trajs = run_episodes(lambda: MazeEnv(**MAZE), engine, tokenizer, [1, 2, 3], 2, params)
    for traj in trajs:
        actions = [t for t, m in zip(traj.token_ids, traj.loss_mask, strict=True) if m]
        assert len(actions) >= 6
        # independent uniform draws over 100 tokens: all-equal has probability ~1e-10
        assert len(set(actions)) > 1, f"the same token at every turn: {actions}"


def test_demonstration_noise_masking(tokenizer):
    def make_env():
        return MazeEnv(**MAZE)

    # noise=1: every action is random; masked out unless train_on_noise
    masked = demonstrate(make_env, tokenizer, 4, noise=1.0, rng=np.random.default_rng(0))
    assert masked.num_turns >= 1 and masked.num_generated == 0
    kept = demonstrate(
        make_env, tokenizer, 4, noise=1.0, rng=np.random.default_rng(0), train_on_noise=True
    )
    assert kept.token_ids == masked.token_ids
    assert kept.num_generated == 2 * kept.num_turns
