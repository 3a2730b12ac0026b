"""Pure tensor functions for policy-gradient post-training. No engines, runners or envs here.

Three axes kept apart: the advantage estimator (:mod:`.advantages`), the per-token policy loss
(:mod:`.losses`) and the loss aggregation (:mod:`.aggregate`); plus KL estimators
(:mod:`.losses`) and the rollout importance-sampling correction (:mod:`.correction`). The
policy update's loss is the sum of the named terms of :mod:`.terms`.
"""

from gyre.algos import advantages as _advantages
from gyre.algos.advantages import (
    ADVANTAGES,
    ESTIMATORS,
    AdvantageInputs,
    AdvantageSettings,
    Estimator,
    Whitening,
    compute_advantages,
    dr_grpo_advantages,
    gae_advantages,
    get_advantage_fn,
    get_estimator,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from gyre.algos.aggregate import LOSS_AGGREGATIONS, StepCounts, agg_weights, aggregate
from gyre.algos.correction import rollout_is_weights
from gyre.algos.losses import (
    KL_ESTIMATORS,
    POLICY_LOSSES,
    LossParams,
    cispo_loss,
    get_kl_fn,
    get_policy_loss_fn,
    gspo_loss,
    kl_abs,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_token_sum,
    ppo_clip_loss,
    reinforce_loss,
    straight_through,
)
from gyre.algos.terms import (
    clipped_value_loss,
    entropy_term,
    kl_term,
    policy_term,
    rollout_is_term,
    value_term,
)
from gyre.algos.turns import StepTerms, Turns, gigpo_advantages, turn_returns_advantages

__all__ = [
    "ADVANTAGES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "AdvantageSettings",
    "Estimator",
    "LossParams",
    "StepCounts",
    "StepTerms",
    "Turns",
    "Whitening",
    "agg_weights",
    "aggregate",
    "cispo_loss",
    "clipped_value_loss",
    "compute_advantages",
    "dr_grpo_advantages",
    "entropy_term",
    "gae_advantages",
    "get_advantage_fn",
    "get_estimator",
    "get_kl_fn",
    "get_policy_loss_fn",
    "gigpo_advantages",
    "grpo_advantages",
    "gspo_loss",
    "kl_abs",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_term",
    "masked_token_sum",
    "policy_term",
    "ppo_clip_loss",
    "reinforce_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_is_term",
    "rollout_is_weights",
    "straight_through",
    "turn_returns_advantages",
    "value_term",
]


def __getattr__(name: str) -> frozenset[str]:
    return _advantages.deprecated_name_set(name)  # TOKEN_LEVEL, ...: kept one version
