"""Message-mode episodes: conversations rendered by the tokenizer's own chat template.

A message-mode env (:class:`gyre.envs.base.MessageEnv`) returns chat messages. Each episode
keeps its conversation and the exact text of the ids it has so far; per turn:

1. the model samples from those ids; its ids are kept as sampled (never re-tokenised, loss
   mask 1) and its reply -- the sampled text without the end-of-turn token -- joins the
   conversation as an ``assistant`` message (its ``content``; tool calls stay in the text, as
   sampled, so the template renders exactly that text back);
2. the env's new messages are rendered *as the template renders them in the full
   conversation*: ``render(conversation + new, add_generation_prompt=True)`` minus the text
   already held. That suffix (loss mask 0) starts right after the sampled end-of-turn token, so
   it carries the template's glue after it (ChatML's ``\\n`` after ``<|im_end|>``). It starts at a
   special-token boundary, so tokenising it alone gives the ids the whole rendering would have;
3. at the end the closing glue is added, so a prefix-stable template's rendering of the whole
   conversation is exactly the trained text.

**Drift.** A template is *prefix-stable* when rendering a longer conversation only appends. Some
are not: Qwen3 / QwQ style templates strip ``<think>`` blocks from earlier assistant turns. Then
the held text is not a prefix of the new rendering; the suffix is found instead from a rendering
whose last assistant message is a marker (the template's text after the marker is what follows
an assistant turn), the turn goes on, and a one-time warning names the behaviour. Each episode's
``info["template_drift"]`` says whether its text differs from the template's rendering of its
whole conversation (the metric ``rollout/template_drift`` is the batch's fraction). The check
compares text, not ids: a policy may write a text in ids that are not the tokenizer's own
encoding of it ('ab' as 'a', 'b'), which is harmless to training (the trainer scores the sampled
ids) and no fault of the template. Under drift, ``rollout.stepwise`` trains each turn on what
the model saw at that turn instead (:attr:`ChatEpisode.steps`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gyre.models.vision import images_in, vision_of
from gyre.rollout.window import Window, turn_sample, window_messages
from gyre.types import Completion, Trajectory

_log = logging.getLogger("gyre.rollout.chat")
_MARK = "\u2063gyre-marker\u2063"  # an assistant content no template changes
_warned: set[str] = set()

Message = dict[str, Any]


def _ids(out: Any) -> list[int]:
    """``apply_chat_template(tokenize=True)`` output -> ids (transformers 5: a BatchEncoding)."""
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return list(out)


class ChatTemplate:
    """A tokenizer's chat template: renders conversations (with the tools' schemas) to text
    and ids, and knows the assistant's end-of-turn token and the glue after it."""

    def __init__(
        self,
        tokenizer: Any,
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "message-mode env: the tokenizer has no chat template (model.path must hold a "
                "tokenizer_config.json / chat_template.jinja with one)"
            )
        self.tokenizer = tokenizer
        self.vision = vision_of(tokenizer)  # a VLM's image side (None: a text model)
        self.tools = list(tools) if tools else None
        self.kwargs = dict(template_kwargs or {})
        # What the template writes after an assistant turn's content: end-of-turn + glue.
        tail = self.tail_after_assistant([{"role": "user", "content": "x"}], [], False)
        tail_ids = self.encode(tail)
        if not tail_ids:
            raise ValueError("chat template writes nothing after an assistant message")
        self.end_id = tail_ids[0]
        self.end_text = self.decode([self.end_id])
        if not tail.startswith(self.end_text):
            raise ValueError(f"chat template's assistant turn does not end with a token: {tail!r}")
        self.close_glue = tail[len(self.end_text) :]

    def render(self, messages: Sequence[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.kwargs,
        )

    def render_ids(self, messages: Sequence[Message], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            list(messages),
            tools=self.tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            **self.kwargs,
        )
        return _ids(out)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_images(self, text: str, images: Sequence[Any], where: str) -> list[int]:
        """:meth:`encode`, each image placeholder of ``text`` expanded once for ``images``
        (:meth:`gyre.models.vision.VisionIO.expand`)."""
        if self.vision is None:
            if images:
                raise ValueError(
                    f"{where}: the env sent {len(images)} image(s) but the model "
                    "is text-only (model.path must be a VLM: docs/vision.md)"
                )
            return self.encode(text)
        return self.vision.expand(text, images, where)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def stop_ids(self) -> tuple[int, ...]:
        """Tokens that end an assistant turn: the template's end-of-turn token and EOS."""
        ids = {self.end_id}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))

    def tail_after_assistant(
        self, before: Sequence[Message], new: Sequence[Message], generation_prompt: bool
    ) -> str:
        """The template's text after an assistant message that follows ``before`` and precedes
        ``new`` (found with a marker content, so no earlier text can shift it)."""
        conv = [*before, {"role": "assistant", "content": _MARK}, *new]
        text = self.render(conv, generation_prompt)
        at = text.rfind(_MARK)
        if at < 0:
            raise ValueError("chat template dropped the last assistant message's content")
        return text[at + len(_MARK) :]


def _behaviour(conv: Sequence[Message], rendered: str) -> str:
    """A guess at what a non-prefix-stable template did, for the one-time warning."""
    for m in conv:
        if m.get("role") == "assistant" and m.get("content", "") not in rendered:
            if "<think>" in m["content"] or "</think>" in m["content"]:
                return "it strips <think>...</think> reasoning from earlier assistant turns"
            return "it re-renders earlier assistant content (e.g. trims or rewrites it)"
    return "it re-renders earlier turns differently once the conversation grows"


def _warn_drift(tpl: ChatTemplate, conv: Sequence[Message], rendered: str) -> None:
    name = getattr(tpl.tokenizer, "name_or_path", "") or type(tpl.tokenizer).__name__
    key = f"{name}:{id(tpl.tokenizer)}"
    if key in _warned:
        return
    _warned.add(key)
    _log.warning(
        "chat template of %s is not prefix-stable: %s. Concatenated multi-turn samples then "
        "differ from what the template would show the model (rollout/template_drift counts "
        "such episodes); set rollout.stepwise=true to train each turn on the template's own "
        "rendering of that turn.",
        name or "the tokenizer",
        _behaviour(conv, rendered),
    )


@dataclass
class ChatEpisode:
    """One message-mode episode's conversation, held text and (step-wise) turn samples."""

    tpl: ChatTemplate
    stepwise: bool = False
    conv: list[Message] = field(default_factory=list)
    text: str = ""  # the exact text of the episode's ids so far
    turn_prompt: list[int] = field(default_factory=list)  # the ids the model sees next turn
    ended: bool = True  # the last reply ended with the end-of-turn token
    drift: bool = False
    steps: list[Trajectory] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)  # a VLM episode's images, in order
    window: Window | None = None  # rollout.history_turns: what a turn's prompt holds
    prompt_images: list[Any] = field(default_factory=list)  # step-wise: the turn prompt's

    def start(self, messages: Sequence[Message]) -> list[int]:
        """The opening messages -> the first prompt's ids (with the generation prompt)."""
        self.conv = [dict(m) for m in messages]
        self.images = images_in(self.conv, "reset() message")
        self.text = self.tpl.render(self.conv, True)
        self.turn_prompt = self.tpl.encode_images(self.text, self.images, "reset() messages")
        self.prompt_images = list(self.images)
        return list(self.turn_prompt)

    def prompt(self, ids: list[int]) -> list[int]:
        """What the engine is asked with: the episode's ids, or step-wise the template's
        rendering of this turn."""
        return self.turn_prompt if self.stepwise else ids

    def reply(self, out: Completion) -> str:
        """Record the sampled turn; returns the assistant's reply text (for the env)."""
        ids = list(out.token_ids)
        self.ended = bool(ids) and ids[-1] in self.tpl.stop_ids() and out.finish_reason == "stop"
        content = self.tpl.decode(ids[:-1] if self.ended else ids)
        if self.ended and ids[-1] != self.tpl.end_id:
            content_end = self.tpl.decode(ids[-1:])  # EOS instead of end-of-turn
            self.text += content + content_end
        else:
            self.text += content + (self.tpl.end_text if self.ended else "")
        self.conv.append({"role": "assistant", "content": content})
        if self.stepwise:
            self.steps.append(
                turn_sample(
                    self.turn_prompt, ids, out.logprobs, out.finish_reason, self.prompt_images
                )
            )
        return content

    def observe(self, new: Sequence[Message]) -> list[int]:
        """The env's new messages -> the ids to append (template glue included)."""
        new = [dict(m) for m in new]
        imgs = images_in(new, "step() message")
        full = self.tpl.render(self.conv + new, True)
        if full.startswith(self.text):
            suffix = full[len(self.text) :]
        else:  # not prefix-stable: what follows the last assistant turn, by the marker
            _warn_drift(self.tpl, self.conv, full)
            tail = self.tpl.tail_after_assistant(self.conv[:-1], new, True)
            end = self.tpl.end_text
            suffix = tail[len(end) :] if self.ended and tail.startswith(end) else tail
        ids = self.tpl.encode_images(suffix, imgs, "step() messages")
        self.conv.extend(new)
        self.images.extend(imgs)
        self.text += suffix
        if self.stepwise:
            self._turn_prompt(full)
        return ids

    def _turn_prompt(self, full: str) -> None:
        """Step-wise: the next turn's prompt, the whole conversation (``full``, rendered) or
        its window (:mod:`gyre.rollout.window`), with its images."""
        if self.window is None:
            self.prompt_images = list(self.images)
        else:
            msgs = window_messages(self.window, self.conv)
            full = self.tpl.render(msgs, True)
            self.prompt_images = images_in(msgs, "step() message")
        self.turn_prompt = self.tpl.encode_images(full, self.prompt_images, "step() messages")

    def close(self) -> list[int]:
        """End of the episode: the closing glue's ids; sets :attr:`drift`."""
        final = self.tpl.render(self.conv, False)
        if final.startswith(self.text):
            glue = final[len(self.text) :]
        else:
            glue = self.tpl.close_glue if self.ended else ""
        self.text += glue
        self.drift = self.text != final
        return self.tpl.encode(glue) if glue else []


@dataclass
class ChatMode:
    """What :func:`gyre.rollout.episodes.run_episodes` needs for message-mode envs."""

    template: ChatTemplate
    stepwise: bool = False
    max_turns: int = 16
    max_context_tokens: int = 0  # 0: no limit
    window: Window | None = None  # rollout.history_turns (implies step-wise samples)

    def episode(self) -> ChatEpisode:
        stepwise = self.stepwise or self.window is not None
        return ChatEpisode(self.template, stepwise, window=self.window)

    def advance(
        self, ep: ChatEpisode, new: Sequence[Message], done: bool, turns: int, tokens: int
    ) -> tuple[list[int], dict[str, Any] | None]:
        """After reply number ``turns`` (the episode holds ``tokens`` ids): the ids of the env's
        ``new`` messages and None, or -- done, or past ``max_turns`` / ``max_context_tokens``
        -- the closing glue's ids and the keys the episode's ``info`` gets."""
        stop = None
        if not done:
            if turns >= self.max_turns:
                stop = "turns"
            else:
                undo = (len(ep.conv), ep.text, ep.turn_prompt, len(ep.images), ep.prompt_images)
                ids = ep.observe(new)
                if not self.max_context_tokens or tokens + len(ids) <= self.max_context_tokens:
                    return ids, None
                stop = "context"  # the new messages are not added: the episode ends before
                del ep.conv[undo[0] :]
                del ep.images[undo[3] :]
                ep.text, ep.turn_prompt, ep.prompt_images = undo[1], undo[2], undo[4]
        tail = ep.close()
        info = {
            "template_drift": ep.drift,
            "truncated_context": stop == "context",
            "truncated_turns": stop == "turns",
            "truncated_limit": stop is not None,
        }
        return tail, info
