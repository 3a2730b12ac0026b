"""The in-process engine's model runner: prefill and decode forwards over a decode batch.

Each forward appends one right-padded chunk of tokens per row to the batch's KV cache
(:mod:`gyre.engines.kv_batch`) and returns the last position's logits of every row; the LM
head runs on that one position only (``logits_to_keep``). Llama-family models run the lean
forward (:mod:`gyre.models.lean`: fewer ops over the same parameters, keys/values appended in
place into a preallocated buffer); other models, or ``lean_forward=False``, run the HF forward,
whose one-token decode step may be compiled. A VLM's prefill also gets the images whose
placeholders it holds and the model's 3-D positions (:class:`gyre.models.vision.VisionIO`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from gyre.engines.engine_options import EngineOptions
from gyre.engines.kv_batch import DecodeBatch, Parked, Row, gather_parked
from gyre.models.lean import LeanForward, lean_for
from gyre.models.vision import VisionIO

PrefillSource = tuple[Parked | None, list[int]]
"""One prefill row: the parked session it continues (None: a fresh prompt) and its prompt."""


class ModelRunner:
    """Runs ``model``'s forwards for the engine's scheduler and counts the work they do."""

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        options: EngineOptions,
        vision: VisionIO | None,
    ) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.options = options
        # A VLM's image side: pixel inputs and 3-D positions per prefill (gyre.models.vision).
        self.vision = vision
        self._compiled_of: torch.nn.Module | None = None  # the model _compiled_step wraps
        self._compiled_step: Callable[..., object] | None = None
        self.stats = {
            "prefill_tokens": 0,  # real tokens pushed through prefill forwards
            "decode_tokens": 0,  # real tokens pushed through decode forwards
            "pad_tokens": 0,  # padding positions computed (wasted work)
            "forward_calls": 0,
        }

    def lean(self) -> LeanForward | None:
        """The lean forward of the current ``self.model`` (None: use the HF forward)."""
        return lean_for(self.model, self.options.lean_forward)

    def decode_model(self) -> Callable[..., object]:
        """The forward of a one-token decode step: ``self.model``, or its compiled version.

        Recompiled when ``self.model`` is replaced (a peft wrapper from ``load_adapter`` or
        ``gyre serve``'s LoRA loading), so decode never runs a stale model object.
        """
        if not self.options.compile_decode:
            return self.model
        if self._compiled_step is None or self._compiled_of is not self.model:
            self._compiled_step = torch.compile(self.model, dynamic=True)
            self._compiled_of = self.model
        return self._compiled_step

    def prefill(self, sources: list[PrefillSource], images: list[list]) -> DecodeBatch:
        """A new batch of one row per source: its parked columns (if any), then the rest of its
        prompt prefilled; its rows are placeholders for the scheduler to fill in."""
        cache, colmask = gather_parked(self.model, sources, self.device)
        proto = [
            Row(-1, None, 0, list(p.fed) if p is not None else [], images=im)
            for (p, _), im in zip(sources, images, strict=True)
        ]
        pre = DecodeBatch(cache, colmask, proto, torch.empty(0))
        chunk = [prompt[len(proto[j].fed) :] for j, (_, prompt) in enumerate(sources)]
        pre.logits = self.feed(pre, chunk)
        return pre

    def decode(self, batch: DecodeBatch) -> None:
        """One decode step: feed each live row its last sampled token (a done row a masked pad
        column); then squeeze out the holes once they fill half the cache."""
        chunk = [[] if row.done else [row.out_ids[-1]] for row in batch.rows]
        batch.logits = self.feed(batch, chunk)
        B, L = batch.colmask.shape
        if L >= 32 and int(batch.colmask.sum()) < B * L // 2:
            batch.defrag()

    def feed(self, batch: DecodeBatch, chunk: list[list[int]]) -> torch.Tensor:
        """Append one right-padded chunk of tokens per row; return each row's last logits.

        A row with an empty chunk gets a masked pad column and its returned logits are unused.
        """
        B = len(chunk)
        C = max(1, max(len(c) for c in chunk))
        vlm = self._vision_inputs(batch, chunk, C) if self.vision is not None else None
        # Built as Python lists and converted once: per-row tensor writes cost more than the
        # forward of a small model.
        ids_l: list[list[int]] = []
        mask_l: list[list[int]] = []
        pos_l: list[list[int]] = []
        keep_l: list[int] = []
        pad = self.pad_token_id
        if C == 1 and all(chunk):  # a decode step of live rows: one token each
            for c, row in zip(chunk, batch.rows, strict=True):
                pos_l.append([len(row.fed)])
                row.fed.append(c[0])
            ids_l, mask_l = chunk, [[1]] * B
        else:
            for i, c in enumerate(chunk):
                fed = batch.rows[i].fed
                n, start = len(c), len(fed)
                last = start + max(n - 1, 0)
                ids_l.append([*c, *([pad] * (C - n))])
                mask_l.append([1] * n + [0] * (C - n))
                pos_l.append([*range(start, start + n), *([last] * (C - n))])
                keep_l.append(max(n - 1, 0))
                fed.extend(c)
        ids = torch.tensor(ids_l, dtype=torch.long)
        mask = torch.tensor(mask_l, dtype=torch.long)
        pos = torch.tensor(pos_l, dtype=torch.long)
        keep = torch.zeros((B, C), dtype=torch.bool)
        if C > 1:  # the last real position of each row (a decode step keeps its only one)
            keep[torch.arange(B), torch.tensor(keep_l)] = True
        ids, mask, pos = ids.to(self.device), mask.to(self.device), pos.to(self.device)
        batch.colmask = torch.cat([batch.colmask, mask], dim=1)
        lean = self.lean() if not (C == 1 and self.options.compile_decode) else None
        if lean is not None:
            dtype = lean.inner.embed_tokens.weight.dtype
            attn = lean.cached_mask(batch.colmask, C, dtype)
            spa = self.options.shared_prefix_attention
            hidden = lean.hidden(ids, pos, attn, batch.cache, spa)
            last = hidden[:, 0] if C == 1 else hidden[keep.to(self.device)]
            logits = lean.logits(last)
        else:
            batch.plain()
            forward = self.decode_model() if C == 1 else self.model
            logits = forward(
                input_ids=ids,
                attention_mask=batch.colmask,
                position_ids=pos if vlm is None else vlm[0],
                cache=batch.cache,
                use_cache=True,
                logits_to_keep=1 if C == 1 else keep.to(self.device),
                **(vlm[1] if vlm is not None else {}),
            ).logits
        if vlm is not None:  # never sample a placeholder token (VisionIO.suppress)
            logits = self.vision.suppress(logits)  # type: ignore[union-attr]
        self._count(B, C, int(mask.sum()))
        return logits[:, -1] if logits.ndim == 3 else logits

    def _count(self, B: int, C: int, n_real: int) -> None:
        self.stats["forward_calls"] += 1
        self.stats["pad_tokens"] += B * C - n_real
        self.stats["decode_tokens" if C == 1 else "prefill_tokens"] += n_real

    def _vision_inputs(
        self, batch: DecodeBatch, chunk: list[list[int]], C: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A VLM's (position ids, pixel inputs) for appending ``chunk`` (called before the rows'
        ``fed`` grow): the images whose placeholders are in the chunk, and positions taken from
        the whole sequence's (:meth:`VisionIO.positions`) for a prefill, or counted on from
        ``Row.next_pos`` for decoded tokens -- the positions the trainer computes in one go."""
        vision = self.vision
        assert vision is not None
        B = len(chunk)
        pos = np.zeros((B, C), dtype=np.int64) if not vision.qwen else None
        pos3 = np.zeros((3, B, C), dtype=np.int64)
        rows_images: list[list] = []
        for b, (c, row) in enumerate(zip(chunk, batch.rows, strict=True)):
            imgs = vision.images_in_chunk(row.fed, c, row.images) if c else []
            rows_images.append(imgs)
            n, start = len(c), len(row.fed)
            if pos is not None:  # 1-D positions (Idefics3): the token's index, as for text
                pos[b] = [*range(start, start + n), *([start + max(n - 1, 0)] * (C - n))]
                continue
            if n and (imgs or row.next_pos < 0):
                full = vision.positions([*row.fed, *c], row.images)
                assert full is not None
                mine = full[:, start:]
                row.next_pos = int(full.max()) + 1
            elif n:
                mine = np.arange(row.next_pos, row.next_pos + n)[None].repeat(3, 0)
                row.next_pos += n
            else:  # a masked pad column: any valid position
                mine = np.full((3, 1), max(row.next_pos, 0))
            pos3[:, b, :n] = mine
            pos3[:, b, n:] = mine[:, -1:]
        out = torch.from_numpy(pos if pos is not None else pos3).to(self.device)
        return out, vision.inputs(rows_images, self.device)
