"""Pure tensor functions for policy-gradient post-training. No engines, runners or envs here."""

from gyre.algos.advantages import ADVANTAGES, get_advantage_fn, grpo_advantages
from gyre.algos.losses import kl_k3, masked_token_sum, ppo_clip_loss

__all__ = [
    "ADVANTAGES",
    "get_advantage_fn",
    "grpo_advantages",
    "kl_k3",
    "masked_token_sum",
    "ppo_clip_loss",
]
