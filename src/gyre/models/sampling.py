"""The sampling distribution, shared by the engine (to sample) and the trainer (to score).

Both sides call :func:`sampling_logprobs`, so the log-probabilities the trainer recomputes are
those of the distribution the engine actually sampled from: temperature-scaled and top-p
truncated, renormalised. Engines that report logprobs of the raw softmax while sampling from a
tempered one are a known source of train/inference mismatch.
"""

from __future__ import annotations

import numpy as np
import torch


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Log-probs over the vocabulary (last dim) of the distribution sampled from.

    ``temperature == 0`` (greedy) scores with the untempered softmax.
    """
    logits = logits.float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
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
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V); returns (tokens (B,), logprobs (B,))."""
    logp = sampling_logprobs(logits, temperature, top_p)
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


def sample_tokens_keyed(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    seeds: np.ndarray,
    counters: np.ndarray,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`sample_tokens`, but row i draws with :func:`keyed_uniforms` (inverse CDF).

    Returns (tokens (B,), logprobs (B,)) under the same distribution as ``sampling_logprobs``.
    """
    logp = sampling_logprobs(logits, temperature, top_p)
    if temperature == 0:
        tokens = torch.argmax(logp, dim=-1)
    else:
        cdf = torch.cumsum(logp.double().exp(), dim=-1)
        u = keyed_uniforms(seeds, counters).to(cdf.device).unsqueeze(-1) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=logp.shape[-1] - 1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
