"""Images in ``gyre serve`` requests: OpenAI chat ``image_url`` parts and SGLang ``image_data``.

Both carry images as ``data:image/...;base64,...`` URIs (gyre serve fetches no URLs or files).
They become the ids the in-process engine runs on through the code the rollout uses
(docs/vision.md "Placeholder expansion, once"):

- **chat**: the model's chat template renders one placeholder per image part, and
  :meth:`~gyre.models.vision.VisionIO.expand` replaces each with its image's run of image tokens;
- **token ids** (``/generate``): ids that already hold each image's full run -- what gyre's HTTP
  engine sends -- are run as they are, after :meth:`~gyre.models.vision.VisionIO.check`; ids with
  one placeholder per image (what a SGLang client tokenizing the chat template sends) are decoded
  and expanded. When every image is one token the two forms cannot be told apart: the ids are
  taken as they are.

Every bad image or image count is a 400 naming its field. These run on the server's
preparation thread, like tokenization.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gyre.models.vision import image_from_uri, vision_of
from gyre.serve.requests import (
    ApiError,
    ChatMessage,
    GenerateBody,
    Vocab,
    chat_prompt,
    message_dict,
    prompts_of,
)


def _image(uri: str, field: str) -> np.ndarray:
    try:
        return image_from_uri(uri, field)
    except ValueError as exc:
        raise ApiError(400, str(exc), field) from None


def _vision(v: Vocab, field: str) -> Any:
    vision = vision_of(v.tokenizer)
    if vision is None:
        raise ApiError(400, f"{field}: this model is text-only; it takes no images", field)
    return vision


def chat_ids(
    v: Vocab, messages: list[ChatMessage], tools: list[dict[str, Any]] | None = None
) -> tuple[list[int], list[np.ndarray]]:
    """(prompt ids, images) of a chat; without image parts exactly :func:`chat_prompt`'s."""
    msgs: list[dict[str, Any]] = []
    images: list[np.ndarray] = []
    vision = None
    for i, m in enumerate(messages):
        content = m.content
        for k, p in enumerate(content if isinstance(content, list) else []):
            if getattr(p, p.type) is None:
                field = f"messages.{i}.content.{k}"
                raise ApiError(
                    400, f"{field}: a part of type {p.type!r} needs a {p.type!r} field", field
                )
        if not isinstance(content, list) or all(p.type == "text" for p in content):
            msgs.append(message_dict(m))
            continue
        vision = vision or _vision(v, f"messages.{i}.content")
        parts: list[dict[str, Any]] = []
        for k, p in enumerate(content):
            if p.type == "text":
                parts.append({"type": "text", "text": p.text})
            else:  # the template writes the model's placeholder for an image part
                images.append(_image(p.image_url.url, f"messages.{i}.content.{k}.image_url.url"))
                parts.append({"type": "image"})
        msgs.append({**message_dict(m.model_copy(update={"content": None})), "content": parts})
    if vision is None:
        return chat_prompt(v, messages, tools), []
    try:
        text = v.tokenizer.apply_chat_template(
            msgs, tools=tools or None, add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja2's TemplateError, or a template's raise_exception
        raise ApiError(
            400, f"the model's chat template refused the messages: {exc}", "messages"
        ) from exc
    try:
        return vision.expand(text, images, "messages"), images
    except ValueError as exc:
        raise ApiError(400, str(exc), "messages") from None


def generate_ids(v: Vocab, body: GenerateBody) -> tuple[list[list[int]], list[np.ndarray]]:
    """(prompts, images) of a ``/generate`` body; without ``image_data`` :func:`prompts_of`'s."""
    prompt = body.text if body.input_ids is None else body.input_ids
    if body.image_data is None:
        return prompts_of(v, prompt), []
    uris = [body.image_data] if isinstance(body.image_data, str) else list(body.image_data)
    vision = _vision(v, "image_data")
    images = [_image(u, f"image_data.{j}") for j, u in enumerate(uris)]
    try:
        if body.input_ids is None:
            return [vision.expand(body.text or "", images, "text")], images
        ids = prompts_of(v, body.input_ids)[0]
        have = sum(1 for t in ids if t == vision.image_token_id)
        need = sum(vision.num_tokens(im) for im in images)
        if have != need and have == len(images):  # one placeholder per image: expand them
            text = v.tokenizer.decode(
                ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
            ids = vision.expand(text, images, "input_ids")
        vision.check(ids, images, "input_ids")
    except ValueError as exc:
        raise ApiError(400, f"image_data: {exc}", "image_data") from None
    return [ids], images
