"""The in-process engine's scheduler: which requests decode together, step by step.

- **Continuous batching**: ``max_batch_size`` bounds the live rows; waiting requests are
  admitted the step slots free up, in bunches (an admission costs a prefill forward of its
  own). A finished completion may turn into a follow-up request (the next turn of a multi-turn
  episode, :data:`OnComplete`), admitted at once instead of waiting for the slowest episode.
- **Prefix sharing** (``prefix_sharing``): identical prompts admitted together (a GRPO group)
  are prefilled once; the cache rows are then forked G ways with a row gather.
- **Compaction** (``compaction``): finished rows leave the decode batch once ``compact_min`` of
  the rows are done, or at once when waiting requests need the slots. With
  ``compaction=False`` finished rows stay in the batch as masked pad columns until the whole
  batch is done (static batching).
- **Session KV reuse**: a finished row with a ``session`` is parked (its real columns only); a
  later request of the same session whose prompt extends the parked tokens prefills only the
  new suffix.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable

from gyre.engines.engine_options import EngineOptions
from gyre.engines.kv_batch import DecodeBatch, Parked, Row
from gyre.engines.model_runner import ModelRunner, PrefillSource
from gyre.engines.sampler import KeyedSampler
from gyre.models.vision import image_key
from gyre.types import Completion, GenerationRequest, SamplingParams

OnComplete = Callable[[int, Completion], GenerationRequest | None]
"""Callback of continuous generation: (request index, completion) -> an optional follow-up
request (admitted at once) or None."""

Waiting = deque[tuple[int, GenerationRequest, int]]
"""Requests not yet admitted: (index, request, seed)."""


class Scheduler:
    """Admits, decodes, finishes and parks the rows of one engine (``runner`` runs the
    forwards, ``sampler`` draws the tokens)."""

    def __init__(self, options: EngineOptions, runner: ModelRunner, sampler: KeyedSampler) -> None:
        self.options = options
        self.runner = runner
        self.sampler = sampler
        self.parked: dict[Hashable, Parked] = {}

    def keep_sessions(self, wanted: set[Hashable]) -> None:
        """Drop the parked sessions not in ``wanted``."""
        for s in [s for s in self.parked if s not in wanted]:
            del self.parked[s]

    def release(self, sessions: Iterable[Hashable]) -> None:
        for s in sessions:
            self.parked.pop(s, None)

    def run(
        self,
        requests: list[GenerationRequest],
        params: SamplingParams,
        on_complete: OnComplete | None,
    ) -> list[Completion]:
        """Every completion (``requests``, then follow-ups) by index."""
        for i, r in enumerate(requests):
            if not r.prompt_ids:
                raise ValueError(f"request {i} has an empty prompt")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        if not requests:
            return []
        if params.seed is not None:
            self.sampler.reseed(params.seed)
        stop = set(params.stop_token_ids)
        waiting: Waiting = deque()
        results: dict[int, Completion] = {}
        counter = 0

        def enqueue(req: GenerationRequest) -> None:
            nonlocal counter
            if not req.prompt_ids:
                raise ValueError(f"request {counter} has an empty prompt")
            waiting.append((counter, req, self.sampler.request_seed(req)))
            counter += 1

        for r in requests:
            enqueue(r)
        batch: DecodeBatch | None = None
        limit = self.options.max_batch_size or (1 << 62)
        while waiting or batch is not None:
            batch = self._admit_waiting(batch, waiting, limit)
            pending = [i for i, row in enumerate(batch.rows) if not row.done]
            rows = [batch.rows[i] for i in pending]
            logits = batch.logits if len(pending) == len(batch.rows) else batch.logits[pending]
            self.sampler.sample(rows, logits, params, stop)
            finished = [i for i in pending if batch.rows[i].done]
            for req in self._finish(batch, finished, params, results, on_complete):
                enqueue(req)
            if not self._compact(batch, bool(waiting), limit):
                batch = None
                continue
            self.runner.decode(batch)
        return [results[i] for i in range(counter)]

    def _admit_waiting(
        self, batch: DecodeBatch | None, waiting: Waiting, limit: int
    ) -> DecodeBatch:
        """Admit waiting requests into ``batch`` (None: start one) when a prefill is worth it;
        return the batch to decode."""
        live = 0 if batch is None else len(batch.rows)
        can_admit = limit - live if self.options.compaction or batch is None else 0
        # An admission costs a prefill forward of its own; on a small model the forward's
        # fixed cost dominates, so admit in bunches: when the batch is empty, slots are
        # short, or at least ``admit_ratio`` x as many requests wait as rows run.
        worth = (
            batch is None
            or len(waiting) >= can_admit
            or len(waiting) >= self.options.admit_ratio * live
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
                self.parked[row.session] = Parked(list(row.fed), snap, i)
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
        if self.options.compaction:
            keep = [i for i, row in enumerate(batch.rows) if not row.done]
            if not keep:
                return False
            # Dropping rows is a gather of every kept row's cache; it pays once enough
            # rows are done (a done row left in place costs one masked column a step), or
            # at once when waiting requests need the slots.
            done = len(batch.rows) - len(keep)
            full = waiting and len(batch.rows) >= limit
            if done and (done >= self.options.compact_min * len(batch.rows) or full):
                batch.select(keep, self.options.shared_prefix_attention)
            return True
        return not all(row.done for row in batch.rows)

    def _admit(self, items: list[tuple[int, GenerationRequest, int]]) -> DecodeBatch:
        """Prefill newly admitted requests as their own batch (to be merged into the live one).

        A request continuing a parked session starts from the parked columns and prefills only
        the new suffix; identical fresh prompts are prefilled once and forked.
        """
        uniq: dict[tuple, int] = {}
        sources: list[PrefillSource] = []  # per prefill row
        row_of: list[int] = []  # per item: its prefill row
        images: list[list] = []  # per prefill row: a VLM request's images
        vision = self.runner.vision
        for index, req, _ in items:
            if vision is not None:  # a wrong image count fails here, in one line
                vision.check(req.prompt_ids, req.images, f"request {index}")
            elif req.images:
                raise ValueError(f"request {index} has images but the engine's model is text-only")
            parked = self.parked.get(req.session) if req.session is not None else None
            if parked is not None:
                self.parked.pop(req.session)
                n = len(parked.fed)
                if len(req.prompt_ids) > n and req.prompt_ids[:n] == parked.fed:
                    row_of.append(len(sources))
                    sources.append((parked, list(req.prompt_ids)))
                    images.append(req.images)
                    continue
            key: tuple = tuple(req.prompt_ids)
            if req.images:  # equal ids, other pixels: a VLM's prompts share only with both equal
                key = (key, tuple(image_key(im) for im in req.images))
            if self.options.prefix_sharing and key in uniq:
                row_of.append(uniq[key])
                continue
            uniq[key] = len(sources)
            row_of.append(len(sources))
            sources.append((None, list(req.prompt_ids)))
            images.append(req.images)
        pre = self.runner.prefill(sources, images)
        if len(sources) != len(items) or row_of != list(range(len(items))):
            # fork shared prefills G ways (a row gather of the cache)
            pre.select(row_of, self.options.shared_prefix_attention)
        pre.rows = [
            Row(
                index,
                req.session,
                seed,
                list(req.prompt_ids),
                images=req.images,
                next_pos=filled.next_pos,
                temperature=req.temperature,
            )
            for (index, req, seed), filled in zip(items, pre.rows, strict=True)
        ]
        return pre
