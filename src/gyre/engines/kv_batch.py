"""The in-process engine's decode batch: live rows, their shared KV cache and column mask, and
the snapshots that parked sessions hold (:class:`gyre.engines.torch_engine.TorchEngine`).

Cache layout. The live rows share one ``DynamicCache`` of width L; ``colmask`` (B, L) marks the
columns that hold a real token of each row. Rows may have masked holes (a row admitted into a
wider batch, tokens appended after other rows' longer prefills); holes get attention-mask 0 and
do not advance the row's position ids, so a row's positions are exactly those of its unpadded
sequence (what the trainer sees). Keys are cached after RoPE, so real columns can be moved left
(:meth:`DecodeBatch.defrag`) without changing anything. Every query can attend to at least one
real column of its own row, so sdpa never sees a fully masked row (which would give NaN).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from gyre.models.lean_decode import select_kv_rows, ungroup_cache


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty cache for ``model``, refused unless every layer is a plain DynamicLayer."""
    cache = DynamicCache(config=model.config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise TypeError(
            "TorchEngine needs a model whose DynamicCache has only plain DynamicLayer layers "
            "(sliding-window / hybrid models are not supported)"
        )
    return cache


class KVSnapshot:
    """The cache tensors of a batch at one step. Cache tensors are never written in place (every
    append, gather or merge makes new ones; the lean forward's buffers only ever write columns
    past the ones any view holds), so holding references is a free, immutable copy. Layers in
    the lean forward's grouped decode layout are held as (group, steps) and written out in the
    per-row layout only when a parked session is continued (most never are: a finished
    single-turn episode is released at once)."""

    def __init__(
        self,
        keys: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
        colmask: torch.Tensor,
        groups: list[tuple[Any, int] | None] | None = None,
    ) -> None:
        self._keys, self._values, self.colmask = keys, values, colmask  # (B, H, L, D), (B, L)
        self._groups = groups

    def _materialize(self) -> None:
        if self._groups is None:
            return
        for li, held in enumerate(self._groups):
            if held is not None:
                group, steps = held
                _, _, self._keys[li], self._values[li] = group.standard(steps)
        self._groups = None

    @property
    def keys(self) -> list[torch.Tensor]:
        self._materialize()
        return self._keys  # type: ignore[return-value]

    @property
    def values(self) -> list[torch.Tensor]:
        self._materialize()
        return self._values  # type: ignore[return-value]


@dataclass
class Parked:
    """A finished session's cache: row ``row`` of a snapshot (no copy until it is re-admitted)."""

    fed: list[int]
    snap: KVSnapshot
    row: int


@dataclass
class Row:
    """One request being decoded: its tokens in the cache and what it has sampled so far."""

    index: int  # position of the request in the results
    session: Hashable | None
    seed: int
    fed: list[int]  # tokens whose keys/values are in the cache
    out_ids: list[int] = field(default_factory=list)
    out_lp: list[float] = field(default_factory=list)
    out_top: list[dict[int, float]] = field(default_factory=list)
    done: bool = False
    reason: str = "length"
    images: list[Any] = field(default_factory=list)  # a VLM request's images (prompt order)
    next_pos: int = -1  # a VLM's rotary position of the next token (-1: not known yet)
    temperature: float | None = None  # the request's own temperature (None: the batch's)


class DecodeBatch:
    """The live rows, their shared cache, column mask and next-token logits."""

    def __init__(
        self, cache: DynamicCache, colmask: torch.Tensor, rows: list[Row], logits: torch.Tensor
    ) -> None:
        self.cache, self.colmask, self.rows, self.logits = cache, colmask, rows, logits

    def _layers(self) -> list[DynamicLayer]:
        return self.cache.layers

    def select(self, keep: list[int], group: bool = True) -> None:
        """Keep rows ``keep`` (repeats fork them); ``group``: see :func:`select_kv_rows`."""
        idx = torch.tensor(keep, device=self.colmask.device)
        for layer in self._layers():
            if layer.is_initialized:
                select_kv_rows(layer, idx, group=group)
        self.colmask = self.colmask.index_select(0, idx)
        self.logits = self.logits.index_select(0, idx)
        self.rows = [self.rows[i] for i in keep]

    def plain(self) -> None:
        """Per-row cache layout in every layer (the lean forward's grouped decode layout serves
        one-token decode steps only; everything else here reads per-row keys/values)."""
        ungroup_cache(self.cache)

    def snapshot(self) -> KVSnapshot:
        layers = self._layers()
        held = [getattr(la, "_gyre_group", None) for la in layers]
        groups = [None if g is None else (g, g.steps) for g in held]
        return KVSnapshot(
            [la.keys for la in layers],
            [la.values for la in layers],
            self.colmask,
            groups if any(g is not None for g in held) else None,
        )

    def widen(self, width: int) -> None:
        extra = width - self.colmask.shape[1]
        if extra <= 0:
            return
        self.plain()
        for layer in self._layers():
            if layer.is_initialized:
                layer.keys = torch.nn.functional.pad(layer.keys, (0, 0, 0, extra))
                layer.values = torch.nn.functional.pad(layer.values, (0, 0, 0, extra))
        self.colmask = torch.nn.functional.pad(self.colmask, (0, extra))

    def merge(self, other: DecodeBatch) -> None:
        """Append ``other``'s rows (the narrower one gets masked columns on the right)."""
        width = max(self.colmask.shape[1], other.colmask.shape[1])
        self.plain()
        other.plain()
        self.widen(width)
        other.widen(width)
        for a, b in zip(self._layers(), other._layers(), strict=True):
            a.keys = torch.cat([a.keys, b.keys], dim=0)
            a.values = torch.cat([a.values, b.values], dim=0)
        self.colmask = torch.cat([self.colmask, other.colmask], dim=0)
        self.logits = torch.cat([self.logits, other.logits], dim=0)
        self.rows += other.rows

    def defrag(self) -> None:
        """Move every row's real columns to the left and drop the all-hole tail."""
        self.plain()
        counts = self.colmask.sum(dim=1)
        width = int(counts.max())
        order = torch.sort(self.colmask, dim=1, descending=True, stable=True).indices[:, :width]
        for layer in self._layers():
            B, H, _, D = layer.keys.shape
            idx = order[:, None, :, None].expand(B, H, width, D)
            layer.keys = layer.keys.gather(2, idx)
            layer.values = layer.values.gather(2, idx)
        self.colmask = (torch.arange(width, device=counts.device)[None] < counts[:, None]).long()


def gather_parked(
    model: torch.nn.Module, sources: list[tuple[Parked | None, list[int]]], device: torch.device
) -> tuple[DynamicCache, torch.Tensor]:
    """The cache of an admission batch: parked rows gathered from their snapshots (one
    gather per snapshot and layer, none at all when a whole snapshot comes back in order),
    fresh rows empty. Columns are padded (masked) to the widest snapshot."""
    cache = new_cache(model)
    groups: dict[int, list[int]] = {}  # id(snapshot) -> source rows
    for j, (p, _) in enumerate(sources):
        if p is not None:
            groups.setdefault(id(p.snap), []).append(j)
    if not groups:
        return cache, torch.zeros(len(sources), 0, dtype=torch.long, device=device)
    parts: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = []
    for rows in groups.values():
        snap = sources[rows[0]][0].snap  # type: ignore[union-attr]
        idx = [sources[j][0].row for j in rows]  # type: ignore[union-attr]
        if idx == list(range(snap.colmask.shape[0])):
            parts.append((rows, snap.keys, snap.values, snap.colmask))
        else:
            t = torch.tensor(idx, device=device)
            parts.append(
                (
                    rows,
                    [k.index_select(0, t) for k in snap.keys],
                    [v.index_select(0, t) for v in snap.values],
                    snap.colmask.index_select(0, t),
                )
            )
    width = max(part[3].shape[1] for part in parts)
    n_fresh = sum(1 for p, _ in sources if p is None)
    order = [j for part in parts for j in part[0]] + [
        j for j, (p, _) in enumerate(sources) if p is None
    ]
    pad = torch.nn.functional.pad
    n_layers = len(parts[0][1])
    for li in range(n_layers):
        ks, vs = [], []
        for _, keys, values, cm in parts:
            extra = width - cm.shape[1]
            ks.append(pad(keys[li], (0, 0, 0, extra)) if extra else keys[li])
            vs.append(pad(values[li], (0, 0, 0, extra)) if extra else values[li])
        if n_fresh:
            _, H, _, D = ks[0].shape
            ks.append(ks[0].new_zeros(n_fresh, H, width, D))
            vs.append(vs[0].new_zeros(n_fresh, H, width, D))
        k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=0)
        v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=0)
        layer = cache.layers[li]
        layer.lazy_initialization(k, v)
        layer.keys, layer.values = k, v  # no copy: nothing writes cache tensors in place
    masks = [pad(cm, (0, width - cm.shape[1])) for *_, cm in parts]
    if n_fresh:
        masks.append(masks[0].new_zeros(n_fresh, width))
    colmask = masks[0] if len(masks) == 1 else torch.cat(masks, dim=0)
    if order != list(range(len(sources))):
        inv = torch.empty(len(order), dtype=torch.long)
        inv[torch.tensor(order)] = torch.arange(len(order))
        inv = inv.to(device)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, inv)
            layer.values = layer.values.index_select(0, inv)
        colmask = colmask.index_select(0, inv)
    return cache, colmask
