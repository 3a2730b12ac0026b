"""Scoring a VLM's trajectories: the same inputs the engine sampled from, in one forward.

A row's images (``Trajectory.images``) are re-processed by the model's
:class:`gyre.models.vision.VisionIO` to the pixel tensors the engine fed (the processing is
deterministic and cached by content), the image tokens are checked against them (a wrong
image count is a one-line error naming the row), and Qwen-VL rows get the M-RoPE positions of
the whole sequence -- what the engine used piece by piece. The LM head runs only on the
positions that predict a scored token (``logits_to_keep``), and the placeholder tokens are
suppressed as in the engine (:meth:`VisionIO.suppress`), so the log-probs are those of the
distribution sampled from.

The packed / tree / lean paths of :mod:`gyre.trainer.scoring` are for text models; a VLM batch
is scored right-padded, through the Hugging Face forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gyre.models.sampling import sampling_logprobs

TokenBatch = Any  # gyre.trainer.batch.TokenBatch (which imports this module)


def vision_model_inputs(batch: TokenBatch) -> dict[str, Any]:
    """The forward's keyword arguments of a VLM batch: ids, mask, pixel inputs, positions."""
    vision, images = batch.vision, batch.images
    assert vision is not None and images is not None
    ids, attn = batch.input_ids, batch.attention_mask
    B, T = ids.shape
    lengths = [int(n) for n in attn.sum(dim=1).tolist()]
    rows = [ids[b, : lengths[b]].tolist() for b in range(B)]
    for b in range(B):
        vision.check(rows[b], images[b], f"trajectory row {b}")
    kw: dict[str, Any] = {"input_ids": ids, "attention_mask": attn}
    kw.update(vision.inputs(images, ids.device))
    if vision.qwen:
        pos = np.zeros((3, B, T), dtype=np.int64)
        for b in range(B):
            p = vision.positions(rows[b], images[b])
            assert p is not None
            pos[:, b, : lengths[b]] = p
            pos[:, b, lengths[b] :] = p[:, -1:]
        kw["position_ids"] = torch.from_numpy(pos).to(ids.device)
    return kw


def vision_token_logprobs(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float,
    top_p: float,
    with_entropy: bool,
    score_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`gyre.trainer.batch.token_logprobs` of a VLM batch: (logprobs (B, T), entropy
    (B, T) or None), 0 at position 0, on padding and outside ``score_mask``."""
    vision = batch.vision
    assert vision is not None
    ids, attn = batch.input_ids, batch.attention_mask
    B, T = ids.shape
    need = attn.bool().clone()
    need[:, 0] = False
    if score_mask is not None:
        need &= score_mask.bool()
    b_idx, t_idx = need.nonzero(as_tuple=True)  # row-major: the order hidden[keep] has
    keep = torch.zeros_like(need)
    keep[b_idx, t_idx - 1] = True
    kw = vision_model_inputs(batch)
    logits = model(**kw, logits_to_keep=keep).logits  # (N, V): the states predicting (b, t)
    logits = logits.reshape(-1, logits.shape[-1])
    logp = sampling_logprobs(vision.suppress(logits), temperature, top_p)
    flat = logp.gather(-1, ids[b_idx, t_idx].unsqueeze(-1)).squeeze(-1)
    tok = flat.new_zeros(B, T).index_put((b_idx, t_idx), flat)
    ent = None
    if with_entropy:
        p = logp.exp()
        e = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
        ent = e.new_zeros(B, T).index_put((b_idx, t_idx), e)
    return tok, ent
