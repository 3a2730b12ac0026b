"""``sft.successful_only``: filtered behaviour cloning keeps only the demonstrations that
succeed, going on along the SFT task stream until ``sft.demos`` of them."""

from __future__ import annotations

import pytest

from gyre.config import load_config
from gyre.models.build import build_char_tokenizer
from gyre.sft import MAX_TRIES_PER_DEMO, _demos, demonstrations
from gyre.types import Trajectory


def _traj(k: int, success: bool) -> Trajectory:
    return Trajectory(
        token_ids=[1], loss_mask=[0], rollout_logprobs=[0.0], reward=float(success),
        group_id=0, policy_version=-1, num_turns=1, success=success, task_seed=k,
    )  # fmt: skip


def test_only_successes_are_kept_in_stream_order():
    played: list[int] = []

    def play(k: int) -> Trajectory:
        played.append(k)
        return _traj(k, k % 3 == 0)

    kept = _demos(play, 4, successful_only=True)
    assert [t.task_seed for t in kept] == [0, 3, 6, 9]
    assert played == list(range(10))  # stops at the 4th success
    assert [t.task_seed for t in _demos(play, 4, successful_only=False)] == [0, 1, 2, 3]


def test_too_few_successes_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"sft.successful_only: 1 of 60 .*sft.demos=3"):
        _demos(lambda k: _traj(k, k == 5), 3, successful_only=True)
    assert MAX_TRIES_PER_DEMO == 20


def test_maze_demonstrations_are_all_successes_and_cached_apart(tmp_path):
    tok = build_char_tokenizer()
    base = ["sft.demos=40", "sft.noise=0.25", f"run.dir={tmp_path}"]
    every = demonstrations(load_config(None, base), tmp_path, tok)
    good = demonstrations(load_config(None, [*base, "sft.successful_only=true"]), tmp_path, tok)
    assert len(every) == len(good) == 40
    assert not all(t.success for t in every)  # the greedy teacher with noise fails some
    assert all(t.success for t in good)
    # the successes of the unfiltered stream are the filtered stream's first ones, in order
    firsts = [t.token_ids for t in every if t.success]
    assert [t.token_ids for t in good[: len(firsts)]] == firsts


def test_a_stop_signal_ends_the_demonstrations_and_caches_nothing(tmp_path):
    """SIGTERM / SIGINT while the SFT demonstrations are played (minutes on image envs) stops
    at the next one: nothing is cached, and a later call plays them all."""
    from gyre.sft import DemosStopped

    tok = build_char_tokenizer()
    cfg = load_config(None, ["sft.demos=30", f"run.dir={tmp_path}"])
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 5

    with pytest.raises(DemosStopped, match="after 5 of the SFT demonstrations"):
        demonstrations(cfg, tmp_path, tok, stop)
    assert not (tmp_path / "sft_demos.pt").exists()
    assert len(demonstrations(cfg, tmp_path, tok, lambda: False)) == 30
    with pytest.raises(DemosStopped):
        _demos(lambda k: _traj(k, True), 4, successful_only=True, stop=lambda: True)


def test_run_sft_stopped_while_playing_demonstrations_is_a_preemption(tmp_path):
    """The warm start turns that stop into Preempted (the CLI's exit code 75) before any SFT
    step, naming no checkpoint; run.resume=auto then starts over."""
    from gyre import loop
    from gyre.checkpoint.resume import Preempted, StopGuard
    from gyre.sft import run_sft

    cfg = load_config(None, ["sft.demos=30", "sft.steps=2", f"run.dir={tmp_path}"])
    run_dir, device = loop.setup(cfg)
    guard = StopGuard()
    guard.signame = "SIGTERM"  # as its handler sets it
    with pytest.raises(Preempted, match=r"during sft demonstrations .* checkpoint none yet"):
        run_sft(cfg, run_dir, device, loop.base_model_path(cfg, run_dir), guard=guard)
    assert not (run_dir / "sft").exists() and not (run_dir / "sft_demos.pt").exists()
