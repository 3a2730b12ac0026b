"""``reward_model``: score samples with any local Hugging Face sequence-classification folder.

The folder is loaded with ``AutoModelForSequenceClassification`` and ``AutoTokenizer`` from a
local path (nothing is downloaded) once per (path, device, dtype) and kept for the run. Config::

    reward:
      functions:
        - fn: gyre.rewards.reward_model:reward_model
          name: rm
          kwargs: {path: /models/my-rm, device: cuda, batch_size: 16}

Input text: ``prompt + completion`` by default; ``chat_template: true`` renders a
user/assistant conversation with the reward model's own chat template instead (what most
published reward models expect). Score: the logit of ``label`` (default 0, the single output of
a regression head, which is how reward models are usually trained); for a multi-class head pick
the class with ``label`` and set ``prob: true`` to get its softmax probability.

Padding is on the right and the model reads its score at the last non-pad token (the
``pad_token_id`` of the model config), so a batch scores exactly like one sample at a time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Any

_CACHE: dict[tuple[str, str, str], tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def load_reward_model(path: str, device: str = "cpu", dtype: str = "float32") -> tuple[Any, Any]:
    """(model, tokenizer) for a local folder, cached; errors name the path."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    key = (str(path), str(device), dtype)
    with _LOCK:
        if key in _CACHE:
            return _CACHE[key]
        from gyre.models.build import resolve_device

        dev = resolve_device(device, key="reward_model device")
        try:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, dtype=getattr(torch, dtype)
            )
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"reward_model: cannot load a sequence-classification model from {path!r}: {exc}"
            ) from exc
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tok.pad_token_id
        tok.padding_side = "right"
        model.to(dev).eval()
        _CACHE[key] = (model, tok)
        return model, tok


@dataclass(frozen=True)
class RewardModelSettings:
    """The kwargs of :func:`reward_model` (``reward.functions[*].kwargs``); see the module
    docstring."""

    path: str = ""  # a local sequence-classification folder (required)
    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 16
    max_length: int = 2048  # tokens of prompt + completion; longer texts are truncated
    label: int = 0  # the output read as the score
    prob: bool = False  # its softmax probability instead of its logit
    chat_template: bool = False  # render a user/assistant conversation, not prompt + completion

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> RewardModelSettings:
        """The settings among a reward call's kwargs (the task's columns come with them)."""
        return cls(**{f.name: kwargs[f.name] for f in fields(cls) if f.name in kwargs})


def reward_model(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """One score per (prompt, completion); ``kwargs``: the :class:`RewardModelSettings` fields
    (``path`` required), and the task's columns, which it does not read."""
    return score_texts(prompts, completions, RewardModelSettings.from_kwargs(kwargs))


def score_texts(prompts: list[str], completions: list[str], s: RewardModelSettings) -> list[float]:
    """One score per (prompt, completion), in batches of ``s.batch_size`` on ``s.device``."""
    import torch

    if not s.path:
        raise ValueError("reward_model: set kwargs.path to a local sequence-classification folder")
    model, tok = load_reward_model(s.path, s.device, s.dtype)
    label, batch_size = s.label, s.batch_size
    if not 0 <= label < model.config.num_labels:
        raise ValueError(
            f"reward_model: label {label} out of range for {model.config.num_labels} labels"
        )
    if s.chat_template:
        texts = [
            tok.apply_chat_template(
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                tokenize=False,
            )
            for p, c in zip(prompts, completions, strict=True)
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    dev = next(model.parameters()).device
    scores: list[float] = []
    with torch.inference_mode():
        for start in range(0, len(texts), batch_size):
            enc = tok(
                texts[start : start + batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=s.max_length,
            ).to(dev)
            logits = model(**enc).logits.float()  # (B, num_labels)
            col = logits.softmax(-1)[:, label] if s.prob else logits[:, label]
            scores.extend(col.cpu().tolist())
    return scores
