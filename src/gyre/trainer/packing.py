"""Layouts for the trainer's forward: sequence packing and tree packing of shared prefixes.

- :func:`pack_rows` puts several trajectories into one row (first-fit decreasing, row width =
  the longest trajectory) with position ids restarting at 0 for each; the model then attends
  only within each trajectory (a block-diagonal mask).
- :func:`tree_pack` lays a GRPO group out once as ``[prefix, suffix_1, ..., suffix_G]`` with a
  tree mask (a suffix sees the prefix and itself), so a shared prompt is computed once.
- :func:`plan_tree` picks the tree layout only when its estimated cost beats the padded or
  packed one (``TREE_MIN_SAVING``).

:mod:`gyre.trainer.scoring` chooses among them and scores the tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Packed:
    """Trajectories packed into rows; ``row``/``offset`` say where row b of the batch went."""

    input_ids: torch.Tensor  # (R, W) long
    position_ids: torch.Tensor  # (R, W) long, restarting at 0 at every trajectory
    row: torch.Tensor  # (B,) packed row of each trajectory
    offset: torch.Tensor  # (B,) first column of each trajectory in its packed row

    @property
    def num_positions(self) -> int:
        return int(self.input_ids.numel())


def first_fit_rows(lengths: list[int]) -> tuple[list[list[int]], list[int], list[int]]:
    """First-fit decreasing into rows of the longest length: (bins, row, offset) per item."""
    B = len(lengths)
    width = max(lengths)
    order = sorted(range(B), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    row = [0] * B
    offset = [0] * B
    for i in order:
        n = lengths[i]
        for r, room in enumerate(free):  # noqa: B007 (r is used after the loop)
            if room >= n:
                break
        else:
            r = len(bins)
            bins.append([])
            free.append(width)
        row[i], offset[i] = r, width - free[r]
        bins[r].append(i)
        free[r] -= n
    return bins, row, offset


def pack_rows(input_ids: torch.Tensor, lengths: list[int], pad_token_id: int) -> Packed:
    """First-fit decreasing bin packing of the rows of a right-padded batch.

    Row width W is the longest length, so no trajectory is split. The tail of a packed row is
    padding with positions 0, 1, ... (a segment of its own that nothing reads).
    """
    bins, row, offset = first_fit_rows(lengths)
    width = max(lengths)
    rows = input_ids.tolist()  # built as lists, converted once (per-row tensor ops cost more)
    ids_l: list[list[int]] = []
    pos_l: list[list[int]] = []
    for members in bins:
        ids_r: list[int] = []
        pos_r: list[int] = []
        for i in members:
            n = lengths[i]
            ids_r += rows[i][:n]
            pos_r += range(n)
        tail = width - len(ids_r)
        ids_l.append(ids_r + [pad_token_id] * tail)
        pos_l.append(pos_r + list(range(tail)))
    dev = input_ids.device
    return Packed(
        torch.tensor(ids_l, dtype=torch.long, device=dev),
        torch.tensor(pos_l, dtype=torch.long, device=dev),
        torch.tensor(row, device=dev),
        torch.tensor(offset, device=dev),
    )


PACK_MIN_SAVING = 0.9
"""Pack only when the packed batch has at most this fraction of the padded batch's positions."""

_PACKING_OK: dict[tuple[type, str], bool] = {}


def packing_supported(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder`` isolates packed segments (checked once per class and attention kind).

    Packing relies on the model turning restarting position ids into a block-diagonal mask;
    a model that ignores them would silently attend across trajectories, so this compares two
    short sequences packed and alone before packing is ever used.
    """
    cfg = getattr(decoder, "config", None)
    key = (type(decoder), str(getattr(cfg, "_attn_implementation", "")))
    if key not in _PACKING_OK:
        vocab = int(getattr(cfg, "vocab_size", 8))
        dev = next(decoder.parameters()).device
        a = torch.arange(3, device=dev) % vocab
        b = (torch.arange(4, device=dev) + 2) % vocab
        with torch.no_grad():
            packed = decoder(
                input_ids=torch.cat([a, b])[None],
                position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]], device=dev),
                attention_mask=None,
                use_cache=False,
            ).last_hidden_state[0, 3:]
            alone = decoder(input_ids=b[None], use_cache=False).last_hidden_state[0]
        _PACKING_OK[key] = bool(torch.allclose(packed, alone, atol=1e-4, rtol=1e-3))
    return _PACKING_OK[key]


TREE_MIN_SAVING = 0.9
"""Tree-pack only when its estimated cost is at most this fraction of the other layout's."""


@dataclass
class TreePacked:
    """Rows laid out as trees ``[prefix, suffix_1, suffix_2, ...]`` (see :func:`tree_pack`)."""

    input_ids: torch.Tensor  # (R, W)
    position_ids: torch.Tensor  # (R, W)
    allowed: torch.Tensor  # (R, W, W) bool: query column may attend to key column
    loc_row: list[list[int]]  # per batch row b, per token t: packed row holding it
    loc_col: list[list[int]]  # ... and its column


TREE_MAX_WIDTH = 2048
"""A tree (shared prefix + its suffixes) is never wider than this many positions (or the longest
row, if longer): the tree layout's attention mask is width x width per packed row."""


def _lcp(a: list[int], b: list[int]) -> int:
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def _prefix_groups(rows: list[list[int]]) -> list[tuple[list[int], int]]:
    """Groups of rows sharing a prefix, as (members, shared prefix length).

    Rows are sorted by their tokens, so rows sharing a prefix are adjacent and the common
    prefix of a run of sorted rows is the smallest common prefix of its neighbours. The runs
    are chosen to save the most positions, sum over groups of (members - 1) x prefix length,
    by dynamic programming over the sorted order (a group never grows wider than
    ``TREE_MAX_WIDTH``). Greedy merging is not enough: a lone row followed by a group of G
    rows sharing a 5-token prompt would otherwise pull the group into a tree that shares only
    the first token. A group of one has prefix length 0.
    """
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    n = len(order)
    if n == 0:
        return []
    lens = [len(rows[i]) for i in order]
    cap = max(TREE_MAX_WIDTH, max(lens))
    adj = [_lcp(rows[order[k - 1]], rows[order[k]]) for k in range(1, n)]  # adj[k-1]: k-1, k
    best = [0] * (n + 1)  # best[i]: most positions saved by grouping the first i rows
    cut = [0] * (n + 1)  # the last group of that best is order[cut[i]:i]
    for i in range(1, n + 1):
        best[i], cut[i] = best[i - 1], i - 1  # row i-1 alone
        p = lens[i - 1]
        total = lens[i - 1]  # sum of the lengths of rows j..i-1
        for j in range(i - 2, -1, -1):  # group order[j:i]
            p = min(p, adj[j])
            if p < 2:  # sharing one token (a BOS) saves next to nothing: stop widening
                break
            total += lens[j]
            if total - (i - 1 - j) * p > cap:
                break
            gain = best[j] + (i - 1 - j) * p
            if gain > best[i]:
                best[i], cut[i] = gain, j
    groups: list[tuple[list[int], int]] = []
    i = n
    while i > 0:
        j = cut[i]
        members = order[j:i]
        if len(members) == 1:
            groups.append((members, 0))
        else:
            groups.append((members, min(adj[j : i - 1])))
        i = j
    groups.reverse()
    return groups


def _tree_bins(
    rows: list[list[int]],
) -> tuple[list[tuple[list[int], int, int]], list[list[int]], int]:
    """(trees as (members, prefix length, size), bins of tree indices, row width): the tree
    layout's shape, cheap to compute before deciding whether to build it."""
    trees = []  # (members, prefix length, size)
    for members, p in _prefix_groups(rows):
        trees.append((members, p, p + sum(len(rows[i]) - p for i in members)))
    width = max(t[2] for t in trees)
    bins: list[list[int]] = []
    free: list[int] = []
    for k in sorted(range(len(trees)), key=lambda k: -trees[k][2]):
        for r, room in enumerate(free):  # noqa: B007 (r is used after the loop)
            if room >= trees[k][2]:
                break
        else:
            r = len(bins)
            bins.append([])
            free.append(width)
        bins[r].append(k)
        free[r] -= trees[k][2]
    return trees, bins, width


def tree_pack(
    rows: list[list[int]],
    pad_token_id: int,
    device: torch.device,
    layout: tuple[list[tuple[list[int], int, int]], list[list[int]], int] | None = None,
) -> TreePacked:
    """Lay out rows sharing a prefix once per group: ``[prefix, suffix_1, ..., suffix_G]``.

    Suffix j's position ids continue the prefix's (p, p+1, ...), and ``allowed`` lets a
    suffix token see the prefix and the earlier tokens of its own suffix only, so every token
    sees exactly the tokens it saw in its own row. Trees are placed in rows of the widest
    tree's width by first-fit decreasing; the padding tail is a segment of its own.
    ``layout`` is :func:`_tree_bins` of ``rows`` when already computed.
    """
    trees, bins, width = layout if layout is not None else _tree_bins(rows)
    R = len(bins)
    ids = [[pad_token_id] * width for _ in range(R)]
    pos = [[0] * width for _ in range(R)]
    seg = [[0] * width for _ in range(R)]  # tree id per column (unique across the batch)
    branch = [[0] * width for _ in range(R)]  # 0: prefix / padding, j >= 1: suffix j
    loc_row = [[0] * len(row) for row in rows]
    loc_col = [[0] * len(row) for row in rows]
    tree_id = 0
    for r, ks in enumerate(bins):
        col = 0
        for k in ks:
            members, p, _ = trees[k]
            tree_id += 1
            first = rows[members[0]]
            for t in range(p):
                ids[r][col + t], pos[r][col + t], seg[r][col + t] = first[t], t, tree_id
            for i in members:
                loc_row[i][:p] = [r] * p
                loc_col[i][:p] = range(col, col + p)
            c = col + p
            for j, i in enumerate(members, start=1):
                row = rows[i]
                for t in range(p, len(row)):
                    ids[r][c], pos[r][c], seg[r][c], branch[r][c] = row[t], t, tree_id, j
                    loc_row[i][t], loc_col[i][t] = r, c
                    c += 1
            col = c
        tree_id += 1
        for c in range(col, width):  # the padding tail: its own causal segment
            pos[r][c], seg[r][c] = c - col, tree_id
    seg_t = torch.tensor(seg, device=device)
    br = torch.tensor(branch, device=device)
    same_tree = seg_t[:, :, None] == seg_t[:, None, :]
    own_branch = (br[:, None, :] == 0) | (br[:, None, :] == br[:, :, None])
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    return TreePacked(
        torch.tensor(ids, device=device),
        torch.tensor(pos, device=device),
        same_tree & own_branch & causal,
        loc_row,
        loc_col,
    )


def _cost_terms(model: torch.nn.Module) -> tuple[float, float]:
    """(FLOPs per position, attention FLOPs per (query, key) pair) of a forward."""
    cfg = model.config
    lean = model.__dict__.get("_gyre_lean")
    n_params = (
        lean.layer_params
        if lean is not None
        else sum(p.numel() for p in model.model.layers.parameters())
    )
    att = (
        4
        * int(cfg.num_hidden_layers)
        * int(cfg.num_attention_heads)
        * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    )
    return 2.0 * n_params, float(att)


def _layout_cost(model: torch.nn.Module, rows: int, width: int) -> float:
    """Estimated forward FLOPs of ``rows`` x ``width`` positions under dense attention."""
    per_pos, per_pair = _cost_terms(model)
    return rows * width * per_pos + rows * width * width * per_pair


def plan_tree(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    lengths: list[int],
    pad_token_id: int,
    other: tuple[int, int] | Callable[[], tuple[int, int]],
) -> TreePacked | None:
    """The tree layout of a right-padded batch when it costs at most ``TREE_MIN_SAVING`` of
    the ``other`` (rows, width) layout, else None. ``other`` may be a function, called only
    if the tree does not already beat every layout without shared prefixes: those compute
    each real position once at least, in rows at least as wide as the longest one."""
    rows = [input_ids[b, : lengths[b]].tolist() for b in range(len(lengths))]
    layout = _tree_bins(rows)
    R, W = len(layout[1]), layout[2]
    cost = _layout_cost(model, R, W)
    per_pos, per_pair = _cost_terms(model)
    n = sum(lengths)
    if cost > TREE_MIN_SAVING * (n * per_pos + n * max(lengths) * per_pair):
        other_cost = _layout_cost(model, *(other() if callable(other) else other))
        if cost > TREE_MIN_SAVING * other_cost:
            return None  # decided before any (R, W, W) mask is built
    return tree_pack(rows, pad_token_id, input_ids.device, layout)
