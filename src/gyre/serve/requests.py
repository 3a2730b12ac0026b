"""``gyre serve``'s request bodies, their limits, and the tokenizer-side request preparation.

Every bound a request can break is here, so a bad value is a 400 that names its field and never
reaches the engine: temperature 0 (greedy) or in ``[MIN_TEMPERATURE, inf)``, finite; top-p in
``(0, 1]``; ``seed`` in ``[0, 2**63)``; ``max_tokens`` at least 1 and within the context;
at most ``MAX_SEQUENCES`` sequences (prompts x ``n``) per request; token ids inside the vocab.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from gyre.types import Completion, GenerationRequest, SamplingParams

MIN_TEMPERATURE = 1e-2
"""The smallest non-zero temperature. Below it logits / T overflows float32 for ordinary logits
(1e-300 becomes 0, so every logit is +-inf and the logprobs NaN), and in float32 nothing between
0 and 1e-2 samples visibly differently from greedy: send 0 for greedy. vLLM clamps to the same
floor."""
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes any int64 / uint64; keep int64
MAX_NEW_TOKENS = 1 << 20  # an absolute cap when a model does not state its context length
MAX_SEQUENCES = 4096  # prompts x n in one request
MAX_TOOLS = 128  # tools (or one message's tool calls) in a chat request
MAX_JSON_CONTAINERS = MAX_SEQUENCES + 64  # arrays + objects in a body: prompts or messages + a few


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _temperature(t: float | None) -> float | None:
    if t is not None and 0.0 < t < MIN_TEMPERATURE:
        raise ValueError(
            f"must be 0 (greedy) or >= {MIN_TEMPERATURE} (smaller values overflow the logits)"
        )
    return t


Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False), AfterValidator(_temperature)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]
NewTokens = Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS)]
TopK = Annotated[int, Field(ge=0, le=20)]
SampleTopK = Annotated[int, Field(ge=-1)]  # vLLM's top_k: -1 or 0 is off


def _prompt_kind(v: Any) -> str | None:
    if isinstance(v, str):
        return "text"
    if not isinstance(v, list):
        return None
    if not v or (isinstance(v[0], int) and not isinstance(v[0], bool)):
        return "ids"
    return "texts" if isinstance(v[0], str) else "batch"


# Dispatch on the shape instead of trying every member (a smart union validates a 4 MiB list
# against each member in turn, collecting an error per element: seconds of held GIL).
Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[int], Tag("ids")]
    | Annotated[list[str], Field(max_length=MAX_SEQUENCES), Tag("texts")]
    | Annotated[list[list[int]], Field(max_length=MAX_SEQUENCES), Tag("batch")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="must be a string, a list of token ids, or a list of either",
    ),
]


# -- request bodies (unknown fields are ignored, as vLLM does) ----------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class CompletionBody(_Body):
    model: str | None = None
    prompt: Prompt
    max_tokens: NewTokens | None = 16
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: SampleTopK | None = None
    n: int = Field(1, ge=1, le=128)
    logprobs: TopK | None = None
    prompt_logprobs: TopK | None = None  # vLLM's: the prompt tokens' own log-probs
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: Seed | None = None
    stream: bool = False
    echo: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class ImageUrl(_Body):
    url: str  # a data:image/...;base64,... URI (gyre serve fetches no URLs)
    detail: str | None = None


class Part(_Body):
    """One part of a list ``content``: ``{"type": "text", "text": ...}``, or an image in
    OpenAI's form, ``{"type": "image_url", "image_url": {"url": ...}}`` (one model, so a bad
    part's error names ``messages.0.content.1.image_url.url``, not a union member; the field
    its type needs is checked by :func:`gyre.serve.images.chat_ids`)."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None


def _content_kind(v: Any) -> str:
    return "text" if isinstance(v, str) else ""  # "": no union member in an error's location


Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[Part], Tag("")],
    Discriminator(_content_kind),
]


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # Text parts alone are joined with "\n", as vLLM does; with an image part the parts go to
    # the chat template as they are (gyre.serve.images).
    content: Content | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = None


class ChatBody(_Body):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_SEQUENCES)
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    max_tokens: NewTokens | None = None
    max_completion_tokens: NewTokens | None = None
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: SampleTopK | None = None
    n: int = Field(1, ge=1, le=128)
    logprobs: bool = False
    top_logprobs: TopK | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: Seed | None = None
    stream: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # gyre serve --record: the episode this call belongs to, its GRPO group (task) and what the
    # reward callback is given (the X-Gyre-Session / X-Gyre-Group headers do the same).
    gyre_session: str | None = Field(None, min_length=1, max_length=256)
    gyre_group: str | None = Field(None, min_length=1, max_length=256)
    gyre_metadata: dict[str, Any] | None = None


class GenerateSamplingParams(_Body):
    max_new_tokens: NewTokens = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: SampleTopK = -1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True


class GenerateBody(_Body):
    """SGLang's native ``/generate`` request (one prompt)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    return_logprob: bool = False
    top_logprobs_num: TopK = 0
    logprob_start_len: int = Field(-1, ge=-1)  # >= 0: the prompt's log-probs from there
    lora_path: str | None = None
    stream: bool = False
    # the prompt's images as data:image/...;base64,... URIs, one per placeholder, in order
    image_data: Annotated[list[str], Field(max_length=MAX_SEQUENCES)] | str | None = None


class LoadLoraBody(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraBody(_Body):
    lora_name: str = Field(min_length=1)


class UpdateWeightsBody(_Body):
    model_path: str = Field(min_length=1)
    load_format: str | None = None
    weight_version: str | None = None


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included


def check_containers(raw: bytes) -> None:
    """Refuse a body with more JSON arrays/objects than any valid request has, before parsing.

    Parsing builds one Python object per container while holding the GIL (and each one can
    trigger a garbage collection): 4 MiB of ``[[1],[1],...]`` held the event loop for seconds.
    Counting brackets outside strings is a C-speed scan.
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_CONTAINERS:
        return  # the fast path: brackets inside strings only make this an overcount
    bare = _JSON_STRING.sub(b"", raw)
    n = bare.count(b"[") + bare.count(b"{")
    if n > MAX_JSON_CONTAINERS:
        raise ApiError(
            400,
            f"request body has {n} JSON arrays/objects; a request has at most "
            f"{MAX_JSON_CONTAINERS} ({MAX_SEQUENCES} prompts or messages)",
            "body",
        )


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One line naming every bad field (``prompt: Field required; ...``) and the first field."""
    parts, param = [], None
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "")]
        field = ".".join(loc) or "body"
        param = param or field
        parts.append(f"{field}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts), param


# -- preparing a request: tokenize, check, build SamplingParams -----------------------------
# These run on the server's preparation thread (tokenizing a few MiB takes seconds), never on
# the event loop; ``tok`` is the model's tokenizer, ``vocab`` its size, ``ctx`` the context
# length (0: unknown).


@dataclass(frozen=True)
class Vocab:
    tokenizer: Any
    size: int
    context: int


def prompts_of(v: Vocab, prompt: Any) -> list[list[int]]:
    """A completion ``prompt`` (text, ids, or a list of either) as token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", "prompt")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            ids = list(v.tokenizer.encode(p, add_special_tokens=True))
        else:
            ids = list(p)
            bad = next((t for t in ids if not 0 <= t < v.size), None)
            if bad is not None:
                raise ApiError(
                    400, f"prompt {i}: token id {bad} is outside [0, {v.size})", "prompt"
                )
        if not ids:
            raise ApiError(400, f"prompt {i} is empty", "prompt")
        out.append(ids)
    return out


def message_dict(m: ChatMessage) -> dict[str, Any]:
    parts = m.content
    content = parts if isinstance(parts, str) else "\n".join(p.text or "" for p in parts or [])
    msg: dict[str, Any] = {"role": m.role, "content": content}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            msg[key] = getattr(m, key)
    if m.tool_calls:  # as vLLM does: templates expect arguments as an object, not JSON text
        msg["tool_calls"] = [_parsed_arguments(c) for c in m.tool_calls]
    return msg


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call


def chat_prompt(
    v: Vocab, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """The prompt ids of a chat: the model's chat template (with ``tools``) and the generation
    prompt; a model without a template gets BOS + the contents back to back."""
    tok = v.tokenizer
    msgs = [message_dict(m) for m in messages]
    if getattr(tok, "chat_template", None):
        try:
            ids = tok.apply_chat_template(
                msgs, tools=tools or None, add_generation_prompt=True, tokenize=True
            )
        except Exception as exc:  # jinja2's TemplateError, or a template's raise_exception
            raise ApiError(
                400, f"the model's chat template refused the messages: {exc}", "messages"
            ) from exc
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding (not a dict)
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    if tools:
        raise ApiError(400, "this model has no chat template, so it cannot be given tools", "tools")
    # No chat template (the tiny char model): BOS + the contents back to back, no role markers.
    text = "".join(m["content"] for m in msgs)
    ids = tok.encode(text, add_special_tokens=False)
    return ([tok.bos_token_id] if tok.bos_token_id is not None else []) + list(ids)


def sampling_params(v: Vocab, body: Any, max_new: int, top_k: int) -> SamplingParams:
    """Sampling parameters from an OpenAI-style body or SGLang ``sampling_params``."""
    stop_ids = list(body.stop_token_ids or [])
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for s in stops:
        ids = v.tokenizer.encode(s, add_special_tokens=False)
        if len(ids) != 1:
            raise ApiError(
                400,
                f"stop string {s!r} is {len(ids)} tokens; gyre serve only stops on single-token "
                "strings (use stop_token_ids)",
                "stop",
            )
        stop_ids.append(ids[0])
    eos = v.tokenizer.eos_token_id
    if eos is not None and not body.ignore_eos:
        stop_ids.append(eos)  # like vLLM: EOS ends a completion unless ignore_eos
    return SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(0, body.top_k or 0),
        max_new_tokens=max_new,
        stop_token_ids=tuple(sorted(set(stop_ids))),
        seed=getattr(body, "seed", None),
        top_logprobs=top_k,
    )


def check_length(v: Vocab, prompt: list[int], max_new: int) -> None:
    if v.context and len(prompt) + max_new > v.context:
        raise ApiError(
            400,
            f"prompt ({len(prompt)} tokens) + max_tokens ({max_new}) exceeds the model's "
            f"context length {v.context}",
            "max_tokens",
        )


def requests_of(
    v: Vocab, prompts: list[list[int]], n: int, max_new: int, images: list[Any] | None = None
) -> list[GenerationRequest]:
    """``n`` requests per prompt (each with ``images``), after the length and count checks."""
    if len(prompts) * n > MAX_SEQUENCES:
        raise ApiError(
            400,
            f"{len(prompts)} prompts x n={n} is more than {MAX_SEQUENCES} sequences per request",
            "prompt",
        )
    for p in prompts:
        check_length(v, p, max_new)
    return [
        GenerationRequest(list(p), images=list(images or [])) for p in prompts for _ in range(n)
    ]


# -- answers ----------------------------------------------------------------------------------


def _token_str(v: Vocab, tok: int, as_ids: bool) -> str:
    if as_ids:
        return f"token_id:{tok}"
    return v.tokenizer.decode([tok], skip_special_tokens=False)


def _completion_logprobs(v: Vocab, out: Completion, as_ids: bool) -> dict[str, Any]:
    tokens = [_token_str(v, t, as_ids) for t in out.token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = None
    if out.top_logprobs is not None:
        top = [{_token_str(v, t, as_ids): lp for t, lp in d.items()} for d in out.top_logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": out.logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(v: Vocab, out: Completion, as_ids: bool) -> dict[str, Any]:
    content = []
    for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        s = _token_str(v, t, as_ids)
        alts = []
        if out.top_logprobs is not None:
            for at, alp in out.top_logprobs[i].items():
                a = _token_str(v, at, as_ids)
                alts.append({"token": a, "logprob": alp, "bytes": list(a.encode())})
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": alts})
    return {"content": content}


def _usage(reqs: list[GenerationRequest], outs: list[Completion]) -> dict[str, int]:
    prompt = sum(len(r.prompt_ids) for r in reqs)
    gen = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen}


def completion_answer(
    v: Vocab,
    model: str,
    body: CompletionBody,
    reqs: list[GenerationRequest],
    outs: list[Completion],
) -> dict[str, Any]:
    choices = []
    for idx, (req, out) in enumerate(zip(reqs, outs, strict=True)):
        choice: dict[str, Any] = {
            "index": idx,
            "text": v.tokenizer.decode(out.token_ids, skip_special_tokens=body.skip_special_tokens),
            "logprobs": None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.token_ids[-1] if out.finish_reason == "stop" else None,
        }
        if body.logprobs is not None:
            choice["logprobs"] = _completion_logprobs(v, out, body.return_tokens_as_token_ids)
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = req.prompt_ids
        choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(reqs, outs),
    }


def assistant_message(text: str, tools: bool) -> tuple[dict[str, Any], int]:
    """The reply as OpenAI's assistant message and how many malformed tool calls it held.

    With ``tools`` in the request, Hermes / Qwen ``<tool_call>{json}</tool_call>`` blocks
    become ``tool_calls`` (the text before the first block is the ``content``), as vLLM's
    ``hermes`` parser does. A reply with a block that does not parse stays plain text: the
    agent sees what the model wrote, and the count says it happened.
    """
    if not tools or "<tool_call>" not in text:
        return {"role": "assistant", "content": text}, 0
    from gyre.rollout.tools import HermesParser

    calls = HermesParser().parse(text)
    bad = sum(1 for c in calls if c.error)
    if bad or not calls:
        return {"role": "assistant", "content": text}, max(bad, 1)
    content = text[: text.index("<tool_call>")].strip()
    tool_calls = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
        }
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}, 0


def chat_answer(
    v: Vocab, model: str, body: ChatBody, reqs: list[GenerationRequest], outs: list[Completion]
) -> dict[str, Any]:
    choices = []
    for idx, out in enumerate(outs):
        text = v.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        message, _ = assistant_message(text, bool(body.tools))
        stop = out.finish_reason == "stop" and "tool_calls" in message
        choice: dict[str, Any] = {
            "index": idx,
            "message": message,
            "logprobs": (
                _chat_logprobs(v, out, body.return_tokens_as_token_ids) if body.logprobs else None
            ),
            "finish_reason": "tool_calls" if stop else out.finish_reason,
        }
        if body.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = reqs[idx].prompt_ids
        choices.append(choice)
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(reqs, outs),
    }


def generate_answer(v: Vocab, body: GenerateBody, prompt: list[int], out: Completion) -> dict:
    """SGLang's ``/generate`` answer: ``output_ids`` + ``meta_info`` (per-token logprobs)."""
    if out.finish_reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": out.token_ids[-1]}
    else:
        finish = {"type": "length", "length": len(out.token_ids)}
    meta: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out.token_ids),
    }
    if body.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, t, None] for t, lp in zip(out.token_ids, out.logprobs, strict=True)
        ]
        meta["output_top_logprobs"] = (
            [[[lp, t, None] for t, lp in d.items()] for d in out.top_logprobs]
            if out.top_logprobs is not None
            else None
        )
    skip = body.sampling_params.skip_special_tokens
    text = v.tokenizer.decode(out.token_ids, skip_special_tokens=skip)
    return {"text": text, "output_ids": out.token_ids, "meta_info": meta}
