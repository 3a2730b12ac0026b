"""The sampling distribution, shared by the engine (to sample) and the trainer (to score).

Both sides call :func:`sampling_logprobs`, so the log-probabilities the trainer recomputes are
those of the distribution the engine actually sampled from: temperature-scaled and top-p
truncated, renormalised. Engines that report logprobs of the raw softmax while sampling from a
tempered one are a known source of train/inference mismatch.
"""

from __future__ import annotations

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
