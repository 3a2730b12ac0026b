"""Resilience pieces on their own: the task cursor and its epochs, metrics rewind/repair, the
signal guard, non-finite steps in the trainer and failing envs in the rollout."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest
import torch

from gyre.checkpoint.resume import StopGuard, TaskCursor, durable_size, rewind_metrics
from gyre.checkpoint.store import CheckpointError


def _cursor(size, seed=0):
    return TaskCursor(size, np.random.default_rng(seed))


def test_cursor_matches_the_legacy_sft_order():
    """Same order as the loop's original lazy re-permutation (so default runs are unchanged)."""
    order = np.random.default_rng(7)
    perm, pos, legacy = order.permutation(5), 0, []
    for _ in range(17):
        if pos == 5:
            perm, pos = order.permutation(5), 0
        legacy.append(int(perm[pos]))
        pos += 1
    assert _cursor(5, 7).take(17) == legacy


def test_every_item_once_per_epoch():
    c = _cursor(6)
    items = c.take(18)
    for e in range(3):
        assert sorted(items[6 * e : 6 * e + 6]) == list(range(6))
    assert items[:6] != items[6:12]  # a new order each epoch
    assert (c.epoch, c.pos, c.consumed) == (2, 6, 18)


@pytest.mark.parametrize("cut", [0, 3, 6, 7, 12, 13])
def test_resume_anywhere_incl_epoch_boundary(cut):
    """verl #7401: resuming exactly at an epoch boundary neither skips nor repeats an epoch."""
    straight = _cursor(6, 3).take(20)
    a = _cursor(6, 3)
    first = a.take(cut)
    state = json.loads(json.dumps(a.state_dict()))  # it goes through state.json
    b = _cursor(6, 99)  # whatever generator it starts with: the state wins
    b.load_state_dict(state)
    assert first + b.take(20 - cut) == straight
    assert b.consumed == 20


def test_endless_stream_and_size_mismatch():
    c = TaskCursor(None)
    assert c.take(3) == [0, 1, 2]
    d = TaskCursor(None)
    d.load_state_dict(c.state_dict())
    assert d.take(2) == [3, 4] and d.epoch == 0
    with pytest.raises(CheckpointError, match="data size changed"):
        _cursor(5).load_state_dict(_cursor(6).state_dict())
    with pytest.raises(ValueError):
        TaskCursor(0)


def test_rewind_metrics_truncates_and_repairs(tmp_path, caplog):
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 1}\n{"step": 2}\n')
    offset = durable_size(p)
    with open(p, "a") as f:
        f.write('{"step": 3}\n{"step": 4, "x": 1')
    rewind_metrics(p, offset)
    assert p.read_text() == '{"step": 1}\n{"step": 2}\n'
    # a torn tail before the offset (the file lost data, e.g. copied) is still repaired
    p.write_text('{"step": 1}\n{"ste')
    rewind_metrics(p, 10_000)
    assert p.read_text() == '{"step": 1}\n'
    assert "torn" in caplog.text
    rewind_metrics(tmp_path / "absent.jsonl", 5)  # no file: nothing to do


def test_stop_guard_flags_and_restores():
    before = signal.getsignal(signal.SIGTERM)
    with StopGuard() as guard:
        assert not guard.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert guard.requested and guard.signame == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_nonfinite_update_is_skipped(make_tiny_model):
    from gyre.trainer.batch import collate
    from gyre.trainer.sft import sft_step
    from gyre.trainer.update import policy_update
    from gyre.types import Trajectory
    from helpers import train_cfg

    model = make_tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    trajs = [
        Trajectory([1, 5, 6, 7], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0], r, 0, 0, 1, False, 0, {})
        for r in (0.0, 1.0)
    ]
    batch = collate(trajs, 0, torch.device("cpu"))
    cfg = train_cfg(mini_batches=1, loss_agg="token-mean", old_logprobs="rollout")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    m = policy_update(model, opt, batch, torch.tensor([float("nan"), 1.0]), cfg)
    assert m["train/nonfinite_skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not opt.state  # AdamW moments untouched
    m = policy_update(model, opt, batch, torch.tensor([-1.0, 1.0]), cfg)
    assert m["train/nonfinite_skipped"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    assert sft_step(model, opt, batch, 8)["sft/nonfinite_skipped"] == 1.0


class _Boom:
    def __init__(self, where):
        self.where = where

    def reset(self, seed):
        if self.where == "reset":
            raise ValueError("bad row")
        return "q?"

    def step(self, action):
        if self.where == "step":
            raise RuntimeError("verifier crashed")
        return "", 1.0, True, {"success": True}


@pytest.mark.parametrize("where", ["reset", "step", "none"])
def test_env_exception_marks_episode_failed(where, make_tiny_model, tokenizer, caplog):
    from gyre.engines import TorchEngine
    from gyre.rollout.episodes import RolloutStats, run_episodes, stop_ids
    from gyre.types import SamplingParams

    engine = TorchEngine(make_tiny_model(seed=0), tokenizer.pad_token_id)
    made = iter([_Boom(where), _Boom("none"), _Boom("none"), _Boom("none")])
    stats = RolloutStats()
    params = SamplingParams(1.0, 1.0, 3, stop_ids(tokenizer), seed=0)
    trajs = run_episodes(lambda: next(made), engine, tokenizer, [1, 2], 2, params, stats)
    assert len(trajs) == 4
    ok = trajs[1:]
    assert all(t.reward == 1.0 and not t.info.get("failed") for t in ok)
    if where == "none":
        assert stats.failed_episodes == 0 and trajs[0].reward == 1.0
        return
    bad = trajs[0]
    assert stats.failed_episodes == 1
    assert bad.info["failed"] and bad.reward == 0.0 and sum(bad.loss_mask) == 0
    assert ("bad row" if where == "reset" else "verifier crashed") in bad.info["error"]
    assert "Traceback" in caplog.text and f"env {where} raised in episode 0" in caplog.text
