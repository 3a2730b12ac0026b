"""What a sampling request may ask about its prompt, all from one forward pass over it.

- ``prompt_logprobs`` / ``topk_prompt_logprobs`` (with ``prompt_logprobs_last_n``): each prompt
  token's log-probability, and the k most likely tokens, at every scored position;
- ``target_prompt_logprobs``: the log-probabilities of chosen token ids at chosen positions, an
  int64 ``[len(prompt) - 1, K]`` tensor (dense, or sparse CSR) whose cell ``[i, j]`` names a
  token scored at position ``i + 1`` (-1: nothing), answered as float32 in the same layout;
- ``prompt_alt_tokens_k``: k independent draws at the request's temperature from the
  next-token distribution at every position after the first.

Every log-probability here is the untempered model's (as prompt logprobs are); only the
alternative tokens' draw applies the temperature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gyre.tinker.errors import UserError
from gyre.tinker.wire import MASK_LOGPROB, TensorOut

MAX_TOPK = 100  # widest top-k (and prompt_alt_tokens_k) a sampling request may ask for
_ALT_SALT = 0x5EED_A17  # alternative-token draws use their own stream of the request's seed


@dataclass(frozen=True)
class Targets:
    """``target_prompt_logprobs``: the dense ``ids`` (P - 1, K), -1 where nothing is asked,
    and the CSR layout (crow, col) to answer in when the request was sparse."""

    ids: np.ndarray = field(compare=False)
    csr: tuple[list[int], list[int]] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class PromptAsk:
    """What one ``asample`` request wants scored on its prompt."""

    logprobs: bool = False
    topk: int = 0
    last_n: int | None = None  # score only the last N prompt positions
    targets: Targets | None = None
    alt_k: int = 0
    temperature: float = 1.0  # of the alternative tokens' draw

    @property
    def any(self) -> bool:
        return self.logprobs or bool(self.topk) or self.targets is not None or bool(self.alt_k)


@dataclass
class PromptScores:
    """A request's prompt scoring: logprobs (P,) NaN where unscored; top-k (P, k) matrices;
    target logprobs; alternative tokens (ids, logprobs), each (P - 1, k)."""

    logprobs: np.ndarray | None = None
    topk: tuple[np.ndarray, np.ndarray] | None = None
    targets: TensorOut | None = None
    alt: tuple[np.ndarray, np.ndarray] | None = None


def parse_targets(raw: Any, prompt_len: int, vocab: int) -> Targets | None:
    """``target_prompt_logprobs`` (TensorData JSON) checked against the prompt and vocab."""
    if raw is None:
        return None
    where = "target_prompt_logprobs"
    if not isinstance(raw, dict) or raw.get("dtype") != "int64":
        raise UserError(f"{where}: must be an int64 tensor of token ids")
    shape, data = raw.get("shape"), raw.get("data")
    if not isinstance(shape, list) or len(shape) != 2 or shape[0] != prompt_len - 1:
        raise UserError(f"{where}: shape {shape}, need [{prompt_len - 1}, K] (len(prompt) - 1)")
    if not isinstance(data, list) or not all(isinstance(v, int) for v in data):
        raise UserError(f"{where}.data: expected a list of token ids")
    rows, k = shape
    crow, col = raw.get("sparse_crow_indices"), raw.get("sparse_col_indices")
    ids = np.full((rows, k), -1, dtype=np.int64)
    if crow is None and col is None:
        if len(data) != rows * k:
            raise UserError(f"{where}: {len(data)} values do not fill shape {shape}")
        ids[:] = np.asarray(data, dtype=np.int64).reshape(rows, k)
        csr = None
    else:
        crow_a, col_a = np.asarray(crow or [], np.int64), np.asarray(col or [], np.int64)
        if (
            len(crow_a) != rows + 1
            or len(col_a) != len(data)
            or crow_a[0] != 0
            or crow_a[-1] != len(data)
            or np.any(np.diff(crow_a) < 0)
            or (len(col_a) and (col_a.min() < 0 or col_a.max() >= k))
        ):
            raise UserError(f"{where}: malformed sparse CSR tensor (shape {shape})")
        row_of = np.repeat(np.arange(rows), np.diff(crow_a))
        ids[row_of, col_a] = data
        csr = (crow_a.tolist(), col_a.tolist())
    named = ids[ids != -1]
    if not named.size:
        raise UserError(f"{where}: names no token id (every cell is -1)")
    if named.min() < 0 or named.max() >= vocab:
        raise UserError(f"{where}: ids must be -1 or in [0, {vocab})")
    return Targets(ids, csr)


def check_alt_k(k: Any) -> int:
    if k is None:
        return 0
    if not isinstance(k, int) or not 0 <= k <= MAX_TOPK:
        raise UserError(f"prompt_alt_tokens_k: must be an integer in [0, {MAX_TOPK}], got {k!r}")
    return k


def score_prompt(module: torch.nn.Module, prompt: tuple[int, ...], ask: PromptAsk, seed: int):
    """One forward pass over ``prompt``: everything ``ask`` wants (:class:`PromptScores`).
    Position 0, and positions before the last ``last_n``, have no prompt logprob (NaN) and no
    top-k row (token 0 at the SDK's mask value); ``last_n`` does not limit targets or draws."""
    device = next(module.parameters()).device
    ids = torch.tensor([prompt], device=device)
    logits = module(input_ids=ids).logits.float()[0, :-1]  # (P - 1, V): row i predicts i + 1
    logp = torch.log_softmax(logits, dim=-1)
    first = 1 if ask.last_n is None else len(prompt) - ask.last_n
    out = PromptScores()
    if ask.logprobs:
        lp = np.full(len(prompt), np.nan, dtype=np.float32)
        lp[first:] = logp[first - 1 :].gather(-1, ids[0, first:, None])[:, 0].cpu().numpy()
        out.logprobs = lp
    if ask.topk:
        top_ids = np.zeros((len(prompt), ask.topk), dtype=np.int32)
        top_lps = np.full((len(prompt), ask.topk), MASK_LOGPROB, dtype=np.float32)
        best = logp[first - 1 :].topk(ask.topk, dim=-1)
        top_ids[first:] = best.indices.cpu().numpy()
        top_lps[first:] = best.values.cpu().numpy()
        out.topk = (top_ids, top_lps)
    if ask.targets is not None:
        out.targets = _target_logprobs(logp, ask.targets)
    if ask.alt_k:
        out.alt = _alt_tokens(logits, logp, ask, seed)
    return out


def _target_logprobs(logp: torch.Tensor, targets: Targets) -> TensorOut:
    """The log-probabilities of the named ids, 0.0 where a cell is -1, in the request's layout."""
    ids = torch.from_numpy(targets.ids).to(logp.device)
    got = logp.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0).cpu().numpy()
    shape = (int(got.shape[0]), int(got.shape[1]))
    if targets.csr is None:
        return TensorOut(got.astype(np.float32).ravel(), shape)
    crow, col = targets.csr
    row_of = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    return TensorOut(got[row_of, col].astype(np.float32), shape, targets.csr)


def _alt_tokens(
    logits: torch.Tensor, logp: torch.Tensor, ask: PromptAsk, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """``alt_k`` draws with replacement per row at ``ask.temperature`` (0: the argmax, k times),
    from a stream keyed by the request's seed; their untempered log-probabilities."""
    if ask.temperature == 0:
        tokens = logits.argmax(-1, keepdim=True).expand(-1, ask.alt_k)
    else:
        gen = torch.Generator(device="cpu").manual_seed((seed ^ _ALT_SALT) % 2**63)
        probs = torch.softmax(logits.cpu() / ask.temperature, dim=-1)
        tokens = torch.multinomial(probs, ask.alt_k, replacement=True, generator=gen)
        tokens = tokens.to(logp.device)
    lps = logp.gather(-1, tokens)
    return tokens.cpu().numpy().astype(np.int64), lps.cpu().numpy().astype(np.float32)
