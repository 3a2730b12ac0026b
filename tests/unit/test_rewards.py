"""The reward contract: import paths, sync and async functions, weighted totals, per-term
metrics, and errors that name the config field. Everything runs in process (no sandbox)."""

from __future__ import annotations

import json
import math

import pytest

import reward_fixtures as fx
from gyre.config import ConfigError, RewardConfig, load_config
from gyre.rewards import (
    RewardBatch,
    Rewarder,
    RewardError,
    batch_from_trajectories,
    build_rewarder,
    resolve_callable,
)
from gyre.types import Trajectory


def _cfg(*functions: dict, env_weight: float = 1.0) -> RewardConfig:
    return RewardConfig.model_validate({"functions": list(functions), "env_weight": env_weight})


def _batch(completions: list[str], env: list[float], **columns) -> RewardBatch:
    n = len(completions)
    cols = {"env_reward": env, "group_id": [i // 2 for i in range(n)], "info": [{}] * n, **columns}
    return RewardBatch([f"q{i}=" for i in range(n)], completions, cols)


def _traj(tokenizer, prompt: str, completion: str, reward: float, task: dict | None = None):
    p = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
    c = [*tokenizer.encode(completion, add_special_tokens=False), tokenizer.eos_token_id]
    info = {"success": reward > 0, **({"task": task} if task else {})}
    return Trajectory(
        token_ids=p + c,
        loss_mask=[0] * len(p) + [1] * len(c),
        rollout_logprobs=[0.0] * (len(p) + len(c)),
        reward=reward,
        group_id=0,
        policy_version=0,
        num_turns=1,
        success=reward > 0,
        task_seed=0,
        info=info,
    )


def test_no_functions_means_no_rewarder():
    assert build_rewarder(RewardConfig()) is None
    assert load_config().reward.functions == []  # the default run keeps the env's reward


def test_sync_function_gets_prompts_completions_columns_and_kwargs():
    fx.CALLS.clear()
    r = Rewarder(_cfg({"fn": "reward_fixtures:length", "kwargs": {"unit": "chars"}}))
    totals, values, _ = r.score_batch(_batch(["a", "bbb"], [1.0, 0.0], answer=["1", "2"]))
    assert values == {"env": [1.0, 0.0], "length": [1.0, 3.0]}
    assert totals == [2.0, 3.0]  # env (weight 1) + length (weight 1)
    call = fx.CALLS[-1]
    assert call["prompts"] == ["q0=", "q1="] and call["completions"] == ["a", "bbb"]
    assert call["answer"] == ["1", "2"] and call["env_reward"] == [1.0, 0.0]
    assert call["unit"] == "chars"


def test_async_function_is_awaited():
    r = Rewarder(_cfg({"fn": "reward_fixtures:async_double_env"}))
    _, values, _ = r.score_batch(_batch(["x", "y", "z"], [1.0, 0.0, 0.5]))
    assert values["async_double_env"] == [2.0, 0.0, 1.0]


def test_async_functions_of_a_step_run_concurrently():
    # ping waits for pong and pong for ping: awaited one after the other, both would time out.
    fx.reset_handshake()
    r = Rewarder(_cfg({"fn": "reward_fixtures:ping"}, {"fn": "reward_fixtures:pong"}))
    _, values, _ = r.score_batch(_batch(["x", "y"], [0.0, 0.0]))
    assert values["ping"] == values["pong"] == [1.0, 1.0]


def test_weighted_combination_and_per_term_metrics(tokenizer):
    cfg = _cfg(
        {"fn": "reward_fixtures:length", "weight": 0.5},
        {"fn": "reward_fixtures:constant", "name": "bonus", "weight": -2.0, "kwargs": {"value": 3}},
        {"fn": "reward_fixtures:as_tensor", "weight": 1.0},
        env_weight=10.0,
    )
    trajs = [_traj(tokenizer, "1+1=", "2", 1.0), _traj(tokenizer, "2+2=", "five", 0.0)]
    metrics = Rewarder(cfg).score(trajs, tokenizer, step=7)
    # hand values: env*10 + 0.5*len(completion) - 2*3 + index
    expected = [10 * 1.0 + 0.5 * 1 - 6 + 0, 10 * 0.0 + 0.5 * 4 - 6 + 1]
    assert [t.reward for t in trajs] == pytest.approx(expected)
    assert trajs[1].info["env_reward"] == 0.0
    assert trajs[1].info["rewards"] == {"env": 0.0, "length": 4.0, "bonus": 3.0, "as_tensor": 1.0}
    assert metrics["reward/env_mean"] == pytest.approx(0.5)
    assert metrics["reward/length_mean"] == pytest.approx(2.5)
    assert metrics["reward/bonus_mean"] == pytest.approx(3.0)
    assert metrics["reward/as_tensor_mean"] == pytest.approx(0.5)
    assert metrics["reward/total_mean"] == pytest.approx(sum(expected) / 2)
    assert metrics["reward/total_std"] == pytest.approx(abs(expected[0] - expected[1]) / 2)
    assert not any(k.startswith("reward/sandbox") for k in metrics)


def test_scoring_twice_does_not_compound_the_env_term(tokenizer):
    r = Rewarder(_cfg({"fn": "reward_fixtures:constant", "kwargs": {"value": 1}}))
    trajs = [_traj(tokenizer, "1+1=", "2", 1.0)]
    r.score(trajs, tokenizer)
    r.score(trajs, tokenizer)
    assert trajs[0].reward == 2.0 and trajs[0].info["env_reward"] == 1.0


def test_decoded_text_and_task_columns(tokenizer):
    fx.CALLS.clear()
    trajs = [
        _traj(tokenizer, "Q: 3+4?", " 7", 0.0, {"answer": "7", "level": 1}),
        _traj(tokenizer, "Q: 1+1?", " 2", 1.0, {"answer": "2"}),
    ]
    batch = batch_from_trajectories(trajs, tokenizer)
    assert batch.prompts == ["Q: 3+4?", "Q: 1+1?"]  # BOS / EOS are not text
    assert batch.completions == [" 7", " 2"]
    assert batch.columns["answer"] == ["7", "2"]
    assert batch.columns["level"] == [1, None]  # a row without the key gets None
    Rewarder(_cfg({"fn": "reward_fixtures:length"})).score(trajs, tokenizer)
    assert fx.CALLS[-1]["answer"] == ["7", "2"]


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("reward_fixtures:missing", "has no attribute 'missing'"),
        ("reward_fixtures:NOT_CALLABLE", "is a int, not a callable"),
    ],
)
def test_bad_import_path_names_the_field(path, needle):
    good = {"fn": "reward_fixtures:length"}
    with pytest.raises(RewardError) as err:
        build_rewarder(_cfg(good, {"fn": path}))
    assert str(err.value).startswith("reward.functions[1].fn:")
    assert needle in str(err.value)


def test_import_path_without_colon_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"reward\.functions\.0\.fn.: .reward_fixtures\.length.*module:function"
    ):
        load_config(overrides=["reward.functions=[{fn: reward_fixtures.length}]"])


def test_functions_from_a_dotted_override():
    cfg = load_config(overrides=["reward.functions=[{fn: 'reward_fixtures:length', weight: 2}]"])
    assert cfg.reward.functions[0].fn == "reward_fixtures:length"
    assert cfg.reward.functions[0].weight == 2.0


@pytest.mark.parametrize(
    ("fn", "needle"),
    [
        ("too_short", "returned 1 values for a batch of 2 samples"),
        ("not_numbers", "value 0 is 'high', not a number"),
        ("nan", "value 0 is nan, not finite"),
        ("scalar", "must return a list of 2 floats, got float"),
        ("raises", "raised RuntimeError('reward bug')"),
    ],
)
def test_wrong_return_or_exception_names_the_field(fn, needle):
    r = Rewarder(_cfg({"fn": f"reward_fixtures:{fn}"}))
    with pytest.raises(RewardError) as err:
        r.score_batch(_batch(["a", "b"], [0.0, 0.0]))
    assert "reward.functions[0].fn" in str(err.value)
    assert needle in str(err.value)


def test_async_exception_names_its_field():
    cfg = _cfg({"fn": "reward_fixtures:async_double_env"}, {"fn": "reward_fixtures:async_raises"})
    with pytest.raises(RewardError) as err:
        Rewarder(cfg).score_batch(_batch(["a"], [0.0]))
    assert str(err.value).startswith("reward.functions[1].fn (reward_fixtures:async_raises)")
    assert "KeyError('missing')" in str(err.value)


def test_duplicate_and_reserved_names_are_refused():
    with pytest.raises(RewardError, match=r"reward\.functions\[1\]\.name.*'length'"):
        Rewarder(_cfg({"fn": "reward_fixtures:length"}, {"fn": "reward_fixtures:length"}))
    with pytest.raises(RewardError, match="'env'"):
        Rewarder(_cfg({"fn": "reward_fixtures:length", "name": "env"}))
    with pytest.raises(RewardError, match=r"reward\.functions\[0\]\.kwargs"):
        Rewarder(_cfg({"fn": "reward_fixtures:length", "kwargs": {"completions": 1}}))


def test_resolve_callable_accepts_dotted_attributes():
    fn = resolve_callable("math:sqrt", "x")
    assert fn(4.0) == 2.0
    assert resolve_callable("os.path:join.__call__", "x")("a", "b") == "a/b"
    assert math.isfinite(resolve_callable("reward_fixtures:length", "x")([""], ["ab"])[0])


def test_arithmetic_env_exposes_its_answer_to_reward_functions():
    from gyre.envs import ArithmeticEnv

    env = ArithmeticEnv(9, "+")
    obs = env.reset(5)
    a, b = obs.rstrip("=").split("+")
    info = env.step("0")[3]
    assert info["task"] == {"answer": str(int(a) + int(b))}


@pytest.mark.parametrize(
    "fn", ["reward_fixtures:odd_groups_raise", "reward_fixtures:async_odd_groups_raise"]
)
def test_in_process_exception_fails_only_its_samples_and_is_counted(fn, tmp_path):
    # group_id is i // 2: samples 2, 3 (group 1) make the function raise, 0, 1 (group 0) do not.
    cfg = RewardConfig.model_validate(
        {
            "functions": [{"fn": fn, "name": "f"}],
            "env_weight": 0.0,
            "sandbox": {"failure_reward": -1.0, "max_failure_frac": 0.5},
        }
    )
    log = tmp_path / "failures.jsonl"
    r = Rewarder(cfg, log)
    totals, values, metrics = r.score_batch(_batch(["a", "b", "c", "d"], [0.0] * 4))
    assert values["f"] == [1.0, 1.0, -1.0, -1.0]
    assert totals == [1.0, 1.0, -1.0, -1.0]
    assert metrics["reward/failures"] == 2.0 and metrics["reward/failures_total"] == 2.0
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and "cannot score odd groups" in lines[0]
    # more than max_failure_frac of the batch failing stops the step, naming the field and key
    with pytest.raises(
        RewardError,
        match=r"reward.functions\[0\].fn .* 4/6 samples .*"
        r"reward.sandbox.max_failure_frac=0.5",
    ):
        r.score_batch(_batch(["a"] * 6, [0.0] * 6, group_id=[0, 0, 1, 1, 1, 1]))


def _tolerant(*functions: dict, frac: float, env_weight: float = 1.0) -> RewardConfig:
    return RewardConfig.model_validate(
        {
            "functions": list(functions),
            "env_weight": env_weight,
            "sandbox": {"max_failure_frac": frac, "failure_reward": -1.0, "network": "allow"},
        }
    )


def test_an_inf_value_fails_that_sample_and_names_function_and_row(tmp_path):
    r = Rewarder(_tolerant({"fn": "reward_fixtures:inf_on_second"}, frac=0.25), tmp_path / "f")
    totals, values, metrics = r.score_batch(_batch(["a", "b", "c", "d"], [0.0] * 4))
    assert values["inf_on_second"] == [1.0, -1.0, 1.0, 1.0] and totals == [1.0, -1.0, 1.0, 1.0]
    assert metrics["reward/failures"] == 1.0
    rec = json.loads((tmp_path / "f").read_text())
    assert rec["kind"] == "non_finite" and rec["sample"] == 1 and rec["term"] == "inf_on_second"
    with pytest.raises(RewardError) as err:  # 1 of 2 samples: 50% > 25%
        r.score_batch(_batch(["a", "b"], [0.0, 0.0]))
    msg = str(err.value)
    assert "reward.functions[0].fn (reward_fixtures:inf_on_second): value 1 is inf" in msg
    assert "1/2 samples" in msg and "max_failure_frac=0.25" in msg


def test_a_finite_reward_that_overflows_the_weighted_total_is_named_not_a_nan_loss():
    r = Rewarder(_cfg({"fn": "reward_fixtures:huge", "weight": 2}))
    with pytest.raises(RewardError) as err:
        r.score_batch(_batch(["a"], [0.0]))
    msg = str(err.value)
    assert "reward total is not finite for sample 0" in msg and "2 * huge(1.7e+308)" in msg
    tolerant = Rewarder(_tolerant({"fn": "reward_fixtures:huge", "weight": 2}, frac=1.0))
    totals, values, metrics = tolerant.score_batch(_batch(["a", "b"], [0.0, 0.0]))
    assert totals == [-1.0, -1.0] and values["huge"] == [1.7e308, 1.7e308]
    assert metrics["reward/failures"] == 2.0
    assert all(math.isfinite(v) for v in totals)


def test_a_nan_returned_inside_the_sandbox_is_a_failure():
    cfg = _tolerant({"fn": "reward_fixtures:nan", "sandbox": True}, frac=0.5)
    r = Rewarder(cfg)
    try:
        with pytest.raises(RewardError) as err:
            r.score_batch(_batch(["a", "b"], [0.0, 0.0]))
    finally:
        r.close()
    msg = str(err.value)
    assert "2/2 calls failed" in msg and "reward_fixtures:nan" in msg and "sample 0" in msg
    assert "[bad_output]" in msg and "non-finite" in msg
