"""An in-process engine: continuous batching over a Hugging Face model and its KV cache.

The cache layout (one ``DynamicCache`` shared by the live rows, a column mask with holes) and
the batch and snapshot bookkeeping are in :mod:`gyre.engines.kv_batch`.

What is saved, each measurable on its own (``bench/rollout.py --engine-flags``):

- **Prefix sharing** (``prefix_sharing``): identical prompts admitted together (a GRPO group)
  are prefilled once; the cache rows are then forked G ways with a row gather.
- **Compaction** (``compaction``): a row leaves the decode batch the step it finishes, so the
  batch never decodes rows that are done. With ``compaction=False`` finished rows stay in
  the batch as masked pad columns until the whole batch is done (static batching).
- **Continuous batching**: ``max_batch_size`` bounds the live rows; waiting requests are
  admitted the step slots free up. :meth:`TorchEngine.generate_continuous` takes a callback
  that turns a finished completion into a follow-up request (the next turn of a multi-turn
  episode), which is admitted at once instead of waiting for the slowest episode's turn.
- **Session KV reuse**: a finished row with a ``session`` is parked (its real columns only);
  a later request of the same session whose prompt extends the parked tokens prefills only
  the new suffix.
- **Last-position logits only**: the LM head runs on one position per row
  (``logits_to_keep``), never on every prefill position.
- **Lean forward** (``lean_forward``, :mod:`gyre.models.lean`): Llama-family models run a
  forward with
  fewer ops over the same parameters, appending keys/values in place into a preallocated
  buffer; other models (or ``lean_forward=False``) use the HF forward.

Every switch is a constructor argument; a run sets them from its ``perf:`` config section
(:func:`gyre.engines.factory.run_torch_engine`).

Sampling is counter-based (:func:`gyre.models.sampling.sample_tokens_keyed`): token k of a
request is
drawn from a uniform keyed by (request seed, k), so a request's tokens do not depend on the
batch it shares, on the order of requests, or on any of the optimisations above (tested).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from gyre.engines.base import EngineFeatures
from gyre.engines.kv_batch import DecodeBatch, Parked, Row, gather_parked
from gyre.models.lean import LeanForward, lean_for
from gyre.models.sampling import sample_tokens_keyed, sampling_logprobs
from gyre.models.vision import VisionIO, image_key
from gyre.types import Completion, GenerationRequest, SamplingParams

OnComplete = Callable[[int, Completion], GenerationRequest | None]
"""Callback of :meth:`TorchEngine.generate_continuous`: (request index, completion) -> an
optional follow-up request (admitted at once) or None."""


class TorchEngine:
    """Engine over a local ``transformers`` causal LM (any architecture with a DynamicCache).

    ``max_batch_size`` (0 = unbounded) caps the rows decoded together; ``prefix_sharing``,
    ``compaction`` and ``shared_prefix_attention`` (decode attends a forked group's prompt
    once per group, lean forward only) can be switched off to measure what each buys. Results
    never depend on any of them. ``compile_decode`` runs the decode step through
    ``torch.compile``; ``admit_ratio`` sets how many requests must wait (relative to running
    rows) before a mid-decode admission prefill is worth its forward call; ``compact_min`` is
    the fraction of finished rows at which compaction gathers the live rows (0: every step a
    row finishes; default half: on a small model a decode step costs about the same for 17
    rows as for 64, while the gather out of the grouped layout costs ~1 ms). ``lean_forward``
    (default on) runs Llama-family models through
    :class:`gyre.models.lean.LeanForward`, falling back to the HF forward for anything else.
    A request's own ``temperature`` replaces the batch's for its tokens.
    """

    features = EngineFeatures(continuous=True, per_request_temperature=True, in_process=True)

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        seed: int = 0,
        max_batch_size: int = 0,
        prefix_sharing: bool = True,
        compaction: bool = True,
        admit_ratio: float = 0.5,
        compile_decode: bool = False,
        lean_forward: bool = True,
        compact_min: float = 0.5,
        shared_prefix_attention: bool = True,
        vision: VisionIO | None = None,
    ) -> None:
        if max_batch_size < 0:
            raise ValueError(f"max_batch_size must be >= 0 (0 = unbounded), got {max_batch_size}")
        if not 0.0 <= compact_min <= 1.0:
            raise ValueError(f"compact_min must be in [0, 1], got {compact_min}")
        self.compact_min = compact_min
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self.pad_token_id = pad_token_id
        self.version = 0
        self.max_batch_size = max_batch_size
        self.prefix_sharing = prefix_sharing
        self.compaction = compaction
        self.shared_prefix_attention = shared_prefix_attention
        self.admit_ratio = admit_ratio
        # torch.compile of the one-token decode step only (prefill stays eager). Off by default:
        # it pays per step but costs minutes of compilation on a small CPU (docs/performance.md).
        self._compiled = compile_decode
        self._compiled_of: torch.nn.Module | None = None  # the model _compiled_step wraps
        self._compiled_step: Callable[..., object] | None = None
        self.lean_forward = lean_forward
        # A VLM's image side: pixel inputs and 3-D positions per prefill (gyre.models.vision).
        self.vision = vision
        self._generator = torch.Generator(device="cpu")
        self._generator.manual_seed(seed)
        self._parked: dict[Hashable, Parked] = {}
        self.stats = {
            "prefill_tokens": 0,  # real tokens pushed through prefill forwards
            "decode_tokens": 0,  # real tokens pushed through decode forwards
            "pad_tokens": 0,  # padding positions computed (wasted work)
            "forward_calls": 0,
        }

    # -- weight sync ----------------------------------------------------------------------
    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            own = self.model.state_dict()
            for name, tensor in state_dict.items():
                own[name].copy_(tensor)
        self.weights_changed(version)

    def weights_changed(self, version: int) -> None:
        """The model's parameters changed (copied in by a sync, or updated in place by a
        colocated trainer sharing them: ``engine.weight_sync=shared``): move to ``version``
        and drop the parked caches, whose keys/values came from the old weights."""
        self.version = version
        self._parked.clear()

    @property
    def generator(self) -> torch.Generator:
        """The sampler's random stream (a run checkpoints it for exact resume)."""
        return self._generator

    def load_weights_from_disk(self, path: str | Path, version: int) -> int:
        """Full-weight sync from a Hugging Face folder's safetensors; returns ``version``."""
        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in '{path}'")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(safetensors.torch.load_file(f, device=str(self.device)))
        own = self.model.state_dict()
        if hasattr(self.model, "peft_config"):
            raise ValueError("this engine holds a LoRA adapter: sync it with load_adapter")
        if self.vision is not None and any(k not in own for k in state):
            from gyre.models.vision import checkpoint_state

            state = {k: v.to(self.device) for k, v in checkpoint_state(path).items()}
        missing = [k for k in state if k not in own]
        if missing:
            raise ValueError(f"weights in '{path}' do not fit the engine's model: {missing[:3]}")
        self.load_weights(state, version)
        return version

    def load_adapter(self, path: str | Path, version: int) -> int:
        """Adapter sync: load a peft adapter folder as the active adapter; returns ``version``."""
        from gyre.models.lora import load_adapter_into

        self.model = load_adapter_into(self.model, Path(path), f"v{version}").eval()
        active = f"v{version}"
        self.model.set_adapter(active)
        for name in list(self.model.peft_config):
            if name != active:
                self.model.delete_adapter(name)
        self.weights_changed(version)  # cached keys/values belong to the old adapter
        return version

    def reset_cache(self) -> None:
        """Drop every parked session cache (after the weights or adapters changed)."""
        self._parked.clear()

    def _decode_model(self) -> Callable[..., object]:
        """The forward of a one-token decode step: ``self.model``, or its compiled version.

        Recompiled when ``self.model`` is replaced (a peft wrapper from :meth:`load_adapter` or
        ``gyre serve``'s LoRA loading), so decode never runs a stale model object.
        """
        if not self._compiled:
            return self.model
        if self._compiled_step is None or self._compiled_of is not self.model:
            self._compiled_step = torch.compile(self.model, dynamic=True)
            self._compiled_of = self.model
        return self._compiled_step

    def _lean(self) -> LeanForward | None:
        """The lean forward of the current ``self.model`` (None: use the HF forward)."""
        return lean_for(self.model, self.lean_forward)

    def release(self, sessions: Iterable[Hashable]) -> None:
        for s in sessions:
            self._parked.pop(s, None)

    # -- generation -----------------------------------------------------------------------
    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        """Sample a completion for every request, in order.

        Parked sessions that none of ``requests`` continues are dropped (as a batch of a new
        rollout does not need the old one's caches).
        """
        wanted = {r.session for r in requests if r.session is not None}
        for s in [s for s in self._parked if s not in wanted]:
            del self._parked[s]
        return self.generate_continuous(requests, params, None)

    @torch.no_grad()
    def generate_continuous(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        on_complete: OnComplete | None,
    ) -> list[Completion]:
        """Generate ``requests`` with continuous batching.

        Each time a row finishes, ``on_complete(index, completion)`` may return a follow-up
        request; it gets the next index and is admitted into the running batch as soon as a
        slot is free. Returns every completion (initial requests, then follow-ups) by index.
        """
        lean = self._lean()
        if lean is None:
            return self._generate_continuous(requests, params, on_complete)
        with lean.reuse_fused():  # the weights do not change during one generate call
            return self._generate_continuous(requests, params, on_complete)

    def _generate_continuous(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        on_complete: OnComplete | None,
    ) -> list[Completion]:
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not requests:
            return []
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        stop = set(params.stop_token_ids)
        waiting: deque[tuple[int, GenerationRequest, int]] = deque()
        results: dict[int, Completion] = {}
        counter = 0

        def enqueue(req: GenerationRequest) -> None:
            nonlocal counter
            if not req.prompt_ids:
                raise ValueError(f"request {counter} has an empty prompt")
            seed = req.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._generator))
            waiting.append((counter, req, seed))
            counter += 1

        for r in requests:
            enqueue(r)
        batch: DecodeBatch | None = None
        limit = self.max_batch_size or (1 << 62)
        while waiting or batch is not None:
            batch = self._admit_waiting(batch, waiting, limit)
            pending = [i for i, row in enumerate(batch.rows) if not row.done]
            self._sample(batch, pending, params, stop)
            finished = [i for i in pending if batch.rows[i].done]
            for req in self._finish(batch, finished, params, results, on_complete):
                enqueue(req)
            if not self._compact(batch, bool(waiting), limit):
                batch = None
                continue
            chunk = [[] if row.done else [row.out_ids[-1]] for row in batch.rows]
            batch.logits = self._feed(batch, chunk)
            B, L = batch.colmask.shape
            if L >= 32 and int(batch.colmask.sum()) < B * L // 2:
                batch.defrag()
        return [results[i] for i in range(counter)]

    def _admit_waiting(
        self,
        batch: DecodeBatch | None,
        waiting: deque[tuple[int, GenerationRequest, int]],
        limit: int,
    ) -> DecodeBatch:
        """Admit waiting requests into ``batch`` (None: start one) when a prefill is worth it;
        return the batch to decode."""
        live = 0 if batch is None else len(batch.rows)
        can_admit = limit - live if self.compaction or batch is None else 0
        # An admission costs a prefill forward of its own; on a small model the forward's
        # fixed cost dominates, so admit in bunches: when the batch is empty, slots are
        # short, or at least ``admit_ratio`` x as many requests wait as rows run.
        worth = (
            batch is None or len(waiting) >= can_admit or len(waiting) >= self.admit_ratio * live
        )
        if waiting and can_admit > 0 and worth:
            admit = [waiting.popleft() for _ in range(min(can_admit, len(waiting)))]
            fresh = self._admit(admit)
            if batch is None:
                batch = fresh
            else:
                batch.merge(fresh)
        assert batch is not None
        return batch

    def _finish(
        self,
        batch: DecodeBatch,
        finished: list[int],
        params: SamplingParams,
        results: dict[int, Completion],
        on_complete: OnComplete | None,
    ) -> list[GenerationRequest]:
        """Record the completions of rows ``finished`` (parking the rows of a session); return
        the follow-up requests ``on_complete`` asks for, in order."""
        follow: list[GenerationRequest] = []
        parks = any(batch.rows[i].session is not None for i in finished)
        snap = batch.snapshot() if parks else None
        for i in finished:
            row = batch.rows[i]
            if row.session is not None:
                assert snap is not None
                self._parked[row.session] = Parked(list(row.fed), snap, i)
            comp = Completion(
                row.out_ids,
                row.out_lp,
                row.reason,
                row.out_top if params.top_logprobs > 0 else None,
            )
            results[row.index] = comp
            if on_complete is not None:
                nxt = on_complete(row.index, comp)
                if nxt is not None:
                    follow.append(nxt)
        return follow

    def _compact(self, batch: DecodeBatch, waiting: bool, limit: int) -> bool:
        """After a step: drop the finished rows of ``batch`` when that pays (compaction on);
        False when no row is left to decode."""
        if self.compaction:
            keep = [i for i, row in enumerate(batch.rows) if not row.done]
            if not keep:
                return False
            # Dropping rows is a gather of every kept row's cache; it pays once enough
            # rows are done (a done row left in place costs one masked column a step), or
            # at once when waiting requests need the slots.
            done = len(batch.rows) - len(keep)
            if done and (
                done >= self.compact_min * len(batch.rows) or (waiting and len(batch.rows) >= limit)
            ):
                batch.select(keep, self.shared_prefix_attention)
            return True
        return not all(row.done for row in batch.rows)

    def _sample(
        self, batch: DecodeBatch, pending: list[int], params: SamplingParams, stop: set[int]
    ) -> None:
        rows = [batch.rows[i] for i in pending]
        logits = batch.logits if len(pending) == len(batch.rows) else batch.logits[pending]
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
            tok, lp = sample_tokens_keyed(sub, temp, params.top_p, seeds, counters)
            for j, t, v in zip(at, tok.tolist(), lp.tolist(), strict=True):
                tokens[j], logps[j] = t, v
            if k > 0:
                # The k most likely tokens under the distribution sampled from (after
                # temperature and top-p), as OpenAI's ``logprobs``/``top_logprobs`` report them.
                top = sampling_logprobs(sub, temp, params.top_p).topk(k, dim=-1)
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

    def _admit(self, items: list[tuple[int, GenerationRequest, int]]) -> DecodeBatch:
        """Prefill newly admitted requests as their own batch (to be merged into the live one).

        A request continuing a parked session starts from the parked columns and prefills only
        the new suffix; identical fresh prompts are prefilled once and forked.
        """
        uniq: dict[tuple, int] = {}
        sources: list[tuple[Parked | None, list[int]]] = []  # per prefill row
        row_of: list[int] = []  # per item: its prefill row
        images: list[list] = []  # per prefill row: a VLM request's images
        for index, req, _ in items:
            if self.vision is not None:  # a wrong image count fails here, in one line
                self.vision.check(req.prompt_ids, req.images, f"request {index}")
            elif req.images:
                raise ValueError(f"request {index} has images but the engine's model is text-only")
            parked = self._parked.get(req.session) if req.session is not None else None
            if parked is not None:
                self._parked.pop(req.session)
                n = len(parked.fed)
                if len(req.prompt_ids) > n and req.prompt_ids[:n] == parked.fed:
                    row_of.append(len(sources))
                    sources.append((parked, list(req.prompt_ids)))
                    images.append(req.images)
                    continue
            key: tuple = tuple(req.prompt_ids)
            if req.images:  # equal ids, other pixels: a VLM's prompts share only with both equal
                key = (key, tuple(image_key(im) for im in req.images))
            if self.prefix_sharing and key in uniq:
                row_of.append(uniq[key])
                continue
            uniq[key] = len(sources)
            row_of.append(len(sources))
            sources.append((None, list(req.prompt_ids)))
            images.append(req.images)
        cache, colmask = gather_parked(self.model, sources, self.device)
        proto = [
            Row(-1, None, 0, list(p.fed) if p is not None else [], images=im)
            for (p, _), im in zip(sources, images, strict=True)
        ]
        pre = DecodeBatch(cache, colmask, proto, torch.empty(0))
        chunk = [prompt[len(proto[j].fed) :] for j, (_, prompt) in enumerate(sources)]
        pre.logits = self._feed(pre, chunk)
        if len(sources) != len(items) or row_of != list(range(len(items))):
            # fork shared prefills G ways (a row gather of the cache)
            pre.select(row_of, self.shared_prefix_attention)
        pre.rows = [
            Row(index, req.session, seed, list(req.prompt_ids), images=req.images,
                next_pos=filled.next_pos, temperature=req.temperature)
            for (index, req, seed), filled in zip(items, pre.rows, strict=True)
        ]  # fmt: skip
        return pre

    def _feed(self, batch: DecodeBatch, chunk: list[list[int]]) -> torch.Tensor:
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
        lean = self._lean() if not (C == 1 and self._compiled) else None
        if lean is not None:
            dtype = lean.inner.embed_tokens.weight.dtype
            attn = lean.cached_mask(batch.colmask, C, dtype)
            hidden = lean.hidden(ids, pos, attn, batch.cache, self.shared_prefix_attention)
            last = hidden[:, 0] if C == 1 else hidden[keep.to(self.device)]
            logits = lean.logits(last)
        else:
            batch.plain()
            forward = self._decode_model() if C == 1 else self.model
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
        n_real = int(mask.sum())
        self.stats["forward_calls"] += 1
        self.stats["pad_tokens"] += B * C - n_real
        if C == 1:
            self.stats["decode_tokens"] += n_real
        else:
            self.stats["prefill_tokens"] += n_real
        return logits[:, -1] if logits.ndim == 3 else logits

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
