"""``train.algo`` / ``train.dapo`` config: defaults map to the original GRPO update, every
registry name is accepted, bad names stop with an error naming the key."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from gyre.algos import ADVANTAGES, LOSS_AGGREGATIONS, POLICY_LOSSES
from gyre.config import AlgoConfig, ConfigError, TrainConfig, load_config
from gyre.trainer.update import GRPOSettings, settings_from_config


def test_defaults_are_the_original_grpo_update():
    cfg = load_config()
    s = settings_from_config(cfg.train, cfg.perf)
    legacy = GRPOSettings(
        clip_eps=0.2, kl_coef=0.0, mini_batches=4, micro_batch_size=64,
        loss_agg="seq-mean-token-mean", old_logprobs="auto",
    )  # fmt: skip
    assert dataclasses.asdict(s) == dataclasses.asdict(legacy)
    assert s.policy_loss == "ppo_clip" and s.clip_eps_high is None and s.dual_clip is None
    assert cfg.train.algo.advantage == "grpo" and not cfg.train.dapo.dynamic_sampling


def test_config_literals_match_registries():
    hints = typing.get_type_hints(AlgoConfig)
    assert set(typing.get_args(hints["advantage"])) == set(ADVANTAGES)
    assert set(typing.get_args(hints["policy_loss"])) == set(POLICY_LOSSES)
    assert set(typing.get_args(typing.get_type_hints(TrainConfig)["loss_agg"])) == set(
        LOSS_AGGREGATIONS
    )


def test_overrides_reach_the_settings():
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
    s = settings_from_config(cfg.train, cfg.perf)
    assert (s.policy_loss, s.clip_eps_high, s.dual_clip, s.kl_type, s.kl_in) == (
        "gspo", 0.28, 3.0, "k2", "reward",
    )  # fmt: skip
    assert (s.ppo_epochs, s.mini_batch_size, s.rollout_is) == (2, 16, "mask")
    assert s.loss_agg == "seq-mean-token-sum-norm" and cfg.train.dapo.dynamic_sampling


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
