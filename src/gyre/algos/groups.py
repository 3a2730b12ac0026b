"""Group statistics and the GRPO group baseline, shared by the outcome estimators
(:mod:`gyre.algos.advantages`) and the turn-level ones (:mod:`gyre.algos.turns`)."""

from __future__ import annotations

import torch


def group_stats(
    rewards: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-trajectory (group mean, group unbiased std, group size), vectorised by scatter."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max().item()) + 1
    count = torch.zeros(G).scatter_add_(0, inv, torch.ones_like(rewards))
    mean = torch.zeros(G).scatter_add_(0, inv, rewards) / count
    dev = rewards - mean[inv]
    var = torch.zeros(G).scatter_add_(0, inv, dev**2) / (count - 1).clamp(min=1)
    return mean[inv], var.sqrt()[inv], count[inv]


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): A_i = (r_i - mean_G) / (std_G + eps).

    std is the unbiased sample std within the group (as verl and TRL use). A group whose rewards
    are all equal gets advantage 0 for every member. Each group's advantages sum to zero.
    """
    rewards = rewards.float().cpu()
    mean, std, _ = group_stats(rewards, group_ids.cpu())
    return (rewards - mean) / (std + eps)
