"""Advantage estimators: ``(rewards (N,), group_ids (N,)) -> advantages (N,)``.

To add one, write a function with that signature and add it to :data:`ADVANTAGES`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (r_i - mean_G) / (std_G + eps).

    std is the unbiased sample std within the group (as verl and TRL use). A group whose rewards
    are all equal gets advantage 0 for every member. Each group's advantages sum to zero.
    """
    rewards = rewards.float()
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max().item()) + 1
    count = torch.zeros(G).scatter_add_(0, inv, torch.ones_like(rewards))
    mean = torch.zeros(G).scatter_add_(0, inv, rewards) / count
    dev = rewards - mean[inv]
    var = torch.zeros(G).scatter_add_(0, inv, dev**2) / (count - 1).clamp(min=1)
    return dev / (var.sqrt()[inv] + eps)


AdvantageFn = Callable[..., torch.Tensor]
ADVANTAGES: dict[str, AdvantageFn] = {"grpo": grpo_advantages}


def get_advantage_fn(name: str) -> AdvantageFn:
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid: {', '.join(sorted(ADVANTAGES))}"
        ) from None
