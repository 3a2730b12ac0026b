"""Chat-template test kit: byte-level BPE tokenizers with real templates, tiny models, envs.

Built locally (no download): a byte-level BPE trained on a small text with the ``tokenizers``
library, wrapped in ``PreTrainedTokenizerFast`` with the template's special tokens. Templates:

- ``CHATML``: Qwen2.5's documented ChatML template with ``<tool_call>`` tools (prefix-stable);
- ``CHATML_STRIP_THINK``: the same, but earlier assistant turns lose their ``<think>`` block
  (as Qwen3 / QwQ templates do: not prefix-stable);
- ``LLAMA3``: ``<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gyre.engines.base import EngineFeatures
from gyre.types import Completion, GenerationRequest, SamplingParams

_TOOLS_HEADER = (
    "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>"
)
_TOOLS_FOOTER = (
    "\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n'
)

_QWEN_HEAD = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}"
    '{%- endif %}{{- "' + _TOOLS_HEADER + '" }}'
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- "' + _TOOLS_FOOTER + '" }}'
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
)
_QWEN_TOOL_AND_TAIL = (
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML = (
    _QWEN_HEAD + "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}" + _QWEN_TOOL_AND_TAIL
)
CHATML_STRIP_THINK = (
    _QWEN_HEAD + "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if not loop.last %}{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    + _QWEN_TOOL_AND_TAIL
)
LLAMA3 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
    "message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

_TEXT = (
    "You are a helpful assistant. Use the calculator to add two numbers. What is 12 + 30? "
    "The answer is 42. <think>I should add them.</think> Sure, here you go: "
    '{"name": "calculator", "arguments": {"expression": "12 + 30"}} tool_response tools '
    "function signatures within XML tags json object with function name and arguments "
    "system user assistant ipython 0123456789 + - * / ( ) = ? ! . , : ; \n\n"
)


def build_chat_tokenizer(kind: str = "chatml", vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A byte-level BPE with ``kind``'s special tokens and chat template
    (``chatml``, ``chatml_strip_think``, ``llama3``)."""
    if kind.startswith("chatml"):
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        extra = ["<tool_call>", "</tool_call>", "<think>", "</think>"]  # plain added tokens
        template = CHATML if kind == "chatml" else CHATML_STRIP_THINK
        roles = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    elif kind == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                    "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
        extra = []
        template = LLAMA3
        roles = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                 "pad_token": "<|end_of_text|>"}  # fmt: skip
    else:
        raise ValueError(kind)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator([_TEXT] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
    fast.add_special_tokens({"additional_special_tokens": specials})
    if extra:
        fast.add_tokens(extra)
    fast.chat_template = template
    return fast


def build_chat_model(tokenizer: Any, arch: str = "qwen2", seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen2 / Llama (2 layers, hidden 32) for ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    dims = dict(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    if arch == "qwen2":
        model: torch.nn.Module = Qwen2ForCausalLM(Qwen2Config(**dims))
    else:
        model = LlamaForCausalLM(LlamaConfig(**dims))
    return model.eval()


class AddEnv:
    """Message mode: 'add two numbers' (use the calculator if you like); reward 1 when the
    final reply contains the sum. ``turns`` user turns of follow-up questions first."""

    message_mode = True

    def __init__(self, follow_ups: int = 0) -> None:
        self.follow_ups = follow_ups

    def reset(self, seed: int) -> list[dict[str, str]]:
        self.a, self.b = 10 + seed % 50, 20 + (seed * 7) % 50
        self.left = self.follow_ups
        return [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"What is {self.a} + {self.b}?"},
        ]

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, dict[str, Any]]:
        if self.left > 0:
            self.left -= 1
            return [{"role": "user", "content": "Are you sure? Answer again."}], 0.0, False, {}
        ok = str(self.a + self.b) in action
        return [], float(ok), True, {"success": ok}


class ShapedAddEnv(AddEnv):
    """AddEnv (one follow-up) plus a small length bonus, so a random tiny model's groups have
    reward variance (and the update a gradient) even when no answer is right."""

    def __init__(self, follow_ups: int = 1) -> None:
        super().__init__(follow_ups)

    def step(self, action: str) -> tuple[list[dict[str, str]], float, bool, dict[str, Any]]:
        msgs, r, done, info = super().step(action)
        return msgs, r + (0.01 * len(action) if done else 0.0), done, info


@dataclass
class ScriptedEngine:
    """An engine that 'samples' given texts: turn k of every episode writes ``replies[k]``
    encoded by the tokenizer, then the stop token (canonical ids, so re-rendering matches)."""

    tokenizer: Any
    replies: list[str]
    stop_id: int
    version: int = 0
    features: ClassVar[EngineFeatures] = EngineFeatures()
    prompts: list[list[int]] = field(default_factory=list)
    _turn: dict[Any, int] = field(default_factory=dict)

    def generate(
        self, requests: list[GenerationRequest], params: SamplingParams
    ) -> list[Completion]:
        outs = []
        for r in requests:
            k = self._turn.get(r.session, 0)
            self._turn[r.session] = k + 1
            self.prompts.append(list(r.prompt_ids))
            ids = self.tokenizer.encode(
                self.replies[k % len(self.replies)], add_special_tokens=False
            )
            ids.append(self.stop_id)
            outs.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return outs

    def release(self, sessions: Any) -> None:
        pass
