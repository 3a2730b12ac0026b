"""A small tool-using agent that knows nothing of gyre: the plain ``openai`` client, chat
completions with one ``calculator`` tool that it runs itself, several turns per task.

Its only gyre-specific lines are the ``X-Gyre-Session`` / ``X-Gyre-Group`` headers (which
episode and which task a call belongs to; any OpenAI server ignores them) and the final
``POST /v1/gyre/episodes/{session}/reward``. Tasks: reasoning-gym's ``basic_arithmetic``
dataset, scored by its own ``score_answer``, when ``reasoning_gym`` is importable; otherwise
gyre's arithmetic tasks (``"37+45="``), scored by exact integer match.

    python examples/agent-proxy/agent.py --base-url http://127.0.0.1:8000/v1 --tasks 8 \\
        --attempts 4
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import sys
import uuid
from dataclasses import dataclass
from typing import Any

SYSTEM = "You are a careful assistant. Use the calculator tool, then give only the result."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}  # fmt: skip


def calculator(expression: str) -> str:
    """+ - * / and parentheses over numbers, by walking the syntax tree (no eval)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not an arithmetic expression")

    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, TypeError) as exc:
        return f"error: {exc}"
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


@dataclass
class Task:
    question: str
    answer: str
    entry: Any = None  # the reasoning-gym entry, for its scorer


def make_tasks(n: int, seed: int) -> tuple[list[Task], Any]:
    """``n`` tasks and the reasoning-gym dataset that scores them (None: the fallback)."""
    try:
        import reasoning_gym
    except ImportError:
        reasoning_gym = None
    if reasoning_gym is not None:
        ds = reasoning_gym.create_dataset(
            "basic_arithmetic", size=n, seed=seed, min_terms=2, max_terms=2, min_digits=1,
            max_digits=1, operators=("+", "-"),
        )  # fmt: skip
        return [Task(e["question"], str(e["answer"]), e) for e in ds], ds
    from gyre.envs.arithmetic import ArithmeticEnv

    env, out = ArithmeticEnv(max_operand=9), []
    for i in range(n):
        q = env.reset(seed * 100_003 + i)
        out.append(Task(f"Calculate {q[:-1]}.", str(env.answer)))
    return out, None


def score(task: Task, reply: str, ds: Any) -> float:
    if ds is not None:
        return float(ds.score_answer(reply.strip(), task.entry))
    return float(reply.strip() == task.answer)


def expression_of(question: str) -> str:
    """'Calculate 5 - 3.' -> '5 - 3' (what a perfect agent would pass the calculator)."""
    return question.removeprefix("Calculate ").rstrip(".").strip()


def run_episode(
    client: Any, model: str, task: Task, session: str, group: str, max_turns: int = 4,
    temperature: float = 1.0, max_tokens: int = 48, metadata: dict[str, Any] | None = None,
) -> tuple[str, list[dict[str, Any]], int]:  # fmt: skip
    """One attempt: (final reply, the conversation, tool calls made). ``metadata`` goes to
    the server's ``--reward-fn`` (``gyre_metadata``)."""
    headers = {"X-Gyre-Session": session, "X-Gyre-Group": group}
    extra = {"gyre_metadata": metadata} if metadata else None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task.question},
    ]
    calls = 0
    reply = ""
    for _ in range(max_turns):
        r = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=temperature,
            max_tokens=max_tokens, extra_headers=headers, extra_body=extra,
        )  # fmt: skip
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            reply = msg.content or ""
            break
        for call in msg.tool_calls:
            calls += 1
            try:
                args = json.loads(call.function.arguments)
                result = calculator(**args) if call.function.name == "calculator" else "error"
            except (ValueError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return reply, messages, calls


def post_reward(client: Any, session: str, reward: float) -> bool:
    """Tell a recording server the episode's reward (success: a full score; reasoning-gym gives
    partial credit to near misses); False where the server records nothing (a plain ``gyre
    serve`` or any other OpenAI server: 404)."""
    import openai

    body = {"reward": reward, "success": reward >= 1.0}
    try:
        client.post(f"/gyre/episodes/{session}/reward", body=body, cast_to=object)
    except openai.NotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", default="tiny")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--attempts", type=int, default=4, help="episodes per task (a GRPO group)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument(
        "--server-reward", action="store_true",
        help="let the server's --reward-fn score (send the task as gyre_metadata, then POST "
        ".../end) instead of posting the agent's own score",
    )  # fmt: skip
    args = p.parse_args(argv)
    import openai

    client = openai.OpenAI(base_url=args.base_url, api_key="none", max_retries=0)
    tasks, ds = make_tasks(args.tasks, args.seed)
    print("tasks:", "reasoning-gym basic_arithmetic" if ds is not None else "gyre arithmetic")
    total, score_sum, solved, tool_calls = 0, 0.0, 0, 0
    for i, task in enumerate(tasks):
        for _ in range(args.attempts):
            session = uuid.uuid4().hex
            meta = {"entry": task.entry, "answer": task.answer} if args.server_reward else None
            reply, _, calls = run_episode(
                client, args.model, task, session, f"task-{args.seed}-{i}",
                temperature=args.temperature, metadata=meta,
            )  # fmt: skip
            reward = score(task, reply, ds)
            if args.server_reward:
                client.post(f"/gyre/episodes/{session}/end", cast_to=object)
            else:
                post_reward(client, session, reward)
            total, score_sum, tool_calls = total + 1, score_sum + reward, tool_calls + calls
            solved += reward >= 1.0
    n = max(total, 1)
    print(f"episodes {total}  mean reward {score_sum / n:.3f}  solved {solved / n:.1%}  "
          f"tool calls {tool_calls}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
