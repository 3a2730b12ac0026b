"""The grouped decode layout and shared-prefix ("cascade") decode attention of the lean forward.

When the engine forks a group's prompt (prefix sharing), the cache layers it forks get one of two
layouts, which one-token decode steps of :meth:`gyre.models.lean.LeanForward.hidden` read:

- the grouped layout (:class:`_Group`, a fresh batch of whole forked groups): each group's
  prompt once, then its rows' own tokens step-major in one buffer; decode attention is one
  batched matmul per group and head;
- the per-row layout with a shared prefix (:class:`_Prefix`): the forked prompt columns are
  attended once per group (:func:`cascade_attention`), the rows' own columns per row.

Anything but a one-token decode step writes the per-row layout back first (:func:`ungroup`,
:func:`prepare_cache`). The engine reshapes its cache rows only through :func:`select_kv_rows`
and :func:`ungroup_cache`. Also here: the plain per-row decode attention
(:func:`row_decode_attention`) and the attention softmax both decode paths use.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

SHARED_PREFIX_MIN = 8
"""Forked prefixes at least this long are attended once per group in decode (unless the engine's
``shared_prefix_attention`` is off)."""
GROUP_MAX_STEPS = 128
"""The grouped decode layout (:class:`_Group`) attends every row's query to all G rows' own
columns of its group; past this many decode steps the per-row layout costs less (measured:
at 64 rows x 256 new tokens, about 10 % faster when switching at 16-128 steps; at 64 and 128
new tokens, staying grouped is faster)."""


def _softmax(s: torch.Tensor) -> torch.Tensor:
    """``s.softmax(-1)`` for attention scores. Below 16 columns torch's CPU softmax takes a
    scalar path (256 rows of 13: ~60 us, of 16: ~6 us), which a decode step over a short
    prompt hits in every layer; there the scores are padded to 16 columns of -inf (exactly 0
    after the softmax, which a finite masked maximum keeps) and the padding sliced off."""
    K = s.shape[-1]
    if K >= 16 or s.device.type != "cpu" or s.numel() < 128 * K:
        return s.softmax(-1)
    return F.pad(s, (0, 16 - K), value=float("-inf")).softmax(-1)[..., :K]


def row_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One-query decode attention (B, H, 1, D) -> (B, 1, H*D) over each row's own cache
    (B, H, K, D): two strided ``bmm`` on the cache views, no copy of the cache."""
    B, nh, _, hd = q.shape
    K = k.shape[2]
    s = torch.baddbmm(
        mask.expand(B, nh, 1, K).reshape(B * nh, 1, K),
        q.reshape(B * nh, 1, hd),
        k.reshape(B * nh, K, hd).transpose(1, 2),
        alpha=scale,
    )
    return torch.bmm(_softmax(s), v.reshape(B * nh, K, hd)).view(B, 1, nh * hd)


def prepare_cache(cache: Any, step: bool, shared_attn: bool) -> None:
    """Before a forward over ``cache``: the grouped layout serves one-token decode steps
    (``step``) with shared-prefix attention on, for at most :data:`GROUP_MAX_STEPS` steps;
    otherwise every layer is written back to the per-row layout."""
    if not (step and shared_attn):
        ungroup_cache(cache)  # the grouped layout serves one-token decode steps only
        return
    group = getattr(cache.layers[0], "_gyre_group", None)
    if group is not None and group.steps >= GROUP_MAX_STEPS:
        ungroup_cache(cache)  # long completions: G x own columns cost more than rows


@dataclass
class _Prefix:
    """Columns [0, length) of every row r equal row ``src[r]`` of ``keys``/``values`` (U rows):
    a group's prompt, prefilled once and forked. Decode attention reads them once per group."""

    keys: torch.Tensor  # (U, H, length, D)
    values: torch.Tensor
    src: torch.Tensor  # (B,) long
    length: int


_SRC_MEMO: list[Any] = [None]  # [(old src, idx, new src)]: one src object per select


def _select_src(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``src[idx]``, the same tensor object for every layer of one select (so the grouping
    computed from it is shared by all layers)."""
    memo = _SRC_MEMO[0]  # one read of one tuple: consistent even if another thread writes
    if memo is not None and memo[0] is src and memo[1] is idx:
        return memo[2]
    new = src.index_select(0, idx)
    _SRC_MEMO[0] = (src, idx, new)
    return new


def select_kv_rows(
    layer: Any, idx: torch.Tensor, fork_min: int = SHARED_PREFIX_MIN, group: bool = True
) -> None:
    """Keep rows ``idx`` of a DynamicLayer; a lean-owned buffer is gathered whole, so the
    layer keeps its spare capacity (no reallocation at the next append).

    A fork (``idx`` repeating rows, as the engine's prefix sharing does) of at least
    ``fork_min`` columns records the pre-fork rows as a shared prefix (:class:`_Prefix`), which
    decode attention then reads once per group instead of once per row. ``group`` (the
    engine's ``shared_prefix_attention``) lets a fork of whole groups take the grouped layout
    (:class:`_Group`); off, forked rows are gathered per row.
    """
    if getattr(layer, "_gyre_group", None) is not None and not _repeats(idx):
        ungroup(layer, idx)  # the kept rows, written once in the per-row layout
        return
    ungroup(layer)
    buf = getattr(layer, "_gyre_buf", None)
    keys = layer.keys
    own = buf is not None and keys.data_ptr() == buf[0].data_ptr()
    if own and keys.stride() == buf[0].stride():
        L = keys.shape[2]
        pre = getattr(layer, "_gyre_prefix", None)
        G = _fork_groups(idx) if pre is None and group else 0
        if G:
            heads = idx[::G]  # the source row of each group of G forked rows
            layer._gyre_group = _Group.fork(
                keys.index_select(0, heads), layer.values.index_select(0, heads), G
            )
            layer._gyre_prefix = None
            layer.keys = layer.values = None  # stale while grouped: ungroup() restores them
            return
        if pre is not None:
            pre = _Prefix(pre.keys, pre.values, _select_src(pre.src, idx), pre.length)
        elif L >= fork_min and idx.numel() > keys.shape[0]:
            pre = _Prefix(keys, layer.values, idx, L)
        bk, bv = buf[0].index_select(0, idx), buf[1].index_select(0, idx)
        layer._gyre_buf = (bk, bv)
        layer._gyre_prefix = pre
        layer.keys, layer.values = bk[:, :, :L], bv[:, :, :L]
        return
    layer._gyre_prefix = None
    layer.keys = keys.index_select(0, idx)
    layer.values = layer.values.index_select(0, idx)


_GROUPING: list[Any] = [None]  # [(src, grouping)]


def _grouping(src: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gidx (U*G,) row index per group slot, B for an empty slot; rowpos (B,) slot of each
    row; G = the largest group), cached for the last ``src`` object."""
    memo = _GROUPING[0]
    if memo is not None and memo[0] is src:
        return memo[1]
    B = src.shape[0]
    counts = torch.bincount(src, minlength=groups)
    G = int(counts.max())
    order = torch.argsort(src, stable=True)
    start = torch.cumsum(counts, 0) - counts
    slot = torch.empty(B, dtype=torch.long, device=src.device)
    slot[order] = torch.arange(B, device=src.device) - start[src[order]]
    rowpos = src * G + slot
    gidx = torch.full((groups * G,), B, dtype=torch.long, device=src.device)
    gidx[rowpos] = torch.arange(B, device=src.device)
    out = (gidx, rowpos, G)
    _GROUPING[0] = (src, out)
    return out


def cascade_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    pre: _Prefix,
    scale: float,
) -> torch.Tensor:
    """One-query decode attention (B, H, 1, D) -> (B, 1, H*D) over keys whose first
    ``pre.length`` columns are a shared prefix: scores and weighted values of the prefix are
    computed per group (one small matmul per group and head, reading each prefix once), the
    row's own columns per row; one softmax over both (the same maths as plain attention)."""
    B, H, _, D = q.shape
    K, L0 = k.shape[2], pre.length
    U = pre.keys.shape[0]
    gidx, rowpos, G = _grouping(pre.src, U)
    q3 = q.reshape(B, H, D)
    qpad = torch.cat([q3, q3.new_zeros(1, H, D)])[gidx]  # (U*G, H, D)
    qg = qpad.view(U, G, H, D).transpose(1, 2).reshape(U * H, G, D)
    sp = torch.bmm(qg, pre.keys.reshape(U * H, L0, D).transpose(1, 2))  # (U*H, G, L0)
    sp = sp.view(U, H, G, L0).transpose(1, 2).reshape(U * G, H, L0)[rowpos]  # (B, H, L0)
    ks = k[:, :, L0:].reshape(B * H, K - L0, D)
    ss = torch.bmm(q.reshape(B * H, 1, D), ks.transpose(1, 2)).view(B, H, K - L0)
    p = (torch.cat([sp, ss], dim=-1) * scale + mask.view(B, 1, K)).softmax(-1)
    pg = p.new_zeros(U * G, H, L0)
    pg[rowpos] = p[..., :L0]
    op = torch.bmm(
        pg.view(U, G, H, L0).transpose(1, 2).reshape(U * H, G, L0),
        pre.values.reshape(U * H, L0, D),
    )
    op = op.view(U, H, G, D).transpose(1, 2).reshape(U * G, H, D)[rowpos]
    vs = v[:, :, L0:].reshape(B * H, K - L0, D)
    os_ = torch.bmm(p[..., L0:].reshape(B * H, 1, K - L0), vs).view(B, H, D)
    return (op + os_).view(B, 1, H * D)


def _repeats(idx: torch.Tensor) -> bool:
    """Whether ``idx`` names some row more than once (a fork rather than a selection)."""
    return idx.numel() > 1 and bool((idx.sort().values.diff() == 0).any())


def _fork_groups(idx: torch.Tensor) -> int:
    """G >= 2 when ``idx`` is a fork into consecutive groups of G equal rows (a prompt asked
    k x G times, e.g. a task drawn twice, makes k groups of the same source); else 0."""
    n = idx.numel()
    if n < 2:
        return 0
    starts = torch.ones(n, dtype=torch.bool, device=idx.device)
    starts[1:] = idx[1:] != idx[:-1]
    bounds = [*starts.nonzero().flatten().tolist(), n]
    G = math.gcd(*(b - a for a, b in itertools.pairwise(bounds)))
    return G if G >= 2 else 0


class _Group:
    """Decode cache of B = U x G rows forked from U prompts, G rows each, in group order.

    A group's keys (values alike) live in one buffer row ``(H, L0 + G x cap, D)``: the prompt
    once (columns ``[0, L0)``), then the rows' own tokens step-major (column
    ``L0 + t x G + g`` is row g's token t), so one decode step appends one contiguous block
    per group and the keys visible at step t are a contiguous prefix of the buffer. Decode
    attention is then one batched matmul per group and head for scores and one for values,
    over the prompt and every row's own columns, with a fixed mask that lets row g see the
    prompt (its real columns) and its own columns only: the same softmax as per-row attention
    (masked terms are exactly 0), with no per-row copy of the prompt (the fork copies nothing
    but the prompt, once) and a handful of ops instead of per-row gathers.

    Anything but a one-token decode step (compaction, a snapshot, merging an admission, a
    prefill chunk, the Hugging Face forward) first calls :func:`ungroup`, which writes the
    standard per-row layout back (and keeps the prompt as a shared prefix).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prefix: int, G: int) -> None:
        self.keys, self.values = keys, values  # (U, H, L0 + G * cap, D)
        self.prefix, self.G, self.steps = prefix, G, 0
        self.rep = 1  # query heads per key/value head (set by every step)
        self.mask: torch.Tensor | None = None  # (U, H, rep*G, width) additive, 1st step

    @classmethod
    def fork(cls, keys: torch.Tensor, values: torch.Tensor, G: int, cap: int = 16) -> _Group:
        U, H, L0, D = keys.shape
        gk = keys.new_empty(U, H, L0 + G * cap, D)
        gv = values.new_empty(U, H, L0 + G * cap, D)
        gk[:, :, :L0].copy_(keys)
        gv[:, :, :L0].copy_(values)
        return cls(gk, gv, L0, G)

    @property
    def width(self) -> int:
        return int(self.keys.shape[2])

    @property
    def capacity(self) -> int:
        return (self.keys.shape[2] - self.prefix) // self.G

    def _grow(self) -> None:
        U, H, _, D = self.keys.shape
        used = self.prefix + self.G * self.steps
        width = self.prefix + self.G * 2 * max(self.capacity, 8)
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(U, H, width, D)
            new[:, :, :used].copy_(old[:, :, :used])
            setattr(self, name, new)
        if self.mask is not None:
            self.mask = self._build_mask(self.mask[:, 0, 0, : self.prefix])

    def _build_mask(self, prefix_mask: torch.Tensor) -> torch.Tensor:
        """(U, H, rep x G, width) additive mask from the prompt's (U, L0) additive mask: query
        row ``r * G + g`` (query head r of a key/value head, sample g) sees the prompt and
        sample g's own columns."""
        U, H, width, _ = self.keys.shape
        G, L0, rep = self.G, self.prefix, self.rep
        cap = (width - L0) // G
        own = torch.eye(G, dtype=torch.bool, device=self.keys.device).repeat(rep, cap)
        neg = torch.finfo(prefix_mask.dtype).min
        own_add = torch.where(own, 0.0, neg).to(prefix_mask.dtype)  # (rep*G, G*cap)
        m = torch.empty(U, rep * G, width, dtype=prefix_mask.dtype, device=prefix_mask.device)
        m[:, :, :L0] = prefix_mask[:, None, :]
        m[:, :, L0:] = own_add[None]
        return m[:, None].expand(U, H, rep * G, width).contiguous()

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Append this step's (B, Hkv, 1, D) keys/values, attend (B, Hq, 1, D) queries; returns
        (B, 1, Hq*D). ``mask`` is the engine's (B, 1, 1, K) additive mask (its prompt columns
        give each group's prompt padding, read once). Grouped-query attention (Hq = rep x Hkv,
        query head h reading key/value head h // rep) stacks a key/value head's rep query
        heads and G samples into one (rep x G)-row matmul."""
        B, Hq, _, D = q.shape
        H = k.shape[1]
        rep = Hq // H
        G, L0 = self.G, self.prefix
        U = B // G
        self.rep = rep  # before _grow: it rebuilds the mask
        if self.steps >= self.capacity:
            self._grow()
        if self.mask is None:
            self.mask = self._build_mask(mask[::G, 0, 0, :L0])
        c = L0 + self.steps * G
        self.keys[:, :, c : c + G].copy_(k.reshape(U, G, H, D).transpose(1, 2))
        self.values[:, :, c : c + G].copy_(v.reshape(U, G, H, D).transpose(1, 2))
        self.steps += 1
        K = c + G
        width = self.keys.shape[2]
        R = rep * G  # query rows per (group, key/value head)
        qg = q.reshape(U, G, H, rep, D).permute(0, 2, 3, 1, 4).reshape(U * H, R, D)
        keys = self.keys.view(U * H, width, D)[:, :K]
        s = torch.baddbmm(
            self.mask.view(U * H, R, width)[:, :, :K], qg, keys.transpose(1, 2), alpha=scale
        )
        o = torch.bmm(_softmax(s), self.values.view(U * H, width, D)[:, :K])
        return o.view(U, H, rep, G, D).permute(0, 3, 1, 2, 4).reshape(B, 1, Hq * D)

    def standard(
        self, steps: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(buffer keys, buffer values, keys view, values view) in the per-row layout after
        ``steps`` decode steps (default: all so far): row u*G + g holds the prompt of group
        u, then its own tokens. The group's written columns never change, so an earlier
        ``steps`` gives the cache as it was then."""
        return self.rows(torch.arange(self.keys.shape[0] * self.G), steps)

    def rows(
        self, idx: torch.Tensor, steps: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`standard` of rows ``idx`` only (compaction keeps the live rows: one gather)."""
        U, H, _, D = self.keys.shape
        G, L0 = self.G, self.prefix
        t = self.steps if steps is None else steps
        L = L0 + t
        idx = idx.to(self.keys.device)
        grp, slot = idx // G, idx % G
        cap = max(2 * L, L + 16)
        out = []
        for g in (self.keys, self.values):
            buf = g.new_empty(idx.numel(), H, cap, D)
            buf[:, :, :L0].copy_(g[:, :, :L0].index_select(0, grp))
            own = g[:, :, L0 : L0 + t * G].reshape(U, H, t, G, D)
            buf[:, :, L0:L].copy_(own[grp, :, :, slot])  # (n, H, t, D)
            out.append(buf)
        return out[0], out[1], out[0][:, :, :L], out[1][:, :, :L]


def ungroup(layer: Any, idx: torch.Tensor | None = None) -> None:
    """Write a grouped layer (:class:`_Group`) back to the per-row layout -- only rows ``idx``
    when given (a compaction) -- keeping the prompt as a shared prefix for decode attention
    when it is long enough; no-op for a layer that is not grouped."""
    group = getattr(layer, "_gyre_group", None)
    if group is None:
        return
    if idx is None:
        idx = torch.arange(group.keys.shape[0] * group.G, device=group.keys.device)
    bk, bv, keys, values = group.rows(idx)
    layer._gyre_group = None
    layer._gyre_buf = (bk, bv)
    layer.keys, layer.values = keys, values
    L0 = group.prefix
    if L0 >= SHARED_PREFIX_MIN:
        src = idx.to(bk.device) // group.G
        # copies of the prompt columns, so the group's (much wider) buffers can be freed
        pk, pv = group.keys[:, :, :L0].clone(), group.values[:, :, :L0].clone()
        layer._gyre_prefix = _Prefix(pk, pv, src, L0)
    else:
        layer._gyre_prefix = None


def ungroup_cache(cache: Any) -> None:
    """:func:`ungroup` every layer of a DynamicCache."""
    for layer in cache.layers:
        if getattr(layer, "_gyre_group", None) is not None:
            ungroup(layer)
