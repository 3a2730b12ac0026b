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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils.checkpoint import checkpoint

from gyre.models.lean import LeanForward, lean_for
from gyre.models.sampling import sampling_logprobs
from gyre.trainer.packing import (
    PACK_MIN_SAVING,
    first_fit_rows,
    pack_rows,
    packing_supported,
    plan_tree,
)

if TYPE_CHECKING:
    from gyre.config import PerfConfig

# The id a packed or tree layout puts in its filler positions: no scored token attends to them
# and none is scored, so any id does; 0 exists in every vocabulary.
FILLER_ID = 0


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
        # p * logp in place (one vocab-sized temporary, not four: at a 49k vocabulary each is
        # 200 MB per 1024 positions); 0 * -inf (a top-p-cut token) is NaN, and counts 0
        p = logp.exp()
        ent = -p.mul_(logp).nan_to_num_(nan=0.0).sum(-1)
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
    b_idx, t_idx, in_len = _scored_positions(input_ids, attention_mask, score_mask, opts)
    keep = (in_len > 0).nonzero().flatten()
    if len(keep) == 0:  # nothing to score (e.g. a micro-batch of failed episodes)
        return _nothing_to_score(model, head, B, T)
    T_in = int(in_len.max())
    if len(keep) < B:  # rows with nothing to score are not computed at all
        where = torch.full((B,), -1, dtype=torch.long, device=input_ids.device)
        where[keep] = torch.arange(len(keep), device=input_ids.device)
        ids_in, mask_in, row_in = input_ids[keep, :T_in], attention_mask[keep, :T_in], where[b_idx]
    else:
        ids_in, mask_in, row_in = input_ids[:, :T_in], attention_mask[:, :T_in], b_idx
    lengths = [int(n) for n in in_len[keep].tolist()]
    rows = _InputRows(ids_in, mask_in, lengths, row_in, t_idx)
    hidden, src_row, src_col = _predicting_states(model, decoder, opts, rows)
    h = gather_states(hidden, src_row, src_col)  # (N, H): the state that predicts (b, t)
    flat_tok, flat_ent = _score_states(h, input_ids[b_idx, t_idx], head, temperature, top_p, opts)
    lp = flat_tok.new_zeros(B, T).index_put((b_idx, t_idx), flat_tok)
    ent = flat_ent.new_zeros(B, T).index_put((b_idx, t_idx), flat_ent.detach())
    return lp, ent


def _scored_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor | None,
    opts: ScoringOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, t) of every scored position -- a real token with a real predecessor, inside
    ``score_mask`` -- and how many input positions each row needs (B,)."""
    B, T = input_ids.shape
    lengths = [int(n) for n in attention_mask.sum(dim=1).tolist()]
    if min(lengths) < 1:
        raise ValueError("every row needs at least one real token")
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
    return b_idx, t_idx, in_len


def _nothing_to_score(
    model: torch.nn.Module, head: torch.nn.Module, B: int, T: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros in the graph, as a forward's output would be: a loss built on them
    backpropagates, and every parameter gets a zero gradient."""
    zeros = head.weight.new_zeros(B, T)
    if torch.is_grad_enabled():
        trainable = [p.reshape(-1)[:1] for p in model.parameters() if p.requires_grad]
        if trainable:
            zeros = zeros + 0.0 * torch.cat(trainable).sum()
    return zeros, head.weight.new_zeros(B, T)


@dataclass(frozen=True)
class _InputRows:
    """The rows a scoring forward runs over: their ids and mask (B_in, T_in), real lengths,
    and per scored position its input row and column."""

    ids: torch.Tensor
    mask: torch.Tensor
    lengths: list[int]
    row: torch.Tensor
    col: torch.Tensor


def _predicting_states(
    model: torch.nn.Module, decoder: torch.nn.Module, opts: ScoringOptions, rows: _InputRows
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder's last hidden states over the chosen layout -- tree-packed, packed or padded
    -- and, per scored position, the (row, column) of the state that predicts it."""
    ids_in, mask_in, lengths, row_in, t_idx = rows.ids, rows.mask, rows.lengths, rows.row, rows.col
    B_in, T_in = ids_in.shape
    device = ids_in.device
    lean = lean_for(model, opts.lean)

    @functools.cache
    def plain_or_packed() -> tuple[int, int]:
        """(rows, width) of the layout used if not tree-packed."""
        if opts.pack and B_in > 1 and (lean is not None or packing_supported(decoder)):
            n_rows = len(first_fit_rows(lengths)[0])  # the packed shape, before building anything
            if n_rows * max(lengths) <= PACK_MIN_SAVING * B_in * T_in:
                return (n_rows, max(lengths))
            # else: rows of similar length, packing would save too little to pay
        return (B_in, T_in)

    tree = None
    if lean is not None and opts.share_prefix and B_in > 1:
        tree = plan_tree(model, ids_in, lengths, FILLER_ID, plain_or_packed)
    if tree is not None:
        assert lean is not None
        dtype = lean.inner.embed_tokens.weight.dtype
        hidden = lean.hidden(
            tree.input_ids, tree.position_ids, LeanForward.additive(tree.allowed[:, None], dtype)
        )
        bl, tl = row_in.tolist(), t_idx.tolist()
        pairs = list(zip(bl, tl, strict=True))
        src_row = torch.tensor([tree.loc_row[b][t - 1] for b, t in pairs], device=device)
        src_col = torch.tensor([tree.loc_col[b][t - 1] for b, t in pairs], device=device)
        return hidden, src_row.long(), src_col.long()
    if plain_or_packed() != (B_in, T_in):
        packed = pack_rows(ids_in, lengths, FILLER_ID)
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
        return hidden, packed.row[row_in], packed.offset[row_in] + t_idx - 1
    if lean is not None:
        dtype = lean.inner.embed_tokens.weight.dtype
        pos = torch.arange(T_in, device=device)[None].expand(B_in, T_in)
        hidden = lean.hidden(ids_in, pos, lean.padded_mask(mask_in, dtype))
    else:
        hidden = decoder(
            input_ids=ids_in, attention_mask=mask_in, use_cache=False
        ).last_hidden_state
    return hidden, row_in, t_idx - 1


def _score_states(
    h: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    top_p: float,
    opts: ScoringOptions,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LM head + log-softmax over the predicting states, ``opts.chunk`` at a time (each chunk
    under activation checkpointing when training): flat log-probs and entropies (N,)."""
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
    return flat_tok, flat_ent
