"""LR schedules on hand steps; the SFT default is the factor SFT always used."""

from __future__ import annotations

import math

import pytest
import torch

from gyre.trainer.schedule import build_scheduler, lr_factor


def test_linear_and_cosine_on_hand_steps():
    # warmup 2 of 6 steps: 1/2, 1; then p = (s - 2) / 4 = 0, 1/4, 1/2, 3/4
    lin = [lr_factor(s, 2, 6, "linear") for s in range(6)]
    assert lin == pytest.approx([0.5, 1.0, 1.0, 0.75, 0.5, 0.25])
    cos = [lr_factor(s, 2, 6, "cosine") for s in range(6)]
    c = 0.5 * (1 + math.cos(math.pi / 4))  # 0.853553
    assert cos == pytest.approx([0.5, 1.0, 1.0, c, 0.5, 1 - c])
    # min_lr_ratio 0.1: 0.1 + 0.9 * (1 - p)
    assert lr_factor(4, 2, 6, "linear", 0.1) == pytest.approx(0.55)
    assert lr_factor(9, 2, 6, "cosine", 0.1) == pytest.approx(0.1)  # past the end: the floor
    assert [lr_factor(s, 3, 9, "constant") for s in range(5)] == pytest.approx(
        [1 / 3, 2 / 3, 1, 1, 1]
    )
    with pytest.raises(ValueError, match="LR schedule"):
        lr_factor(0, 0, 1, "step")


@pytest.mark.parametrize("warmup", [0, 1, 4, 10])
def test_constant_is_the_old_sft_factor_bit_for_bit(warmup):
    old = [min(1.0, (s + 1) / max(1, warmup)) for s in range(30)]
    assert [lr_factor(s, warmup, 30, "constant") for s in range(30)] == old


def test_scheduler_state_round_trips():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=1.0)
    sched = build_scheduler(opt, 1, 5, "linear")
    for _ in range(3):
        opt.step()
        sched.step()
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched2 = build_scheduler(opt2, 1, 5, "linear")
    # as a checkpoint restores them: the optimizer (whose param groups hold the current LR),
    # then the scheduler (its step count)
    opt2.load_state_dict(opt.state_dict())
    sched2.load_state_dict(sched.state_dict())
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.5)
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == pytest.approx(0.25)
