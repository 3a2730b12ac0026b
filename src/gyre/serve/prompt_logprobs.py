"""``gyre serve``'s prompt log-probs, in vLLM's and SGLang's shapes.

- vLLM ``/v1/completions`` with ``prompt_logprobs: k``: each choice gets ``prompt_logprobs``, one
  entry per prompt token: ``None`` for the first, then ``{"<id>": {"logprob", "rank",
  "decoded_token"}}`` for the prompt token and the ``k`` most likely ones.
- SGLang ``/generate`` with ``return_logprob`` and ``logprob_start_len >= 0``: ``meta_info``
  gets ``input_token_logprobs`` (``[[logprob, id, None], ...]`` from ``logprob_start_len`` on,
  ``None`` as the first token's log-prob) and, with ``top_logprobs_num``,
  ``input_top_logprobs``.

The log-probs are the model's own (raw logits, no temperature or top-p), as both servers give
them. The trainer's sync check (:mod:`gyre.engines.verify`) reads them.
"""

from __future__ import annotations

from typing import Any

from gyre.engines.verify import PromptToken


def vllm_prompt_logprobs(
    tokenizer: Any, ids: list[int], table: list[PromptToken]
) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of one choice."""
    out: list[dict[str, Any] | None] = [None]
    for tok, row in zip(ids[1:], table, strict=True):
        entry = {str(tok): _vllm_entry(tokenizer, tok, row.logprob, row.rank)}
        for rank, (t, lp) in enumerate(row.top, start=1):
            entry.setdefault(str(t), _vllm_entry(tokenizer, t, lp, rank))
        out.append(entry)
    return out


def _vllm_entry(tokenizer: Any, tok: int, lp: float, rank: int) -> dict[str, Any]:
    return {"logprob": lp, "rank": rank, "decoded_token": tokenizer.decode([tok])}


def sglang_input_logprobs(
    ids: list[int], table: list[PromptToken], start: int, top: bool
) -> dict[str, Any]:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs``) from position ``start``."""
    lps: list[float | None] = [None, *(row.logprob for row in table)]
    tops: list[Any] = [None, *([[lp, t, None] for t, lp in row.top] for row in table)]
    meta: dict[str, Any] = {
        "input_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)][start:]
    }
    if top:
        meta["input_top_logprobs"] = tops[start:]
    return meta
