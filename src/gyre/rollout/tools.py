"""Tool calls in message mode: tools, a call parser registry and the :class:`ToolEnv` wrapper.

- A :class:`Tool` is an OpenAI-style JSON schema (what the chat template shows the model, via
  ``apply_chat_template(..., tools=[schemas])``) plus a function ``fn(**arguments) -> str``.
  ``rollout.tools`` names built-ins (:data:`BUILTINS`: ``calculator``, ``python``) or import
  paths ``module:attr`` of a :class:`Tool` (or of a zero-argument function returning one).
- A :class:`ToolCallParser` reads calls out of the model's reply; :data:`PARSERS` holds them by
  name (``rollout.tool_parser``). ``hermes`` is the Hermes / Qwen format,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several per reply allowed.
- :class:`ToolEnv` wraps a message-mode env: a reply with tool calls is answered with one
  ``tool`` message per call, and the inner env never sees it; a reply without one is the final
  answer and goes to the inner env.

Errors are part of the episode, never a crash: a call whose JSON does not parse, that names no
known tool, whose arguments are wrong, or that the tool fails on, is answered with a ``tool``
message saying what was wrong (``error: ...``) and counted in ``info["tool_errors"]``
(``rollout/tool_errors``: per episode, mean over the batch). Calls past ``rollout.max_tool_calls``
get such an answer too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gyre.config import RolloutConfig, SandboxConfig
from gyre.envs.base import is_message_env
from gyre.rollout.chat import ChatMode, ChatTemplate
from gyre.rollout.window import window_of

Message = dict[str, Any]


class ToolError(Exception):
    """A tool call that cannot be carried out; its message goes back to the model."""


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``name`` and ``arguments``, or ``error`` (why it could not be read)."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


@dataclass
class Tool:
    """An OpenAI-style function tool: ``schema`` is ``{"type": "function", "function":
    {"name", "description", "parameters"}}``; ``fn(**arguments)`` returns the result text."""

    schema: dict[str, Any]
    fn: Callable[..., str]

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    def check(self, arguments: dict[str, Any]) -> None:
        """Required parameters present, no unknown ones, JSON types right (else ToolError)."""
        params = self.schema["function"].get("parameters", {})
        props: dict[str, Any] = params.get("properties", {})
        missing = [k for k in params.get("required", []) if k not in arguments]
        if missing:
            raise ToolError(f"missing argument(s) {', '.join(missing)}")
        unknown = [k for k in arguments if k not in props]
        if unknown:
            raise ToolError(f"unknown argument(s) {', '.join(unknown)}")
        types = {"string": str, "number": (int, float), "integer": int, "boolean": bool}
        for k, v in arguments.items():
            want = types.get(props[k].get("type", ""))
            if want is None:
                continue
            if not isinstance(v, want) or (want is not bool and isinstance(v, bool)):
                raise ToolError(f"argument {k} must be a {props[k]['type']}")


# -- parsers -------------------------------------------------------------------------------------
class ToolCallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]:
        """Every tool call in ``text`` (unreadable ones with ``error`` set); [] for none."""
        ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._CALL.findall(text):
            try:
                obj = json.loads(body)
            except ValueError as exc:
                calls.append(ToolCall(error=f"tool call is not valid JSON ({exc})"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ToolCall(error='tool call must be {"name": ..., "arguments": {...}}'))
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models send the arguments as a JSON string
                try:
                    args = json.loads(args)
                except ValueError:
                    pass
            if not isinstance(args, dict):
                calls.append(ToolCall(obj["name"], error="tool call arguments must be an object"))
                continue
            calls.append(ToolCall(obj["name"], args))
        return calls


PARSERS: dict[str, Callable[[], ToolCallParser]] = {"hermes": HermesParser}


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"rollout.tool_parser: unknown {name!r}; valid: {', '.join(PARSERS)}")
    return PARSERS[name]()


# -- built-in tools ------------------------------------------------------------------------------
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNOPS: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def safe_eval(expression: str, max_power: int = 64) -> int | float:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) by walking its
    ``ast``; no names, calls or attributes (no ``eval``). Raises ToolError on anything else."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression ({exc.msg})") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_power:
                raise ToolError(f"exponent {right} too large (at most {max_power})")
            try:
                value = _BINOPS[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large") from None
            if isinstance(value, int) and value.bit_length() > 4096:
                raise ToolError("result too large")
            return value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
            return _UNOPS[type(node.op)](ev(node.operand))
        raise ToolError(f"unsupported syntax: {type(node).__name__}")

    value = ev(tree.body)
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not finite")
    return value


def calculator_tool() -> Tool:
    def calculator(expression: str) -> str:
        value = safe_eval(expression)
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)

    schema = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression (+ - * / // % ** and parentheses).",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 3 * (4 + 5)"}},
                "required": ["expression"],
            },
        },
    }
    return Tool(schema, calculator)


_PY_FN = "gyre._pytool:run_python"  # no torch import in the sandbox worker


class PythonTool:
    """Runs code in :class:`gyre.rewards.sandbox.SandboxPool` workers (wall time, memory, no
    network as ``rollout.python`` says); the pool starts on the first call."""

    def __init__(self, cfg: SandboxConfig) -> None:
        self.cfg = cfg
        self.pool: Any = None

    def __call__(self, code: str) -> str:
        if self.pool is None:
            from gyre.rewards.sandbox import SandboxPool

            self.pool = SandboxPool(self.cfg, [_PY_FN])
        req = {
            "fn": _PY_FN,
            "prompts": [code],
            "completions": [""],
            "columns": {},
            "kwargs": {},
            "text": True,
        }
        res = self.pool.map([req])[0]
        if not res.ok:
            raise ToolError(f"python {res.kind}: {res.error.strip().splitlines()[-1]}")
        return res.text

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def python_tool(cfg: SandboxConfig | None = None) -> Tool:
    schema = {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run a Python program in a sandbox; returns what it printed.",
            "parameters": {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the program"}},
                "required": ["code"],
            },
        },
    }
    return Tool(schema, PythonTool(cfg or SandboxConfig(timeout_s=5.0, memory_mb=512)))


BUILTINS: dict[str, Callable[[RolloutConfig], Tool]] = {
    "calculator": lambda cfg: calculator_tool(),
    "python": lambda cfg: python_tool(cfg.python),
}


def resolve_tool(spec: str, cfg: RolloutConfig) -> Tool:
    """A built-in name or a ``module:attr`` path (a Tool or a function returning one)."""
    if spec in BUILTINS:
        return BUILTINS[spec](cfg)
    mod, sep, attr = spec.partition(":")
    if not sep:
        raise ValueError(
            f"rollout.tools: unknown tool {spec!r}; built-ins: {', '.join(BUILTINS)}, or a "
            "'module:attr' import path"
        )
    try:
        obj: Any = importlib.import_module(mod)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"rollout.tools: cannot import {spec!r} ({exc})") from exc
    if not isinstance(obj, Tool) and callable(obj) and not inspect.signature(obj).parameters:
        obj = obj()
    if not isinstance(obj, Tool):
        raise ValueError(f"rollout.tools: {spec!r} is not a gyre.rollout.tools.Tool")
    return obj


@dataclass
class Toolbox:
    """The run's tools by name, their schemas and the call parser (shared by every episode)."""

    tools: dict[str, Tool]
    parser: ToolCallParser
    output_chars: int = 2000

    @classmethod
    def from_config(cls, cfg: RolloutConfig) -> Toolbox:
        tools = [resolve_tool(s, cfg) for s in cfg.tools]
        return cls({t.name: t for t in tools}, get_parser(cfg.tool_parser), cfg.tool_output_chars)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def call(self, call: ToolCall) -> tuple[str, bool]:
        """Run one call: (result text, whether it failed)."""
        if call.error:
            return f"error: {call.error}", True
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}", True
        try:
            tool.check(call.arguments)
            out = tool.fn(**call.arguments)
        except ToolError as exc:
            return f"error: {call.name}: {exc}", True
        except Exception as exc:  # a tool's own bug is the model's problem only as a message
            return f"error: {call.name} failed: {type(exc).__name__}: {exc}", True
        return str(out)[: self.output_chars], False

    def close(self) -> None:
        for t in self.tools.values():
            if hasattr(t.fn, "close"):
                t.fn.close()


class ToolEnv:
    """A message-mode env with tools: replies with tool calls are answered here.

    ``step(reply)``: with tool calls, returns one ``tool`` message per call (reward 0, not
    done); the inner env does not see the reply. Without one, the reply is the final answer:
    the inner env's step. ``info`` gets ``tool_calls`` and ``tool_errors`` (this episode's
    counts so far). Past ``max_tool_calls`` a call is answered with an error (counted).
    """

    message_mode = True

    def __init__(self, env: Any, toolbox: Toolbox, max_tool_calls: int = 8) -> None:
        self.env = env
        self.toolbox = toolbox
        self.max_tool_calls = max_tool_calls
        self.calls = self.errors = 0

    def reset(self, seed: int) -> list[Message]:
        self.calls = self.errors = 0
        return self.env.reset(seed)

    def step(self, action: str) -> tuple[list[Message], float, bool, dict[str, Any]]:
        calls = self.toolbox.parser.parse(action)
        if not calls:
            msgs, r, done, info = self.env.step(action)
            return msgs, r, done, {**info, **self._counts()}
        out = []
        for call in calls:
            if self.calls >= self.max_tool_calls:
                text, failed = f"error: tool call limit ({self.max_tool_calls}) reached", True
            else:
                text, failed = self.toolbox.call(call)
            self.calls += 1
            self.errors += failed
            out.append({"role": "tool", "name": call.name or "unknown", "content": text})
        return out, 0.0, False, self._counts()

    def _counts(self) -> dict[str, Any]:
        return {"tool_calls": self.calls, "tool_errors": self.errors}


def with_tools(
    make_env: Callable[[], Any], toolbox: Toolbox, max_tool_calls: int
) -> Callable[[], ToolEnv]:
    return lambda: ToolEnv(make_env(), toolbox, max_tool_calls)


def message_mode(
    cfg: Any, tokenizer: Any, make_env: Callable[[], Any]
) -> tuple[Callable[[], Any], ChatMode | None, Toolbox | None]:
    """The env factory, chat mode and toolbox of a run (``cfg``: the whole config): raw-text
    envs come back unchanged with (None, None); message-mode ones get the tokenizer's chat
    template with the tools' schemas, and the :class:`ToolEnv` wrapper when tools are named."""
    r: RolloutConfig = cfg.rollout
    if not is_message_env(make_env()):
        if r.tools or r.stepwise:
            key = "rollout.tools" if r.tools else "rollout.stepwise"
            raise ValueError(f"{key} needs a message-mode env; env.name={cfg.env.name} is raw text")
        return make_env, None, None
    toolbox = Toolbox.from_config(r) if r.tools else None
    try:
        template = ChatTemplate(tokenizer, toolbox.schemas if toolbox else None)
    except Exception:
        if toolbox is not None:
            toolbox.close()
        raise
    if toolbox is not None:
        make_env = with_tools(make_env, toolbox, r.max_tool_calls)
    window = window_of(r)
    chat = ChatMode(template, r.stepwise, r.max_turns, r.max_context_tokens, window)
    return make_env, chat, toolbox


def message_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """Message mode's batch metrics (none for raw-text episodes): the fraction of episodes with
    template drift / cut at the context limit, and tool calls and errors per episode."""
    infos = [t.info for t in trajs if "template_drift" in t.info]
    if not infos:
        return {}
    n = len(infos)
    return {
        "rollout/template_drift": sum(bool(i["template_drift"]) for i in infos) / n,
        "rollout/truncated_context": sum(bool(i.get("truncated_context")) for i in infos) / n,
        "rollout/tool_calls": sum(int(i.get("tool_calls", 0)) for i in infos) / n,
        "rollout/tool_errors": sum(int(i.get("tool_errors", 0)) for i in infos) / n,
    }
