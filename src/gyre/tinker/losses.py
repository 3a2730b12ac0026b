"""The SDK's ``LossFnType`` values on gyre's loss terms, per datum, summed over tokens.

Every loss sees one datum: ``lp`` (T,) the current policy's log-probability of
``target_tokens`` at each position (or (T, K) for 2-D targets, cross-entropy only) and the
datum's ``loss_fn_inputs`` as float tensors. It returns the datum's loss, a *sum* over its
tokens (the SDK's convention: no mean, so gradients of several chunks or calls add up exactly),
and the per-token ``elementwise_loss`` reported back. ``q`` below is the sampler's ``logprobs``
input, ``A`` the ``advantages`` input, ``rho = exp(lp - q)``.

- ``cross_entropy``: ``-w * lp`` (``weights`` w, default 1; 2-D targets: summed over K).
- ``importance_sampling``: ``-rho * A`` (gyre's ``ppo_clip`` with no clip).
- ``ppo``: ``-min(rho A, clip(rho, lo, hi) A)`` (gyre's ``ppo_clip``).
- ``cispo``: ``-sg(clip(rho, lo, hi)) * A * lp`` (gyre's ``cispo``: same gradient; the value
  reported is Tinker's, with the ``lp`` factor).
- ``gspo``: ``-min(s A, clip(s, lo, hi) A)``, s the sequence ratio in GSPO-token form (gyre's
  ``gspo``).
- ``dro``: ``-(lp A) + beta * (lp - q)^2 / 2`` (gyre's k2 KL estimator as the penalty).

``loss_fn_config``: ``clip_low_threshold`` / ``clip_high_threshold`` (ratio bounds lo, hi;
ppo and cispo default 0.8 / 1.2, gspo 1 - 3e-4 / 1 + 4e-4 as in the GSPO paper) and ``beta``
(dro, default 0.05). GSPO's sequence ratio averages the log-ratio over the tokens that
``sequence_ratio_mask`` marks, else ``weights``, else the tokens with a nonzero advantage.
``weights``, when given to an RL loss other than gspo, multiplies each token's loss.

``stable_reinforce`` needs per-sequence "stability info" that Tinker's own sampler records;
its formula is not published, so it is refused with that reason. ``custom`` runs a loss graph
uploaded with ``create_custom_loss`` (:mod:`gyre.tinker.custom_loss`), named by
``loss_fn_config.loss_id``; the service resolves it, so it never reaches ``get_loss``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gyre.algos.losses import LossParams, cispo_loss, gspo_loss, kl_k2, ppo_clip_loss
from gyre.tinker.errors import Unsupported, UserError

Inputs = dict[str, torch.Tensor]
LossFn = Callable[[torch.Tensor, Inputs, dict], tuple[torch.Tensor, torch.Tensor]]


def _need(inputs: Inputs, name: str, shape: torch.Size) -> torch.Tensor:
    if name not in inputs:
        raise UserError(f"loss_fn_inputs.{name} is required by this loss")
    t = inputs[name]
    if t.shape != shape:
        raise UserError(f"loss_fn_inputs.{name} has shape {list(t.shape)}, need {list(shape)}")
    return t


def _cfg(config: dict, key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, str):
        raise UserError(f"loss_fn_config.{key} must be a number, got {value!r}")
    return float(value)


def _bounds(config: dict, lo: float, hi: float) -> LossParams:
    low = _cfg(config, "clip_low_threshold", lo)
    high = _cfg(config, "clip_high_threshold", hi)
    if not 0.0 <= low <= 1.0 <= high:
        raise UserError(
            f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
            f"got {low} and {high}"
        )
    return LossParams(clip_eps=1.0 - low, clip_eps_high=high - 1.0)


def _weighted(per_token: torch.Tensor, inputs: Inputs) -> torch.Tensor:
    w = inputs.get("weights")
    return per_token if w is None else per_token * _need(inputs, "weights", per_token.shape)


def cross_entropy(lp: torch.Tensor, inputs: Inputs, config: dict):
    w = inputs.get("weights")
    w = torch.ones_like(lp) if w is None else _need(inputs, "weights", lp.shape)
    per_token = -w * lp
    return per_token.sum(), per_token


def importance_sampling(lp: torch.Tensor, inputs: Inputs, config: dict):
    q, adv = _need(inputs, "logprobs", lp.shape), _need(inputs, "advantages", lp.shape)
    per_token, _ = ppo_clip_loss(lp, q, adv, clip_eps=float("inf"))  # no clip: -rho A
    per_token = _weighted(per_token, inputs)
    return per_token.sum(), per_token


def ppo(lp: torch.Tensor, inputs: Inputs, config: dict):
    q, adv = _need(inputs, "logprobs", lp.shape), _need(inputs, "advantages", lp.shape)
    p = _bounds(config, 0.8, 1.2)
    per_token, _ = ppo_clip_loss(lp, q, adv, p.clip_eps, p.clip_eps_high)
    per_token = _weighted(per_token, inputs)
    return per_token.sum(), per_token


def cispo(lp: torch.Tensor, inputs: Inputs, config: dict):
    q, adv = _need(inputs, "logprobs", lp.shape), _need(inputs, "advantages", lp.shape)
    # gyre's cispo term has the value -w A and the gradient -w A grad(lp); Tinker reports the
    # value -w A lp. Only the value is moved (a detached offset), the gradient stays gyre's.
    term, _ = cispo_loss(
        lp[None], q[None], adv[None], torch.ones_like(lp[None]), _bounds(config, 0.8, 1.2)
    )
    value_fix = term[0].detach() * lp.detach() - term[0].detach()
    per_token = _weighted(term[0] + value_fix, inputs)
    return per_token.sum(), per_token


def gspo(lp: torch.Tensor, inputs: Inputs, config: dict):
    q, adv = _need(inputs, "logprobs", lp.shape), _need(inputs, "advantages", lp.shape)
    if "sequence_ratio_mask" in inputs:
        mask = _need(inputs, "sequence_ratio_mask", lp.shape)
    elif "weights" in inputs:
        mask = _need(inputs, "weights", lp.shape)
    else:
        mask = (adv != 0).to(lp.dtype)
    mask = (mask != 0).to(lp.dtype)
    params = _bounds(config, 1.0 - 3e-4, 1.0 + 4e-4)
    term, _ = gspo_loss(lp[None], q[None], adv[None], mask[None], params)
    return term[0].sum(), term[0]


def dro(lp: torch.Tensor, inputs: Inputs, config: dict):
    q, adv = _need(inputs, "logprobs", lp.shape), _need(inputs, "advantages", lp.shape)
    beta = _cfg(config, "beta", 0.05)
    per_token = _weighted(-(lp * adv) + beta * kl_k2(lp, q), inputs)
    return per_token.sum(), per_token


def _refuse(reason: str, error: type[UserError] = Unsupported) -> LossFn:
    def fn(lp: torch.Tensor, inputs: Inputs, config: dict):
        raise error(reason)

    return fn


LOSSES: dict[str, LossFn] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "gspo": gspo,
    "dro": dro,
    "stable_reinforce": _refuse(
        "loss_fn 'stable_reinforce' is not supported: it needs the per-sequence stability info "
        "recorded by Tinker's own sampler, whose formula is not published"
    ),
    "custom": _refuse(
        "loss_fn 'custom' needs loss_fn_config.loss_id, the id create_custom_loss returned",
        UserError,
    ),
}


def get_loss(name: str) -> LossFn:
    if name not in LOSSES:
        raise UserError(f"loss_fn {name!r} is unknown; valid: {', '.join(LOSSES)}")
    return LOSSES[name]
