"""Build the example's tiny policy locally (nothing is downloaded): a byte-level BPE tokenizer
with Qwen2.5's ChatML chat template and ``<tool_call>`` tools, a tiny Qwen2, and a short
supervised warm-up on transcripts of the agent solving its tasks with the calculator (so the
policy calls the tool some of the time, and GRPO has something to sharpen).

    python examples/agent-proxy/make_model.py runs/agent-model
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent import SYSTEM, TOOLS, calculator, expression_of, make_tasks

# Qwen2.5's documented template, the parts this agent uses: system + tools, user, assistant
# (with tool_calls), tool responses, the generation prompt.
CHATML = (
    "{%- if tools %}{{- '<|im_start|>system\\n' + messages[0]['content'] }}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query."
    "\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n"
    "<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": '
    '<function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- else %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages[1:] %}"
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + tool_call.name + \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 2].role != 'tool' %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer(vocab_size: int = 400) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    corpus = [SYSTEM, json.dumps(TOOLS), CHATML, "Calculate 12 + -3. -17 ( 5 - 8 )"]
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:],
    )  # fmt: skip
    fast.add_tokens(["<tool_call>", "</tool_call>"])  # plain added tokens, as in Qwen2.5
    fast.chat_template = CHATML
    return fast


def build_model(tokenizer: Any, seed: int = 0, hidden: int = 64, layers: int = 2) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen2ForCausalLM(config)


def transcript(question: str) -> list[dict[str, Any]]:
    """What a perfect episode looks like: one calculator call, then the result alone."""
    expr = expression_of(question)
    call = {"name": "calculator", "arguments": {"expression": expr}}
    tool_call = {"type": "function", "function": call}
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "content": calculator(expr)},
        {"role": "assistant", "content": calculator(expr)},
    ]


def example(tokenizer: Any, msgs: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(ids, mask): the rendered conversation, mask 1 on each assistant reply and its
    end-of-turn token (what the policy writes), 0 on the rest."""

    def render(upto: int, prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            msgs[:upto], tools=TOOLS, add_generation_prompt=prompt, tokenize=False
        )

    def enc(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        before, after = render(k, True), render(k + 1, False)
        reply = after[len(before) :].removesuffix("\n")  # content + <|im_end|>
        context, written = enc(before[len(done) :]), enc(reply)
        ids += context + written
        mask += [0] * len(context) + [1] * len(written)
        done = before + reply
    return ids, mask


def warm_up(
    model: Any,
    tokenizer: Any,
    steps: int,
    tasks: int = 2000,
    seed: int = 0,
    batch_size: int = 8,
    lr: float = 3e-3,
) -> float:
    """``steps`` AdamW steps of next-token loss on the assistant tokens of ``tasks``
    transcripts (tasks seeded apart from the agent's defaults); the last loss."""
    torch.manual_seed(seed)
    qs, _ = make_tasks(tasks, seed + 10_000)
    data = [example(tokenizer, transcript(t.question)) for t in qs]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    loss = torch.tensor(0.0)
    for step in range(steps):
        batch = [data[(step * batch_size + j) % len(data)] for j in range(batch_size)]
        width = max(len(ids) for ids, _ in batch)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in batch], dtype=torch.float)
        logits = model(input_ids=ids).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        loss = (nll * mask[:, 1:].reshape(-1)).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def make(out: str | Path, steps: int = 600, seed: int = 0, tasks: int = 2000) -> tuple[Path, float]:
    out = Path(out)
    tok = build_tokenizer()
    model = build_model(tok, seed)
    loss = warm_up(model, tok, steps, tasks, seed) if steps else float("nan")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, loss


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=600, help="warm-up steps (0: a random model)")
    p.add_argument("--tasks", type=int, default=2000, help="warm-up transcripts")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    path, loss = make(args.out, args.steps, args.seed, args.tasks)
    print(f"wrote {path} (warm-up loss {loss:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
