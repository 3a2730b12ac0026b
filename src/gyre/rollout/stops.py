"""Where a turn ends: stop tokens and stop strings, from config or derived from the tokenizer.

Defaults (``rollout.stop_tokens`` / ``rollout.stop_strings`` left empty):

- stop tokens: the chat template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``, ...; one
  of :data:`END_OF_TURN` that the tokenizer has as a special token or its chat template writes),
  EOS, and the newline token where the newline is one token of the tokenizer (``"\\n"`` encodes
  to a single id that decodes back to ``"\\n"``: the char tokenizer's ``"\\n"``, byte-level BPE's
  ``"Ċ"``);
- stop strings: ``"\\n"`` where the newline token is a stop token, because a byte-level BPE also
  has merged tokens holding a newline (``"ĊĊ"``, ``".Ċ"``) that the single token misses.

The SFT demonstrations end every answer with :attr:`Stops.terminator`: the newline token where it
is a stop token, else the first end-of-turn / EOS stop token, so SFT teaches the policy to end a
turn exactly where the rollout stops it.

Stop strings are applied by the rollout, not the engine (:func:`cut_at_stop`): the sampled ids are
cut after the first token whose decoded prefix contains a stop string, so the trained ids are
exactly the sampled ids kept (token-in/token-out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

END_OF_TURN = (
    "<|im_end|>",  # ChatML: Qwen, Yi, many fine-tunes
    "<|eot_id|>",  # Llama 3
    "<|end|>",  # Phi-3
    "<end_of_turn>",  # Gemma
    "<|eot|>",  # Llama 4
    "<|end_of_turn|>",
)


@dataclass(frozen=True)
class Stops:
    token_ids: tuple[int, ...]  # sorted
    strings: tuple[str, ...]
    terminator: tuple[int, ...]  # what a demonstration's answer ends with


def newline_id(tokenizer: Any) -> int | None:
    """The id of the newline token when ``"\\n"`` is one token of ``tokenizer``, else None."""
    ids = tokenizer.encode("\n", add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        return None
    return int(ids[0]) if tokenizer.decode(ids) == "\n" else None


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """Ids of the known end-of-turn tokens the tokenizer has as special tokens or its chat
    template writes (in :data:`END_OF_TURN` order)."""
    special = set(getattr(tokenizer, "all_special_tokens", []) or [])
    special |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    template = getattr(tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in END_OF_TURN if t in vocab and (t in special or t in template)]


def _token_id(tokenizer: Any, token: str) -> int:
    vocab = tokenizer.get_vocab()
    if token in vocab:
        return int(vocab[token])
    ids = tokenizer.encode(token, add_special_tokens=False)
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        raise ValueError(
            f"rollout.stop_tokens: {token!r} is not one token of this tokenizer "
            f"(it encodes to {len(ids)} ids); give a token of its vocabulary, or use "
            "rollout.stop_strings for text"
        )
    return int(ids[0])


def derive_stops(
    tokenizer: Any, stop_tokens: Sequence[str] = (), stop_strings: Sequence[str] = ()
) -> Stops:
    """The stop tokens, stop strings and demonstration terminator (see the module docstring);
    ``stop_tokens`` / ``stop_strings`` from config replace the derived ones when not empty."""
    nl = newline_id(tokenizer)
    if stop_tokens:
        ordered = [_token_id(tokenizer, t) for t in stop_tokens]
    else:
        ordered = end_of_turn_ids(tokenizer)
        if tokenizer.eos_token_id is not None:
            ordered.append(int(tokenizer.eos_token_id))
        if nl is not None:
            ordered.append(nl)
    unk = tokenizer.unk_token_id
    ordered = [i for i in dict.fromkeys(ordered) if i != unk]
    if stop_strings:
        strings = tuple(stop_strings)
    else:
        strings = ("\n",) if nl is not None and nl in ordered else ()
    if nl is not None and nl in ordered:
        terminator: tuple[int, ...] = (nl,)
    elif ordered:
        terminator = (ordered[0],)
    else:  # no stop token at all: only max_new_tokens ends a turn; keep the text protocol
        terminator = tuple(tokenizer.encode("\n", add_special_tokens=False))
    return Stops(tuple(sorted(ordered)), strings, terminator)


def cut_at_stop(
    token_ids: Sequence[int], strings: Sequence[str], decode: Callable[[tuple[int, ...]], str]
) -> int | None:
    """The length of the shortest prefix of ``token_ids`` whose decoded text contains one of
    ``strings`` (None: none does). ``decode`` maps a tuple of ids to text."""
    if not strings or not token_ids:
        return None
    if not any(s in decode(tuple(token_ids)) for s in strings):
        return None
    lo, hi = 1, len(token_ids)  # the answer lies in [lo, hi]: containing is monotone in length
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(tuple(token_ids[:mid])) for s in strings):
            hi = mid
        else:
            lo = mid + 1
    return lo
