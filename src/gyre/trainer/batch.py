"""Trainer-side model helpers: batching trajectories and scoring tokens.

The trainer sees each trajectory as one contiguous, right-padded row (no padding inside a row),
so its position ids are 0..T-1 -- the same positions the engine used for the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from gyre.models.sampling import sampling_logprobs
from gyre.trainer.scoring import ScoringOptions, chunked_token_logprobs
from gyre.trainer.vision import vision_token_logprobs
from gyre.types import Trajectory

Entropy = Literal["off", "metric", "grad"]  # none; a detached metric; in the graph


@dataclass
class TokenBatch:
    """Right-padded tensors for a list of trajectories (B rows, T = longest row)."""

    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) long, 1 on real tokens
    loss_mask: torch.Tensor  # (B, T) float, 1 on policy-generated tokens
    rollout_logprobs: torch.Tensor  # (B, T) float, sampler log-probs (0 off the mask)
    # Per-row (B,) or per-token (B, T) tensors the update needs besides the tokens, e.g. the
    # recomputed old log-probs, reference log-probs, values, per-token advantages. rows() slices
    # them like the fields above.
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # A VLM batch: each row's images (Trajectory.images) and the model's VisionIO, so scoring
    # re-creates the engine's inputs (gyre.trainer.vision). None for text batches.
    images: list[list[Any]] | None = None
    vision: Any = None

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def rows(self, index: slice | torch.Tensor) -> TokenBatch:
        sub = TokenBatch(
            self.input_ids[index],
            self.attention_mask[index],
            self.loss_mask[index],
            self.rollout_logprobs[index],
        )
        width = int(sub.attention_mask.sum(dim=1).max().item())  # trim shared padding
        extras = {
            k: (v[index][:, :width] if v.dim() == 2 else v[index]) for k, v in self.extras.items()
        }
        images = None
        if self.images is not None:
            picks = range(len(self.images))[index] if isinstance(index, slice) else index.tolist()
            images = [self.images[i] for i in picks]
        return TokenBatch(
            sub.input_ids[:, :width],
            sub.attention_mask[:, :width],
            sub.loss_mask[:, :width],
            sub.rollout_logprobs[:, :width],
            extras,
            images,
            self.vision,
        )


def consecutive_slices(n: int, size: int) -> list[slice]:
    """Rows 0..n-1 cut into consecutive slices of ``size``."""
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def micro_batches(batch: TokenBatch, size: int) -> list[slice | torch.Tensor]:
    """The row selections of gradient accumulation / no-grad scoring, ``size`` rows each.

    A text batch: consecutive slices (its scoring packs the padding away). A VLM batch is scored
    right-padded through the Hugging Face forward, so its rows are taken shortest first, and a
    micro-batch also ends before its padded size (rows x longest row) would pass ``size`` rows
    of the batch's mean length: each pads only to its own longest row, and a few long rows do
    not pad many short ones. Turn rows differ in length (an episode's first turn carries the
    intro): on the visual maze, consecutive slices padded a batch to about 2.4x its real tokens.
    The sum over micro-batches is the same either way.
    """
    n = batch.input_ids.shape[0]
    if batch.images is None:
        return list(consecutive_slices(n, size))
    lengths = batch.attention_mask.sum(dim=1).to("cpu")
    order = torch.argsort(lengths, stable=True)
    volume = size * float(lengths.float().mean())
    cuts, start = [], 0
    for i in range(1, n + 1):
        rows = i - start
        if i == n or rows == size or (rows + 1) * int(lengths[order[i]]) > volume:
            cuts.append(order[start:i])
            start = i
    return cuts


def collate(
    trajs: list[Trajectory], pad_token_id: int, device: torch.device, vision: Any = None
) -> TokenBatch:
    """Right-padded tensors of ``trajs``; ``vision`` (a VLM's :class:`VisionIO`) keeps the rows'
    images with them when any has one."""
    T = max(len(t.token_ids) for t in trajs)
    # Built as padded Python lists, one tensor per field (per-row tensor writes cost more than
    # the whole list work for batches of short rows).
    ids: list[list[int]] = []
    lmask: list[list[float]] = []
    rlp: list[list[float]] = []
    lengths: list[int] = []
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        if not (len(t.loss_mask) == len(t.rollout_logprobs) == n):
            raise ValueError(
                f"trajectory {i}: token_ids, loss_mask, rollout_logprobs differ in length"
            )
        pad = T - n
        ids.append([*t.token_ids, *([pad_token_id] * pad)])
        lmask.append([*map(float, t.loss_mask), *([0.0] * pad)])
        rlp.append([*map(float, t.rollout_logprobs), *([0.0] * pad)])
        lengths.append(n)
    attn = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    has_images = any(t.images for t in trajs)
    if has_images and vision is None:
        raise ValueError("trajectories carry images but the trainer's model is text-only")
    return TokenBatch(
        torch.tensor(ids, dtype=torch.long, device=device),
        attn.to(device),
        torch.tensor(lmask, dtype=torch.float32, device=device),
        torch.tensor(rlp, dtype=torch.float32, device=device),
        images=[list(t.images) for t in trajs] if has_images else None,
        vision=vision if has_images else None,
    )


def token_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float = 1.0,
    top_p: float = 1.0,
    entropy: Entropy = "off",
    options: ScoringOptions | None = None,
    score_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix, under the sampling distribution.

    Returns (logprobs (B, T), entropy (B, T) or None); position 0 is 0.0 (no prefix).

    By default the batch is packed and scored in chunks (:mod:`gyre.trainer.scoring`): padding is
    not
    computed and the full-vocab log-softmax is never materialised for all positions at once;
    the values are those of the plain path (padding positions read 0). ``options`` (default:
    :class:`ScoringOptions`, the ``perf:`` defaults) picks the paths; with ``pack=False`` and
    ``chunk=0`` this is the plain path.
    ``entropy``: ``"off"`` (None), ``"metric"`` (detached) or ``"grad"`` (kept in the autograd
    graph, for an entropy bonus in the loss: the plain path, as the fast path's entropy is a
    detached metric). ``score_mask`` (B, T), e.g. the loss mask: only those
    tokens' log-probs (and entropies) are wanted, the others read 0; the fast path then
    computes only the positions they need (see :func:`gyre.trainer.scoring.chunked_token_logprobs`).
    """
    with_entropy, entropy_grad = entropy != "off", entropy == "grad"
    if batch.images is not None:  # a VLM batch: pixels and positions (gyre.trainer.vision)
        return vision_token_logprobs(model, batch, temperature, top_p, with_entropy, score_mask)
    opts = options if options is not None else ScoringOptions()
    if (opts.pack or opts.chunk > 0) and not (with_entropy and entropy_grad):
        fast = chunked_token_logprobs(
            model, batch.input_ids, batch.attention_mask, temperature, top_p, opts, score_mask
        )
        if fast is not None:
            tok, ent = fast
            return tok, ent if with_entropy else None
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    tok, ent = logits_to_token_logprobs(logits, batch.input_ids, temperature, top_p, entropy)
    if score_mask is not None:  # the same values as the fast path: 0 outside the mask
        keep = score_mask.to(tok.dtype)
        tok = tok * keep
        ent = ent * keep if ent is not None else None
    return tok, ent


def logits_to_token_logprobs(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    temperature: float = 1.0,
    top_p: float = 1.0,
    entropy: Entropy = "off",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` from already computed logits (B, T, V).

    ``entropy="grad"`` keeps the entropy in the autograd graph (for an entropy bonus);
    ``"metric"`` is a detached metric.
    """
    logp = sampling_logprobs(logits[:, :-1], temperature, top_p)  # (B, T-1, V)
    targets = input_ids[:, 1:].unsqueeze(-1)
    tok = logp.gather(-1, targets).squeeze(-1)  # (B, T-1)
    tok = torch.nn.functional.pad(tok, (1, 0))
    ent = None
    if entropy != "off":
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            p = logp.exp()
            e = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
            ent = torch.nn.functional.pad(e, (1, 0))
    return tok, ent
