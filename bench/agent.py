"""Agent rollouts: message mode with tools vs raw text vs a naive HF ``generate`` agent loop.

One tiny random Qwen2 (built from a config; a byte-level BPE tokenizer with Qwen's ChatML
template and ``<tool_call>`` tools, from ``tests/chat_helpers.py``), or with ``--model DIR`` a
local Hugging Face folder with its own tokenizer and chat template (e.g. SmolLM2-135M-Instruct,
whose template renders no tool schemas: the calculator is then never announced, and a turn ends
at ``<|im_end|>``), the same tasks on every side: E "add two numbers" tasks x G episodes, each
``follow_ups + 1`` user turns (more when the model happens to write a tool call), at most
``max_new_tokens`` per turn. Throughput counts policy-generated tokens per wall-clock second,
sampling at temperature 1.

- **message**: ``run_episodes`` with ``ChatMode`` and ``ToolEnv`` (calculator): each turn
  appends the template's suffix for the new messages to the episode's ids, so the engine keeps
  the episode's KV cache and prefills only the suffix; continuous batching.
- **raw**: the same tasks as a raw-text env (the text of the same questions, newline turns):
  what gyre's built-in envs do, i.e. the cost of the chat template and tools on top of it.
- **hf_naive**: what a plain agent loop does: every turn, ``apply_chat_template`` on each active
  episode's whole conversation, tokenise, one left-padded ``model.generate`` for the batch (no
  KV reuse across turns), decode, parse tool calls, step the env.

Timing: one warm-up, then R repeats interleaved; the headline is the best run of each side.
The last line of output is one JSON object with the figures and the ratios.

Run::

    python bench/agent.py            # E=4, G=4, 16 new tokens, 2 follow-ups, 3 repeats
    python bench/agent.py --quick    # smoke test, a few seconds
    python bench/agent.py --model DIR --max-new-tokens 64 --repeats 2   # a real model
    python bench/agent.py --model DIR --env maze --max-new-tokens 4      # long conversations

``--env maze`` plays the mazes of ``examples/smollm2-maze`` (``env.name=maze_chat``: a system
message with the rules, a user message per observation, one move per reply) with the whole
conversation kept, as a chat agent does: an episode runs until the maze's move budget is spent
or the goal is reached, so conversations grow to tens of turns, and the naive loop re-renders
and re-prefills all of it every turn.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the locally built chat tokenizer and message env

from chat_helpers import AddEnv, build_chat_tokenizer  # noqa: E402
from gyre.config.maze import MAZE_CHAT_SYSTEM  # noqa: E402
from gyre.engines import TorchEngine  # noqa: E402
from gyre.envs.maze import MazeEnv, Teacher  # noqa: E402
from gyre.envs.maze_chat import MazeChatEnv  # noqa: E402
from gyre.rollout.chat import ChatMode, ChatTemplate  # noqa: E402
from gyre.rollout.episodes import RolloutStats, run_episodes, stop_ids  # noqa: E402
from gyre.rollout.tools import HermesParser, Toolbox, ToolEnv, calculator_tool  # noqa: E402
from gyre.types import SamplingParams  # noqa: E402


class RawAddEnv:
    """The same tasks as :class:`AddEnv` in raw text (question and follow-ups, newline turns)."""

    def __init__(self, follow_ups: int) -> None:
        self.env = AddEnv(follow_ups)

    def reset(self, seed: int) -> str:
        return "\n".join(m["content"] for m in self.env.reset(seed)) + "\n"

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        msgs, r, done, info = self.env.step(action)
        return "".join(m["content"] + "\n" for m in msgs), r, done, info


def _maze() -> MazeEnv:
    """The mazes of examples/smollm2-maze (5x5, the exits observation, a view of 2)."""
    return MazeEnv(size=5, observation="exits", view=2, teacher=Teacher("careful"))


def _message_env(args: argparse.Namespace, box: Toolbox) -> Any:
    if args.env == "maze":
        return MazeChatEnv(_maze(), MAZE_CHAT_SYSTEM)
    return ToolEnv(AddEnv(args.follow_ups), box)


def _model(tok: Any, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=hidden * 3,
        max_position_embeddings=4096, pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


def _max_turns(args: argparse.Namespace) -> int:
    return 64 if args.env == "maze" else args.follow_ups + 4  # the maze ends itself (budget)


def run_gyre(args: argparse.Namespace, engine: TorchEngine, tok: Any, mode: str) -> dict:
    seeds = list(range(args.tasks))
    stats = RolloutStats()
    if mode == "message":
        box = Toolbox({"calculator": calculator_tool()}, HermesParser())
        schemas = box.schemas if args.env == "add" else None
        chat = ChatMode(ChatTemplate(tok, schemas), max_turns=_max_turns(args))
        make_env: Any = lambda: _message_env(args, box)  # noqa: E731
        stops = chat.template.stop_ids()
    else:
        chat, stops = None, stop_ids(tok)
        make_env = (lambda: _maze()) if args.env == "maze" else (lambda: RawAddEnv(args.follow_ups))
    params = SamplingParams(1.0, 1.0, args.max_new_tokens, stops, seed=args.seed)
    t0 = time.perf_counter()
    trajs = run_episodes(make_env, engine, tok, seeds, args.group, params, stats, chat=chat)
    dt = time.perf_counter() - t0
    return {"s": dt, "tokens": stats.generated_tokens, "turns": sum(t.num_turns for t in trajs)}


@torch.no_grad()
def run_hf_naive(args: argparse.Namespace, model: torch.nn.Module, tok: Any) -> dict:
    box = Toolbox({"calculator": calculator_tool()}, HermesParser())
    tpl = ChatTemplate(tok, box.schemas if args.env == "add" else None)
    envs = [_message_env(args, box) for _ in range(args.tasks * args.group)]
    convs = [list(e.reset(i // args.group)) for i, e in enumerate(envs)]
    active, turns = list(range(len(envs))), [0] * len(envs)
    tokens, stops = 0, list(tpl.stop_ids())
    t0 = time.perf_counter()
    while active:
        prompts = [tpl.render_ids(convs[i], True) for i in active]
        width = max(map(len, prompts))
        ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = model.generate(
            input_ids=ids, attention_mask=attn, do_sample=True, temperature=1.0, top_p=1.0,
            top_k=0, max_new_tokens=args.max_new_tokens, eos_token_id=stops,
            pad_token_id=tok.pad_token_id,
        )[:, width:]  # fmt: skip
        still = []
        for row, i in zip(out.tolist(), active, strict=True):
            n = next((k + 1 for k, x in enumerate(row) if x in stops), len(row))
            tokens += n
            reply = tpl.decode(row[: n - 1] if row[n - 1] in stops else row[:n])
            convs[i].append({"role": "assistant", "content": reply})
            new, _, done, _ = envs[i].step(reply)
            turns[i] += 1
            if not done and turns[i] < _max_turns(args):
                convs[i].extend(new)
                still.append(i)
        active = still
    return {"s": time.perf_counter() - t0, "tokens": tokens, "turns": sum(turns)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=4, help="E: distinct tasks")
    p.add_argument("--group", type=int, default=4, help="G: episodes per task")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--follow-ups", type=int, default=2, help="user turns after the first")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: smoke test")
    p.add_argument("--model", default="", help="local HF model folder (default: tiny Qwen2)")
    p.add_argument("--sides", default="message,raw,hf_naive", help="comma-separated sides to run")
    p.add_argument(
        "--env",
        choices=("add", "maze"),
        default="add",
        help="add: the calculator tasks with follow-ups; maze: examples/smollm2-maze's mazes "
        "(one move per reply, the whole conversation kept)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.tasks, args.group, args.max_new_tokens, args.follow_ups = 2, 2, 8, 1
        args.hidden, args.repeats = 32, 1
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        import transformers

        from gyre.models.build import load_pretrained

        transformers.utils.logging.set_verbosity_error()
        model, tok = load_pretrained(args.model, torch.device("cpu"))
        model.eval()
    else:
        tok = build_chat_tokenizer("chatml")
        model = _model(tok, args.hidden, args.layers)
    engine = TorchEngine(model, tok.pad_token_id, seed=args.seed)
    every = {
        "message": lambda: run_gyre(args, engine, tok, "message"),
        "raw": lambda: run_gyre(args, engine, tok, "raw"),
        "hf_naive": lambda: run_hf_naive(args, model, tok),
    }
    wanted = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not {"message", "hf_naive"} <= set(wanted) or set(wanted) - set(every):
        raise SystemExit(f"--sides: message and hf_naive are needed, of {sorted(every)}")
    sides = {k: every[k] for k in wanted}
    for fn in sides.values():  # warm-up
        fn()
    runs: dict[str, list[dict]] = {k: [] for k in sides}
    for _ in range(args.repeats):
        for k, fn in sides.items():
            runs[k].append(fn())
    report: dict[str, Any] = {"bench": "agent", "threads": args.threads, "args": vars(args)}
    for k, rs in runs.items():
        rates = [r["tokens"] / r["s"] for r in rs]
        best = max(range(len(rs)), key=lambda j: rates[j])
        report[k] = {
            "tok_s": rates[best], "tok_s_median": statistics.median(rates),
            "generated_tokens": rs[best]["tokens"], "turns": rs[best]["turns"],
        }  # fmt: skip
    if "raw" in report:
        report["ratio_message_vs_raw"] = report["message"]["tok_s"] / report["raw"]["tok_s"]
    report["ratio_message_vs_hf_naive"] = report["message"]["tok_s"] / report["hf_naive"]["tok_s"]
    for k in sides:
        r = report[k]
        print(
            f"{k:9s} {r['tok_s']:9.1f} tok/s  ({r['generated_tokens']} tokens, {r['turns']} turns)"
        )
    raw = f"message / raw: {report['ratio_message_vs_raw']:.2f}x   " if "raw" in report else ""
    print(f"{raw}message / hf_naive: {report['ratio_message_vs_hf_naive']:.2f}x")
    report.update(
        model=args.model or "tiny-qwen2",
        load_average_1m=round(os.getloadavg()[0], 2),
    )
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
