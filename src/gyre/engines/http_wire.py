"""The HTTP engine's wire format: request bodies and answers of the two server dialects.

``engine.api=openai`` (vLLM, ``gyre serve``): ``/v1/completions`` with the prompt as token ids,
``return_token_ids`` / ``return_tokens_as_token_ids`` (vLLM's fields) and ``logprobs``.
``engine.api=sglang`` (SGLang, ``gyre serve``): ``/generate`` with ``input_ids``, and for a VLM
``image_data`` (PNG data URIs); ``meta_info.output_token_logprobs`` holds [logprob, id, text].
Text is never re-tokenised, so the trainer scores exactly the tokens the server sampled.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gyre.deadlines import BadAnswer
from gyre.types import Completion, GenerationRequest, SamplingParams

APIS = ("openai", "sglang")


class ServerError(BadAnswer):
    """A server answered, but not usefully (bad status, malformed body): an engine fault."""

    kind = "engine"


def completion_route(api: str) -> str:
    return "/v1/completions" if api == "openai" else "/generate"


def _top_k(params: SamplingParams) -> dict[str, int]:
    """vLLM and SGLang both take ``top_k`` (-1: off); sent only when on, so a request without
    it is unchanged for servers that do not know the key."""
    return {"top_k": params.top_k} if params.top_k > 0 else {}


def completion_body(
    api: str, model: str, prompt: list[int], params: SamplingParams, images: list[str]
) -> dict[str, Any]:
    """One request's body; ``model`` is what it names as its model (for SGLang: the adapter
    name, or "" for the base model)."""
    if api == "sglang":  # SGLang's native /generate: ids in, ids + logprobs out
        image_data = {"image_data": images} if images else {}
        return {
            **image_data,
            "input_ids": list(prompt),
            "sampling_params": {
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                **_top_k(params),
                "stop_token_ids": list(params.stop_token_ids),
                "ignore_eos": True,
                "skip_special_tokens": False,
            },
            "return_logprob": True,
            "top_logprobs_num": params.top_logprobs,
            "lora_path": model or None,
        }
    # No per-request ``seed``: a seeded request cannot share a batch on gyre serve, and the
    # sampling RNG lives in the servers anyway (HTTP rollouts are not bit-reproducible).
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        **_top_k(params),
        "n": 1,
        "logprobs": params.top_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "ignore_eos": True,  # stop exactly on stop_token_ids, as the in-process engine does
        "stop_token_ids": list(params.stop_token_ids),
    }


def parse_answer(api: str, data: dict[str, Any], url: str, prompt_len: int | None) -> Completion:
    """A completion from a 200 answer of ``api``'s completion route."""
    if api == "sglang":
        return parse_generate(data, url, prompt_len)
    return parse_completion(data, url)


def error_text(r: Any) -> str:
    """A refusal in one line: the status and the server's message (OpenAI / SGLang JSON)."""
    try:
        body = r.json()
        err = body.get("error") if isinstance(body, dict) else None
        msg = err.get("message") if isinstance(err, dict) else None
        msg = msg or (body.get("message") or body.get("error_message") or body.get("detail"))
    except ValueError:
        msg = None
    text = str(msg) if msg else r.text[:300]
    if r.status_code == 413:
        text += " (a prompt this large needs a larger body limit, e.g. gyre serve --max-body-mb)"
    return f"{r.status_code} {text}"


def parse_completion(data: dict[str, Any], url: str) -> Completion:
    try:
        choice = data["choices"][0]
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        ids = choice.get("token_ids")
        if ids is None and lp.get("tokens") is not None:
            ids = [token_id(t) for t in lp["tokens"]]
        if ids is None or logprobs is None:
            raise ServerError(
                f"{url} returned no token ids/logprobs: it must accept vLLM's "
                "return_token_ids / return_tokens_as_token_ids and logprobs fields"
            )
        if len(ids) != len(logprobs):
            raise ServerError(f"{url} returned {len(ids)} token ids but {len(logprobs)} logprobs")
        top = None
        if lp.get("top_logprobs"):
            top = [{token_id(k): float(v) for k, v in d.items()} for d in lp["top_logprobs"]]
        reason = "stop" if choice.get("finish_reason") == "stop" else "length"
        return Completion([int(t) for t in ids], [float(x) for x in logprobs], reason, top)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{url} returned a malformed completion: {exc!r}") from exc


def parse_generate(data: dict[str, Any], url: str, prompt_len: int | None = None) -> Completion:
    """SGLang's /generate answer: ``meta_info.output_token_logprobs`` = [[logprob, id, text]].

    ``prompt_len`` (a request with images): the server re-runs its processor on the prompt, so
    it must report running exactly that many prompt tokens (``meta_info.prompt_tokens``), or
    its placeholder expansion differs from the one the trainer scores (docs/vision.md)."""
    try:
        meta = data["meta_info"]
        ran = meta.get("prompt_tokens")
        if prompt_len is not None and ran is None:
            raise ServerError(
                f"{url} returned no meta_info.prompt_tokens for a prompt with "
                "images: its placeholder expansion cannot be checked"
            )
        if prompt_len is not None and ran != prompt_len:
            raise ServerError(
                f"{url} ran {ran} prompt tokens for a prompt of {prompt_len} ids with images: "
                "its image placeholder expansion differs from gyre's (docs/vision.md)"
            )
        pairs = meta.get("output_token_logprobs")
        if pairs is None:
            raise ServerError(f"{url} returned no output_token_logprobs (send return_logprob)")
        ids = [int(p[1]) for p in pairs]
        if data.get("output_ids") is not None and list(data["output_ids"])[-len(ids) :] != ids:
            raise ServerError(f"{url}: output_ids and output_token_logprobs disagree")
        top = None
        if meta.get("output_top_logprobs"):
            top = [{int(t[1]): float(t[0]) for t in step} for step in meta["output_top_logprobs"]]
        fr = meta.get("finish_reason") or {}
        reason = "stop" if (fr.get("type") if isinstance(fr, dict) else fr) == "stop" else "length"
        return Completion(ids, [float(p[0]) for p in pairs], reason, top)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(f"{url} returned a malformed /generate answer: {exc!r}") from exc


def token_id(token: str) -> int:
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not 'token_id:N' (send return_tokens_as_token_ids)")
    return int(token.split(":", 1)[1])


def own_temperature(params: SamplingParams, req: GenerationRequest) -> SamplingParams:
    """``params`` with the request's own temperature, where it sets one."""
    return params if req.temperature is None else replace(params, temperature=req.temperature)


def image_uris(requests: list[GenerationRequest]) -> list[list[str]]:
    """Each request's images as PNG data URIs, each distinct image encoded once."""
    if not any(r.images for r in requests):
        return [[] for _ in requests]
    from gyre.models.vision import image_data_uri, image_key

    done: dict[bytes, str] = {}
    out = []
    for r in requests:
        row = []
        for img in r.images:
            key = image_key(img)
            if key not in done:
                done[key] = image_data_uri(img)
            row.append(done[key])
        out.append(row)
    return out
