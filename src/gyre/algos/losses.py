"""Per-token policy losses and KL estimators: elementwise over (B, T), looked up by name.

A policy loss is ``fn(logprobs, old_logprobs, advantages, loss_mask, params) -> (loss, clipped)``
with ``loss`` (B, T) per token *before* aggregation and ``clipped`` (B, T) bool (where a clip
was active, for the clipfrac metric). ``advantages`` broadcasts against (B, T): pass (B, 1) for
one advantage per sequence or (B, T) for per-token advantages. Masking and normalisation happen
in :mod:`gyre.algos.aggregate`, whose denominators are the whole optimizer step's.

To add a loss: write the function, add it to :data:`POLICY_LOSSES`. Formulas and papers:
docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gyre.algos.registry import lookup


@dataclass(frozen=True)
class LossParams:
    """Clip settings shared by the ratio-based losses.

    ``clip_eps_high`` None means symmetric (= ``clip_eps``); ``dual_clip`` None disables it.
    """

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip (Schulman et al. 2017, arXiv:1707.06347), per token.

    l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A), rho_t = exp(logp_t - old_t).
    ``clip_eps_high`` > ``clip_eps`` is DAPO's clip-higher (arXiv:2503.14476). ``dual_clip`` c
    (Ye et al. 2020, arXiv:1912.09729) bounds the loss of a negative advantage: for A < 0,
    l_t = min(l_t, -c A). Returns (loss (B, T), clipped (B, T) bool).
    """
    eps_high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    was_clipped = clipped < unclipped
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        was_clipped = was_clipped | dual
    return loss, was_clipped


def _ppo_clip(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: LossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    return ppo_clip_loss(
        logprobs, old_logprobs, advantages, params.clip_eps, params.clip_eps_high, params.dual_clip
    )


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: LossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071): one clipped ratio per sequence.

    s_i = exp(mean over the policy tokens of i of (logp - old)); per token the paper's
    GSPO-token form s_it = sg[s_i] * pi_t / sg[pi_t] (same value as s_i, gradient
    s_i * grad log pi_t), then l_t = -min(s_it A_t, clip(s_it, 1 - eps_low, 1 + eps_high) A_t).
    Aggregated with seq-mean-token-mean this is exactly the paper's sequence objective. The clip
    decision is the sequence's, so every token of a clipped sequence counts as clipped. Use
    eps around 3e-4 / 4e-4 (the paper's), not PPO's 0.2.
    """
    mask = loss_mask.to(logprobs.dtype)
    n = mask.sum(dim=1, keepdim=True).clamp(min=1)
    seq_log_ratio = ((logprobs - old_logprobs) * mask).sum(dim=1, keepdim=True) / n  # (B, 1)
    log_s = seq_log_ratio.detach() + logprobs - logprobs.detach()  # value s_i, grad per token
    s = torch.exp(log_s)
    unclipped = s * advantages
    clipped = torch.clamp(s, 1.0 - params.clip_eps, 1.0 + params.eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: LossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): l_t = -sg(clip(rho_t)) A_t log pi_t.

    The clip acts on the (detached) importance weight, never on the gradient, so clipped tokens
    still get a gradient. ``log pi_t`` is written as exp(logp - sg logp) (value 1, gradient
    grad log pi), so the loss value is -clip(rho) A, comparable to PPO's; the gradient is the
    paper's. Clip range [1 - clip_eps, 1 + clip_eps_high]; the paper effectively has no lower
    bound -- set ``clip_eps`` >= 1 for that.
    """
    ratio = torch.exp(logprobs - old_logprobs).detach()
    w = torch.clamp(ratio, 1.0 - params.clip_eps, 1.0 + params.eps_high)
    score = torch.exp(logprobs - logprobs.detach())
    loss = -w * advantages * score
    return loss, (w != ratio)


def reinforce_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    params: LossParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE (Williams 1992): l_t = -A_t log pi_t, no ratio and no clip.

    Written as -A exp(logp - sg logp): value -A, gradient -A grad log pi. Exact on-policy (one
    update per batch); with more updates it is a biased off-policy gradient (no correction).
    """
    score = torch.exp(logprobs - logprobs.detach())
    loss = -advantages * score
    return loss.expand_as(logprobs), torch.zeros_like(logprobs, dtype=torch.bool)


PolicyLossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossParams],
    tuple[torch.Tensor, torch.Tensor],
]
POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "ppo_clip": _ppo_clip,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
    "reinforce": reinforce_loss,
}


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    return lookup(POLICY_LOSSES, name, "policy loss")


# -- KL to a reference policy ------------------------------------------------------------------
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = d = logp - logp_ref: unbiased for KL(pi || ref) under samples of pi, can be < 0."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = d^2 / 2: low variance; as a loss its gradient is the unbiased KL gradient."""
    d = logprobs - ref_logprobs
    return 0.5 * d * d


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || pi_ref) (Schulman, "Approximating KL divergence", 2020).

    With d = logp - logp_ref: k3 = exp(-d) + d - 1 >= 0, clamped to [-10, 10] for stability.
    """
    d = logprobs - ref_logprobs
    return torch.clamp(torch.exp(-d) + d - 1.0, min=-10.0, max=10.0)


def kl_abs(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """abs = |logp - logp_ref| (verl's ``abs``)."""
    return (logprobs - ref_logprobs).abs()


KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def straight_through(estimator: KLFn) -> KLFn:
    """verl's ``X+`` estimators: ``X``'s value in the forward, k2's gradient in the backward.

    value = X.detach() + k2 - k2.detach(): the number logged and added to the loss is X's, the
    gradient is k2's, d(logp - ref) per token -- the unbiased gradient of KL(pi || ref).
    """

    def fn(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
        k2 = kl_k2(logprobs, ref_logprobs)
        return estimator(logprobs, ref_logprobs).detach() + k2 - k2.detach()

    fn.__name__ = f"{estimator.__name__}_plus"
    fn.__doc__ = f"{estimator.__name__}'s value with k2's gradient (see straight_through)."
    return fn


KL_ESTIMATORS: dict[str, KLFn] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "low_var_kl": kl_k3,  # verl's name for k3 clamped to [-10, 10]: the same function
    "abs": kl_abs,
    "k1+": straight_through(kl_k1),
    "k3+": straight_through(kl_k3),
    "low_var_kl+": straight_through(kl_k3),
    "abs+": straight_through(kl_abs),
}


def get_kl_fn(name: str) -> KLFn:
    return lookup(KL_ESTIMATORS, name, "KL estimator")


def masked_token_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of ``values`` over tokens where ``mask`` is 1 (divide by the step's token count)."""
    return (values * mask).sum()
