"""ArithmeticEnv: one step, reward 1 iff the written integer is the true result."""

from __future__ import annotations

import re

import numpy as np
import pytest

from gyre.envs.arithmetic import ArithmeticEnv

PATTERN = re.compile(r"^(\d+)([+\-*])(\d+)=$")


def _solve(obs: str) -> int:
    m = PATTERN.match(obs)
    assert m is not None, obs
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


@pytest.mark.parametrize("ops", ["+-", "*", "+-*"])
def test_correct_answer_rewarded(ops):
    env = ArithmeticEnv(max_operand=99, ops=ops)
    for seed in range(20):
        obs = env.reset(seed)
        m = PATTERN.match(obs)
        assert m is not None and m.group(2) in ops
        assert 0 <= int(m.group(1)) <= 99 and 0 <= int(m.group(3)) <= 99
        nxt, reward, done, info = env.step(str(_solve(obs)))
        assert reward == 1.0 and done is True and info["success"] is True
        assert nxt == ""


def test_wrong_answer_gets_zero():
    env = ArithmeticEnv()
    obs = env.reset(4)
    _, reward, done, info = env.step(str(_solve(obs) + 1))
    assert reward == 0.0 and done is True and info["success"] is False


@pytest.mark.parametrize("junk", ["abc", "", "1 2", "4.0"])
def test_non_integer_gets_zero(junk):
    env = ArithmeticEnv()
    env.reset(1)
    _, reward, done, _ = env.step(junk)
    assert reward == 0.0 and done is True


def test_whitespace_ignored_and_negative_answers():
    env = ArithmeticEnv(ops="-")
    # find a seed whose answer is negative
    for seed in range(100):
        obs = env.reset(seed)
        if _solve(obs) < 0:
            break
    else:
        raise AssertionError("no negative answer drawn")
    _, reward, _, _ = env.step(f"  {_solve(obs)}\n")
    assert reward == 1.0


def test_done_after_one_step():
    env = ArithmeticEnv()
    env.reset(0)
    env.step("0")
    with pytest.raises(RuntimeError):
        env.step("0")


def test_reset_reproducible_and_expert_correct():
    a, b = ArithmeticEnv(), ArithmeticEnv()
    rng = np.random.default_rng(0)
    assert [a.reset(s) for s in range(10)] == [b.reset(s) for s in range(10)]
    obs = a.reset(7)
    assert a.expert_action(rng) == str(_solve(obs))
    assert a.random_action(rng).lstrip("-").isdigit()


def test_bad_ops_rejected():
    with pytest.raises(ValueError):
        ArithmeticEnv(ops="+/")
