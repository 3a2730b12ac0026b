"""The sampling distribution, shared by the engine (to sample) and the trainer (to score).

Both sides call :func:`sampling_logprobs`, so the log-probabilities the trainer recomputes are
those of the distribution the engine actually sampled from: temperature-scaled, top-k and top-p
truncated, renormalised. Engines that report logprobs of the raw softmax while sampling from a
tempered one are a known source of train/inference mismatch.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def sampling_logprobs(
    logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0
) -> torch.Tensor:
    """Log-probs over the vocabulary (last dim) of the distribution sampled from.

    In vLLM's order: temperature, then top-k (``top_k > 0`` keeps the k largest logits, and
    any tied with the k-th), then top-p over what is left, then renormalise. ``temperature ==
    0`` (greedy) scores with the untempered softmax.
    """
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the top token is always kept).
        cum_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = cum_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V); returns (tokens (B,), logprobs (B,))."""
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    if temperature == 0:
        tokens = torch.argmax(logp, dim=-1)
    else:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def keyed_uniforms(seeds: np.ndarray, counters: np.ndarray) -> torch.Tensor:
    """One uniform in [0, 1) per row, a pure function of (seed, counter) (splitmix64).

    Counter-based randomness is what makes batched sampling reproducible row by row: the draw
    for token k of a request depends on nothing but its seed and k, not on the batch around it.
    """
    with np.errstate(over="ignore"):
        x = seeds.astype(np.uint64) * _GOLDEN + counters.astype(np.uint64) + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) / float(1 << 53))


CDF_BLOCK = 256
"""Vocabulary block of the two-level inverse CDF in :func:`sample_tokens_keyed`."""


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i's token under the unnormalised probabilities ``weights`` (B, V), at uniform u[i].

    Returns (tokens (B,), totals (B,) float64: each row's sum of weights). The token is the
    first whose cumulative weight exceeds ``u * total``, found in two levels: per-block sums
    (blocks of :data:`CDF_BLOCK` tokens, accumulated in float64) pick the block, a cumulative sum
    inside that one block picks the token. A full-vocabulary float64 cumsum costs ~100 ms a
    decode step at 128 rows x 49k tokens; this costs two passes over the float32 weights. A
    token of weight 0 is never drawn (rounding at a block edge falls back to the block's last
    token of positive weight).
    """
    B, V = weights.shape
    nb = -(-V // CDF_BLOCK)
    w = F.pad(weights, (0, nb * CDF_BLOCK - V)) if nb * CDF_BLOCK != V else weights
    blocks = w.view(B, nb, CDF_BLOCK)
    bsum = blocks.sum(-1).double()  # (B, nb); summing in float64 directly is ~50x slower
    bcdf = bsum.cumsum(-1)
    total = bcdf[:, -1:]
    target = u.to(torch.float64).view(B, 1) * total
    last_b = (bcdf < total).sum(-1, keepdim=True)  # the last block of positive weight
    b = torch.searchsorted(bcdf, target, right=True).minimum(last_b)  # (B, 1)
    rows = torch.arange(B, device=weights.device)
    inside = blocks[rows, b.squeeze(-1)].to(torch.float64).cumsum(-1)  # (B, CDF_BLOCK)
    rest = target - (bcdf.gather(-1, b) - bsum.gather(-1, b))
    last_j = (inside < inside[:, -1:]).sum(-1, keepdim=True)
    j = torch.searchsorted(inside, rest, right=True).minimum(last_j)
    return (b * CDF_BLOCK + j).squeeze(-1), total.squeeze(-1)


def sample_tokens_keyed(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    seeds: np.ndarray,
    counters: np.ndarray,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`sample_tokens`, but row i draws with :func:`keyed_uniforms` (inverse CDF).

    Returns (tokens (B,), logprobs (B,)) under the same distribution as ``sampling_logprobs``.
    The token is drawn by :func:`inverse_cdf` (two passes over the weights instead of a float64
    cumulative sum over the whole vocabulary); the returned log-probs are gathered from the full
    ``sampling_logprobs``, so they are bitwise those of :func:`sample_tokens` and of earlier
    releases (the golden runs pin them; the log-softmax is ~30 ms a step at 128 x 49k).
    """
    logp = sampling_logprobs(logits, temperature, top_p, top_k)
    if temperature == 0:
        tokens = torch.argmax(logp, dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    u = keyed_uniforms(seeds, counters).to(logp.device)
    if top_p < 1.0 or top_k > 0:
        tokens, _ = inverse_cdf(logp.exp(), u)
    else:
        x = logits.float()
        if temperature != 1.0:
            x = x / temperature
        tokens, _ = inverse_cdf((x - x.amax(dim=-1, keepdim=True)).exp_(), u)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
