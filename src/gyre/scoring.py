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

Both give the same log-probs, entropies and gradients as the plain path (tested, fp32
tolerance). Switches (for measuring, see docs/performance.md): ``GYRE_PACK=0`` and
``GYRE_LOGPROB_CHUNK=0`` (0 = no chunking: one full-vocab pass, as before).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from gyre.sampling import sampling_logprobs


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from e


@dataclass
class ScoringOptions:
    """How :func:`gyre.policy.token_logprobs` scores a batch (defaults read from the env)."""

    pack: bool = True
    chunk: int = 1024  # positions per LM-head / log-softmax chunk; 0 = all at once

    @classmethod
    def from_env(cls) -> ScoringOptions:
        return cls(
            pack=_env_int("GYRE_PACK", 1) != 0,
            chunk=max(0, _env_int("GYRE_LOGPROB_CHUNK", 1024)),
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


def pack_rows(input_ids: torch.Tensor, lengths: list[int], pad_token_id: int) -> Packed:
    """First-fit decreasing bin packing of the rows of a right-padded batch.

    Row width W is the longest length, so no trajectory is split. The tail of a packed row is
    padding with positions 0, 1, ... (a segment of its own that nothing reads).
    """
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
    ids = torch.full((len(bins), width), pad_token_id, dtype=torch.long, device=input_ids.device)
    pos = torch.zeros((len(bins), width), dtype=torch.long, device=input_ids.device)
    for r, members in enumerate(bins):
        col = 0
        for i in members:
            n = lengths[i]
            ids[r, col : col + n] = input_ids[i, :n]
            pos[r, col : col + n] = torch.arange(n, device=input_ids.device)
            col += n
        pos[r, col:] = torch.arange(width - col, device=input_ids.device)
    dev = input_ids.device
    return Packed(ids, pos, torch.tensor(row, device=dev), torch.tensor(offset, device=dev))


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


def chunked_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    pad_token_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    options: ScoringOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Log-prob and entropy (B, T) of every real token given its prefix; 0 at position 0 and on
    padding. Returns None if the model's logits are not a plain linear head over its decoder
    (the caller then uses the full-logits path)."""
    opts = options or ScoringOptions.from_env()
    parts = _head_and_body(model)
    if parts is None:
        return None
    decoder, head = parts
    B, T = input_ids.shape
    lengths = attention_mask.sum(dim=1).tolist()
    lengths = [int(n) for n in lengths]
    if min(lengths) < 1:
        raise ValueError("every row needs at least one real token")
    # (b, t) of every scored position: a real token with a real predecessor, t >= 1
    need = attention_mask.bool().clone()
    need[:, 0] = False
    b_idx, t_idx = need.nonzero(as_tuple=True)
    packed = None
    if opts.pack and B > 1 and packing_supported(decoder):
        packed = pack_rows(input_ids, lengths, pad_token_id)
        if packed.num_positions > PACK_MIN_SAVING * B * T:
            packed = None  # rows of similar length: packing would save too little to pay
    if packed is not None:
        hidden = decoder(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,
            use_cache=False,  # with a cache, HF would not build the per-segment causal mask
        ).last_hidden_state
        src_row, src_col = packed.row[b_idx], packed.offset[b_idx] + t_idx - 1
    else:
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        src_row, src_col = b_idx, t_idx - 1
    h = hidden[src_row, src_col]  # (N, H): the state that predicts token (b, t)
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
