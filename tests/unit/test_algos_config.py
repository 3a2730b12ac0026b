"""``train.algo`` / ``train.dapo`` config: defaults map to the original GRPO update, every
registry name is accepted, bad names stop with an error naming the key."""

from __future__ import annotations

import typing

import pytest

from gyre.algos import ADVANTAGES, LOSS_AGGREGATIONS, POLICY_LOSSES, LossParams
from gyre.config import AlgoConfig, ConfigError, TrainConfig, load_config
from gyre.trainer.loss import loss_params
from gyre.trainer.update import resolve_old_logprobs


def test_defaults_are_the_maze_defaults_update():
    """The PPO-clip GRPO update, with the embedded maze default's sampling temperature (0.6)
    and zero-advantage rows left out of the forward/backward (docs/results/maze.md)."""
    t = load_config().train
    a = t.algo
    got = {
        "clip_eps": t.clip_eps, "kl_coef": t.kl_coef, "mini_batches": t.mini_batches,
        "micro_batch_size": t.micro_batch_size, "max_grad_norm": t.max_grad_norm,
        "temperature": t.sampling.temperature, "top_p": t.sampling.top_p,
        "loss_agg": t.loss_agg, "policy_loss": a.policy_loss, "kl_type": a.kl_type,
        "kl_in": a.kl_in, "entropy_coef": a.entropy_coef, "ppo_epochs": a.ppo_epochs,
        "mini_batch_size": a.mini_batch_size, "loss_norm_len": a.loss_norm_len,
        "old_logprobs": a.old_logprobs, "skip_zero_advantage": a.skip_zero_advantage,
        "rollout_is": a.rollout_is, "rollout_is_level": a.rollout_is_level,
        "rollout_is_threshold": a.rollout_is_threshold,
        "rollout_is_threshold_lower": a.rollout_is_threshold_lower,
        "vf_coef": a.vf_coef, "value_clip": a.value_clip,
    }  # fmt: skip
    assert got == {
        "clip_eps": 0.2, "kl_coef": 0.0, "mini_batches": 4, "micro_batch_size": 64,
        "max_grad_norm": 1.0, "temperature": 0.6, "top_p": 1.0,
        "loss_agg": "seq-mean-token-mean", "policy_loss": "ppo_clip", "kl_type": "k3",
        "kl_in": "loss", "entropy_coef": 0.0, "ppo_epochs": 1, "mini_batch_size": 0,
        "loss_norm_len": 0, "old_logprobs": "auto", "skip_zero_advantage": True,
        "rollout_is": "none", "rollout_is_level": "token", "rollout_is_threshold": 2.0,
        "rollout_is_threshold_lower": 0.0, "vf_coef": 0.5, "value_clip": 0.2,
    }  # fmt: skip
    # PPO-clip 0.2 symmetric, no dual clip; 4 mini-batches -> the trainer recomputes old logprobs
    assert loss_params(t) == LossParams(0.2, None, None)
    assert resolve_old_logprobs(t, 128) == "recompute"
    cfg = load_config()
    assert cfg.train.algo.advantage == "gigpo" and cfg.train.algo.discount == 0.95
    assert not cfg.train.dapo.dynamic_sampling


def test_config_literals_match_registries():
    hints = typing.get_type_hints(AlgoConfig)
    assert set(typing.get_args(hints["advantage"])) == set(ADVANTAGES)
    assert set(typing.get_args(hints["policy_loss"])) == set(POLICY_LOSSES)
    assert set(typing.get_args(typing.get_type_hints(TrainConfig)["loss_agg"])) == set(
        LOSS_AGGREGATIONS
    )


def test_overrides_reach_the_update_config():
    cfg = load_config(
        None,
        [
            "train.algo.advantage=gae",
            "train.algo.policy_loss=gspo",
            "train.algo.clip_eps_high=0.28",
            "train.algo.dual_clip=3",
            "train.algo.kl_type=k2",
            "train.algo.kl_in=reward",
            "train.algo.ppo_epochs=2",
            "train.algo.mini_batch_size=16",
            "train.algo.rollout_is=mask",
            "train.loss_agg=seq-mean-token-sum-norm",
            "train.dapo.dynamic_sampling=true",
        ],
    )
    a = cfg.train.algo
    assert (a.policy_loss, a.clip_eps_high, a.dual_clip, a.kl_type, a.kl_in) == (
        "gspo", 0.28, 3.0, "k2", "reward",
    )  # fmt: skip
    assert loss_params(cfg.train) == LossParams(0.2, 0.28, 3.0)
    assert (a.ppo_epochs, a.mini_batch_size, a.rollout_is) == (2, 16, "mask")
    assert cfg.train.loss_agg == "seq-mean-token-sum-norm" and cfg.train.dapo.dynamic_sampling


@pytest.mark.parametrize(
    ("item", "key"),
    [
        ("train.algo.advantage=ppo", "train.algo.advantage"),
        ("train.algo.policy_loss=sppo", "train.algo.policy_loss"),
        ("train.loss_agg=token-sum", "train.loss_agg"),
        ("train.algo.dual_clip=0.5", "train.algo.dual_clip"),
        ("train.algo.rollout_is_threshold=0.5", "train.algo.rollout_is_threshold"),
        ("train.dapo.max_rounds=0", "train.dapo.max_rounds"),
        ("train.algo.kl_type=k4", "train.algo.kl_type"),
    ],
)
def test_bad_values_name_the_key(item, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [item])
