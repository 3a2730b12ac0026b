"""Fast token scoring for the trainer: sequence packing and chunked log-probs.

Two things waste most of a training forward on RL batches:

- **Padding.** A right-padded batch costs B x T_max positions although only the real tokens
  matter. :func:`pack_rows` puts several trajectories into one row (first-fit decreasing, row
  width = the longest trajectory) with position ids restarting at 0 for each; Hugging Face
  models then build a block-diagonal causal mask from the position ids (``attention_mask=None``,
  no cache), so a token attends only to its own trajectory -- exactly what it saw unpacked.
- **The full-vocabulary log-softmax.** Scoring materialises (positions x vocab) logits and
  log-probs, twice more for backward. :func:`chunked_token_logprobs` runs the LM head and the
  log-softmax over the *real* positions only, ``chunk`` positions at a time, each chunk under
  activation checkpointing, so autograd keeps only the hidden states and recomputes one
  chunk's logits in backward.

- **Shared prefixes.** The G samples of a GRPO group repeat the same prompt. With the lean
  forward (:mod:`gyre.models.lean`, Llama-family models) :func:`tree_pack` lays a group out once as
  ``[prefix, suffix_1, ..., suffix_G]`` with a tree mask (a suffix sees the prefix and itself),
  so the prompt is computed once per group in forward and backward; it is used when its
  estimated cost (positions x per-token FLOPs + rows x width^2 x attention FLOPs) is at most
  ``TREE_MIN_SAVING`` of the padded or packed layout's.

- **Positions nothing reads.** A row's last token predicts nothing and, attention being
  causal, no other token attends to it; with a ``score_mask`` (the trainer passes the loss
  mask) the same holds for everything after the row's last scored token. Those positions are
  not fed at all. On GRPO batches of short answers that is a large share of the batch: with
  64 answers of 2-3 tokens after 8 shared prompts, one position in three.

All give the same log-probs, entropies and gradients as the plain path (tested, fp32
tolerance). Each is a :class:`ScoringOptions` field, set from the run config's ``perf:``
section (:meth:`ScoringOptions.from_perf`; docs/performance.md): ``perf.pack``,
``perf.logprob_chunk`` (0 = no chunking: one full-vocab pass), ``perf.train_lean_forward``
(Hugging Face forward when off), ``perf.share_prefix`` (tree packing) and ``perf.score_trim``
(off: feed whole rows, each row's last token included).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from gyre.models.lean import LeanForward, lean_for
from gyre.models.sampling import sampling_logprobs

if TYPE_CHECKING:
    from gyre.config import PerfConfig


@dataclass(frozen=True)
class ScoringOptions:
    """How :func:`gyre.trainer.batch.token_logprobs` scores a batch. The defaults are those of
    the ``perf:`` config section; a run builds its options with :meth:`from_perf`."""

    pack: bool = True
    chunk: int = 1024  # positions per LM-head / log-softmax chunk; 0 = all at once
    lean: bool = True  # the lean forward for Llama-family models (gyre.models.lean)
    share_prefix: bool = True  # tree packing of shared prefixes (needs the lean forward)
    trim: bool = True  # feed only the positions a scored token needs (off: whole rows)

    @classmethod
    def from_perf(cls, perf: PerfConfig) -> ScoringOptions:
        """The trainer's options of a run's ``perf:`` section."""
        return cls(
            pack=perf.pack,
            chunk=perf.logprob_chunk,
            lean=perf.train_lean_forward,
            share_prefix=perf.share_prefix,
            trim=perf.score_trim,
        )


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


def _ffd(lengths: list[int]) -> tuple[list[list[int]], list[int], list[int]]:
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
    bins, row, offset = _ffd(lengths)
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


def _fsdp_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FSDPModule)


def _head_and_body(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, lm_head) when logits are exactly ``lm_head(decoder(...))``, else None."""
    if _fsdp_sharded(model):
        return None  # FSDP2 gathers the root's weights in the root's forward: call that one
    get_dec = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    if get_dec is None or get_head is None:
        return None
    cfg = getattr(model, "config", None)
    if cfg is not None and (
        getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None)
    ):
        return None  # logits are post-processed after the head
    try:
        dec, head = get_dec(), get_head()
    except (AttributeError, NotImplementedError):
        return None
    if dec is None or dec is model or not isinstance(head, torch.nn.Linear):
        return None
    return dec, head


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


def _score_chunk(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    top_p: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logp = sampling_logprobs(logits, temperature, top_p)
    tok = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        p = logp.exp()
        ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return tok, ent


def gather_states(hidden: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``hidden[rows, cols]`` (N, H) of a (R, W, H) tensor, with a reproducible backward.

    Tree packing repeats positions (a shared prefix's last state predicts the first token of
    every suffix). The backward of advanced indexing, ``index_put_(accumulate=True)``, adds
    float gradients with parallel atomics on CPU at more than one thread, so repeated rows sum
    in a varying order and the bits change from run to run. ``index_select``'s backward
    (``index_add_``) adds them serially in index order: the same bits at any thread count, and
    the same as advanced indexing at one thread.
    """
    return hidden.flatten(0, 1).index_select(0, rows * hidden.shape[1] + cols)


def chunked_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    options: ScoringOptions | None = None,
    score_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Log-prob and entropy (B, T) of every real token given its prefix; 0 at position 0 and on
    padding. Returns None if the model's logits are not a plain linear head over its decoder
    (the caller then uses the full-logits path).

    ``score_mask`` (B, T) limits the work to the tokens whose log-prob is wanted (the loss
    mask); the others read 0. Either way the forward runs only over the positions some scored
    token needs: row b's tokens before its last scored one. A row's last token is never an
    input (nothing predicts from it and, attention being causal, nothing attends to it), nor
    is anything after the last scored token; rows with nothing to score are left out.
    """
    opts = options if options is not None else ScoringOptions()
    parts = _head_and_body(model)
    if parts is None:
        return None
    decoder, head = parts
    B, T = input_ids.shape
    lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
    if min(lengths) < 1:
        raise ValueError("every row needs at least one real token")
    # (b, t) of every scored position: a real token with a real predecessor, t >= 1
    need = attention_mask.bool().clone()
    need[:, 0] = False
    if score_mask is not None:
        if score_mask.shape != input_ids.shape:
            raise ValueError(f"score_mask has shape {tuple(score_mask.shape)}, input_ids {(B, T)}")
        need &= score_mask.bool()
    b_idx, t_idx = need.nonzero(as_tuple=True)
    # Inputs row b needs: positions 0 .. (last scored t) - 1
    cols = torch.arange(T, device=input_ids.device)
    in_len = torch.where(need, cols, 0).amax(dim=1)  # (B,)
    if not opts.trim:  # whole rows, every row (for measuring what trimming buys)
        in_len = attention_mask.sum(dim=1)
    keep = (in_len > 0).nonzero().flatten()
    if len(keep) == 0:  # nothing to score (e.g. a micro-batch of failed episodes)
        zeros = head.weight.new_zeros(B, T)
        if torch.is_grad_enabled():  # in the graph, as a forward's output would be: a loss
            # built on it backpropagates, and every parameter gets a zero gradient
            trainable = [p.reshape(-1)[:1] for p in model.parameters() if p.requires_grad]
            if trainable:
                zeros = zeros + 0.0 * torch.cat(trainable).sum()
        return zeros, head.weight.new_zeros(B, T)
    T_in = int(in_len.max())
    if len(keep) < B:  # rows with nothing to score are not computed at all
        where = torch.full((B,), -1, dtype=torch.long, device=input_ids.device)
        where[keep] = torch.arange(len(keep), device=input_ids.device)
        ids_in, mask_in, row_in = input_ids[keep, :T_in], attention_mask[keep, :T_in], where[b_idx]
    else:
        ids_in, mask_in, row_in = input_ids[:, :T_in], attention_mask[:, :T_in], b_idx
    lengths = [int(n) for n in in_len[keep].tolist()]
    B_in = len(lengths)
    lean = lean_for(model, opts.lean)
    packed = None

    @functools.cache
    def plain_or_packed() -> tuple[int, int]:
        """(rows, width) of the layout used if not tree-packed."""
        if opts.pack and B_in > 1 and (lean is not None or packing_supported(decoder)):
            n_rows = len(_ffd(lengths)[0])  # the packed shape, before building anything
            if n_rows * max(lengths) <= PACK_MIN_SAVING * B_in * T_in:
                return (n_rows, max(lengths))
            # else: rows of similar length, packing would save too little to pay
        return (B_in, T_in)

    tree = None
    if lean is not None and opts.share_prefix and B_in > 1:
        tree = plan_tree(model, ids_in, lengths, pad_token_id, plain_or_packed)
    if tree is None and plain_or_packed() != (B_in, T_in):
        packed = pack_rows(ids_in, lengths, pad_token_id)
    if tree is not None:
        assert lean is not None
        dtype = lean.inner.embed_tokens.weight.dtype
        hidden = lean.hidden(
            tree.input_ids, tree.position_ids, LeanForward.additive(tree.allowed[:, None], dtype)
        )
        bl, tl = row_in.tolist(), t_idx.tolist()
        src_row = torch.tensor(
            [tree.loc_row[b][t - 1] for b, t in zip(bl, tl, strict=True)],
            dtype=torch.long,
            device=input_ids.device,
        )
        src_col = torch.tensor(
            [tree.loc_col[b][t - 1] for b, t in zip(bl, tl, strict=True)],
            dtype=torch.long,
            device=input_ids.device,
        )
    elif packed is not None:
        if lean is not None:
            dtype = lean.inner.embed_tokens.weight.dtype
            mask = lean.segment_mask(packed.position_ids, dtype)
            hidden = lean.hidden(packed.input_ids, packed.position_ids, mask)
        else:
            hidden = decoder(
                input_ids=packed.input_ids,
                position_ids=packed.position_ids,
                attention_mask=None,
                use_cache=False,  # with a cache, HF would not build the per-segment causal mask
            ).last_hidden_state
        src_row, src_col = packed.row[row_in], packed.offset[row_in] + t_idx - 1
    else:
        if lean is not None:
            dtype = lean.inner.embed_tokens.weight.dtype
            pos = torch.arange(T_in, device=input_ids.device)[None].expand(B_in, T_in)
            hidden = lean.hidden(ids_in, pos, lean.padded_mask(mask_in, dtype))
        else:
            hidden = decoder(
                input_ids=ids_in, attention_mask=mask_in, use_cache=False
            ).last_hidden_state
        src_row, src_col = row_in, t_idx - 1
    h = gather_states(hidden, src_row, src_col)  # (N, H): the state that predicts (b, t)
    targets = input_ids[b_idx, t_idx]
    N = h.shape[0]
    step = opts.chunk if opts.chunk > 0 else max(N, 1)
    toks, ents = [], []
    for s in range(0, N, step):
        args = (h[s : s + step], targets[s : s + step], head.weight, head.bias, temperature, top_p)
        if torch.is_grad_enabled() and opts.chunk > 0 and N > step:
            tok, ent = checkpoint(_score_chunk, *args, use_reentrant=False)
        else:
            tok, ent = _score_chunk(*args)
        toks.append(tok)
        ents.append(ent)
    flat_tok = torch.cat(toks) if toks else h.new_zeros(0)
    flat_ent = torch.cat(ents) if ents else h.new_zeros(0)
    lp = flat_tok.new_zeros(B, T).index_put((b_idx, t_idx), flat_tok)
    ent = flat_ent.new_zeros(B, T).index_put((b_idx, t_idx), flat_ent.detach())
    return lp, ent
