"""Server-side custom losses: ``create_custom_loss`` graphs, checked once, run per datum.

The SDK traces a per-datum loss ``fn(logprobs, *inputs) -> (loss, metrics)`` with torch.fx and
sends its nodes as plain data (``CustomLossGraph``). Nothing in it is executable: this module
rebuilds it from its own allow-lists of pure tensor functions and methods, refusing anything
else at upload with the node named, then interprets the nodes for each datum. ``logprobs`` is
the datum's current log-probability of ``target_tokens``, so gradients flow into the model in
one forward/backward (no client round trip). Per-datum losses are summed; metrics keyed
``custom/<name>:sum`` add up over datums, ``...:mean`` are averaged.

Not allowed: anything that leaves torch (``item``, ``numpy``, ``tolist``), in-place methods,
``backward``, attribute reads other than shape/dtype/ndim, tensors made from a size (``zeros``,
``arange``: a loss sizes its tensors from its inputs with ``*_like``), modules, captured tensors.
"""

from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from gyre.tinker.errors import UserError

_TORCH = """exp exp2 log log1p log2 log10 expm1 sqrt rsqrt square pow abs neg sign sgn reciprocal
sigmoid tanh relu erf floor ceil round trunc clamp clip clamp_min clamp_max minimum maximum
min max amin amax sum mean prod cumsum std var logsumexp softmax log_softmax where gather
masked_fill stack cat squeeze unsqueeze reshape flatten transpose add sub mul div true_divide
eq ne gt ge lt le logical_and logical_or logical_not logical_xor isfinite isnan nan_to_num
zeros_like ones_like full_like detach lerp matmul dot outer einsum norm numel tensor argmax
argmin diff flip roll index_select narrow select""".split()
_FUNCTIONAL = """log_softmax softmax softplus relu sigmoid logsigmoid kl_div mse_loss l1_loss
smooth_l1_loss huber_loss binary_cross_entropy_with_logits gelu silu elu leaky_relu normalize
""".split()
_MATH = "exp log log1p expm1 sqrt tanh floor ceil fabs pow isfinite".split()
_OPERATOR = """add sub mul truediv floordiv mod pow neg pos abs getitem eq ne lt le gt ge and_
or_ xor invert matmul""".split()

FUNCTIONS: dict[str, Any] = {
    **{f"torch.{n}": getattr(torch, n) for n in _TORCH},
    **{f"torch.nn.functional.{n}": getattr(F, n) for n in _FUNCTIONAL},
    **{f"math.{n}": getattr(math, n) for n in _MATH},
    **{f"operator.{n}": getattr(operator, n) for n in _OPERATOR},
}
METHODS = frozenset(
    {n for n in _TORCH if hasattr(torch.Tensor, n)}
    | set(
        """float double long int bool to type_as view view_as reshape_as expand expand_as
        permute t contiguous clone size dim sum_to_size masked_select""".split()
    )
)
ATTRIBUTES = frozenset({"shape", "dtype", "ndim", "T", "mT"})
_METRIC = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")


@dataclass(frozen=True)
class CustomLoss:
    """A checked loss graph: its name, its inputs (``logprobs`` first) with ranks, its nodes."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    nodes: tuple[dict[str, Any], ...]

    def __call__(
        self, lp: torch.Tensor, inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One datum's (scalar loss, metrics); ``inputs`` are its ``loss_fn_inputs``."""
        args = [lp] + [inputs[name] for name, _ in self.inputs[1:]]
        env: dict[str, Any] = {}
        it = iter(args)
        for node in self.nodes:
            op, name = node["op"], node["name"]
            if op == "placeholder":
                env[name] = next(it)
                continue
            a = [_decode(x, env, lp.device) for x in node["args"]]
            kw = {k: _decode(v, env, lp.device) for k, v in node["kwargs"].items()}
            try:
                if op == "output":
                    loss, metrics = a[0]
                    break
                if op == "call_method":
                    env[name] = getattr(a[0], node["target"])(*a[1:], **kw)
                elif node["target"] == "getattr":
                    env[name] = getattr(a[0], a[1])
                else:
                    env[name] = FUNCTIONS[node["target"]](*a, **kw)
            except (
                ArithmeticError,
                AttributeError,
                IndexError,
                RuntimeError,
                TypeError,
                ValueError,
            ) as exc:
                raise UserError(f"custom loss {self.name!r}, node {name!r}: {exc}") from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"custom loss {self.name!r} must return a scalar loss, got {shape}")
        return loss.reshape(()), metrics


def _decode(x: Any, env: dict[str, Any], device: torch.device) -> Any:
    """An encoded argument (``CustomLossNode.args``) as a value; devices become ours."""
    if isinstance(x, list):
        return [_decode(v, env, device) for v in x]
    if not isinstance(x, dict):
        return x
    (kind, v), *_ = x.items()
    if kind == "ref":
        return env[v]
    if kind == "tuple":
        return tuple(_decode(e, env, device) for e in v)
    if kind == "dict":
        return {k: _decode(e, env, device) for k, e in v.items()}
    if kind == "slice":
        return slice(*(_decode(e, env, device) for e in v))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(v)
    if kind == "device":
        return device
    return getattr(torch, v)  # dtype, layout, memory_format (checked at upload)


def _check_arg(x: Any, seen: set[str], where: str) -> None:
    if isinstance(x, list):
        for e in x:
            _check_arg(e, seen, where)
        return
    if x is None or isinstance(x, bool | int | float | str):
        return
    if not isinstance(x, dict) or len(x) != 1:
        raise UserError(f"{where}: cannot decode argument {x!r}")
    (kind, v), *_ = x.items()
    if kind == "ref":
        if v not in seen:
            raise UserError(f"{where}: refers to {v!r}, which is not an earlier node")
    elif kind in ("tuple", "slice"):
        _check_arg(list(v), seen, where)
    elif kind == "dict" and isinstance(v, dict):
        _check_arg(list(v.values()), seen, where)
    elif kind == "float" and v in ("inf", "-inf", "nan"):
        pass
    elif kind in ("dtype", "layout", "memory_format"):
        want = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
        if not isinstance(v, str) or not isinstance(getattr(torch, v, None), want[kind]):
            raise UserError(f"{where}: {v!r} is not a torch {kind}")
    elif kind not in ("ellipsis", "device"):
        raise UserError(f"{where}: cannot decode argument {x!r}")


def _check_node(node: Any, i: int, seen: set[str]) -> str:
    where = f"graph.nodes[{i}]"
    if not isinstance(node, dict) or not isinstance(node.get("name"), str):
        raise UserError(f"{where}: expected a node with a name")
    op, target = node.get("op"), node.get("target")
    where = f"graph.nodes[{i}] ({node['name']})"
    args, kwargs = node.get("args", []), node.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise UserError(f"{where}: args must be a list and kwargs an object")
    _check_arg(args + list(kwargs.values()), seen, where)
    if op == "call_function":
        if target == "getattr":
            if len(args) != 2 or args[1] not in ATTRIBUTES:
                raise UserError(f"{where}: reads an attribute other than {sorted(ATTRIBUTES)}")
        elif target not in FUNCTIONS:
            raise UserError(f"{where}: function {target!r} is not allowed in a custom loss")
    elif op == "call_method":
        if target not in METHODS:
            raise UserError(f"{where}: method {target!r} is not allowed in a custom loss")
        if not args:
            raise UserError(f"{where}: a method call needs its tensor")
    elif op not in ("placeholder", "output"):
        raise UserError(f"{where}: op {op!r} is not allowed in a custom loss")
    return op


def compile_custom_loss(body: dict[str, Any]) -> CustomLoss:
    """Check a ``CreateCustomLossRequest`` body; errors name the field and node."""
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise UserError("name: required")
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise UserError("inputs: expected a list, logprobs first")
    inputs = []
    for i, item in enumerate(raw_inputs):
        if not isinstance(item, dict) or item.get("rank") not in (0, 1, 2):
            raise UserError(f"inputs[{i}]: expected {{'name': ..., 'rank': 0, 1 or 2}}")
        inputs.append((str(item.get("name")), int(item["rank"])))
    if inputs[0][0] != "logprobs" or inputs[0][1] not in (1, 2):
        raise UserError("inputs[0]: must be logprobs, of rank 1 or 2")
    graph = body.get("graph")
    if not isinstance(graph, dict) or graph.get("format", 1) != 1:
        raise UserError("graph: expected a CustomLossGraph of format 1")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list):
        raise UserError("graph.nodes: expected a list")
    seen: set[str] = set()
    ops = []
    for i, node in enumerate(nodes):
        ops.append(_check_node(node, i, seen))
        seen.add(node["name"])
    if ops.count("placeholder") != len(inputs) or ops[: len(inputs)] != ["placeholder"] * len(
        inputs
    ):
        raise UserError(f"graph.nodes: need {len(inputs)} placeholders first, one per input")
    if ops.count("output") != 1 or ops[-1] != "output":
        raise UserError("graph.nodes: the last node, and only it, must be the output")
    _check_output(nodes[-1]["args"])
    return CustomLoss(name, tuple(inputs), tuple(nodes))


def _check_output(args: list[Any]) -> None:
    out = args[0] if len(args) == 1 else None
    parts = out.get("tuple") if isinstance(out, dict) else None
    if not isinstance(parts, list) or len(parts) != 2 or "dict" not in (parts[1] or {}):
        raise UserError("graph.nodes[-1]: the loss must return (loss, {metric: tensor})")
    for key in parts[1]["dict"]:
        if not _METRIC.fullmatch(key):
            raise UserError(f"graph.nodes[-1]: metric {key!r} must be custom/<name>:sum or :mean")
