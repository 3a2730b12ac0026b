"""The in-process engine's sampler: request seeds, and each decode step's keyed draw.

Sampling is counter-based (:func:`gyre.models.sampling.sample_tokens_keyed`): token k of a
request is drawn from a uniform keyed by (request seed, k), so a request's tokens do not depend
on the batch it shares, on the order of requests, or on any scheduling or forward switch.
"""

from __future__ import annotations

import numpy as np
import torch

from gyre.engines.kv_batch import Row
from gyre.models.sampling import sample_tokens_keyed, sampling_logprobs
from gyre.types import GenerationRequest, SamplingParams


class KeyedSampler:
    """Draws the next token of decoding rows; the only random stream is the one that seeds
    requests without a seed of their own (a run checkpoints it for exact resume)."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def reseed(self, seed: int) -> None:
        self.generator.manual_seed(seed)

    def request_seed(self, req: GenerationRequest) -> int:
        """The request's own seed, or the next one drawn from the stream."""
        if req.seed is not None:
            return req.seed
        return int(torch.randint(0, 2**62, (1,), generator=self.generator))

    def sample(
        self, rows: list[Row], logits: torch.Tensor, params: SamplingParams, stop: set[int]
    ) -> None:
        """Append one token (and its logprob) to each of ``rows`` from its ``logits`` (R, V),
        marking the rows that stop or reach ``params.max_new_tokens`` done. A row's own
        ``temperature`` replaces the batch's."""
        temps = [params.temperature if r.temperature is None else r.temperature for r in rows]
        k = params.top_logprobs
        tokens: list[int] = [0] * len(rows)
        logps: list[float] = [0.0] * len(rows)
        top_v: list[list[float]] = [[] for _ in rows]
        top_i: list[list[int]] = [[] for _ in rows]
        for temp in sorted(set(temps)):  # one draw per temperature (requests may set their own)
            at = [j for j, t in enumerate(temps) if t == temp]
            sub = logits if len(at) == len(rows) else logits[at]
            seeds = np.array([rows[j].seed for j in at], dtype=np.uint64)
            counters = np.array([len(rows[j].out_ids) for j in at], dtype=np.uint64)
            tok, lp = sample_tokens_keyed(sub, temp, params.top_p, seeds, counters, params.top_k)
            for j, t, v in zip(at, tok.tolist(), lp.tolist(), strict=True):
                tokens[j], logps[j] = t, v
            if k > 0:
                # The k most likely tokens under the distribution sampled from (after
                # temperature, top-k and top-p), as OpenAI's ``logprobs``/``top_logprobs``
                # report them.
                top = sampling_logprobs(sub, temp, params.top_p, params.top_k).topk(k, dim=-1)
                for j, v, ix in zip(at, top.values.tolist(), top.indices.tolist(), strict=True):
                    top_v[j], top_i[j] = v, ix
        for j, (row, tok, lp) in enumerate(zip(rows, tokens, logps, strict=True)):
            row.out_ids.append(tok)
            row.out_lp.append(lp)
            if k > 0:
                row.out_top.append(dict(zip(top_i[j], top_v[j], strict=True)))
            if tok in stop:
                row.done, row.reason = True, "stop"
            elif len(row.out_ids) >= params.max_new_tokens:
                row.done = True
