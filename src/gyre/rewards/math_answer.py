"""``math_answer``: 1.0 when the completion's final answer equals the reference mathematically.

Parsing and comparison are Hugging Face's ``math-verify`` (``pip install 'gyre[math]'``): the
reference and the completion are each parsed (LaTeX such as ``\\boxed{1/2}`` or plain
expressions such as ``0.5``) into sympy objects, then compared symbolically and numerically,
so ``\\boxed{\\frac{1}{2}}``, ``1/2`` and ``0.5`` all match. Config::

    reward:
      functions:
        - fn: gyre.rewards.math_answer:math_answer
          kwargs: {answer_field: answer}   # the column holding the reference (default)

The reference comes from the task's metadata column ``answer`` (the dataset env's answer
field), or from ``answer_field`` when the rows use another name.
"""

from __future__ import annotations

import threading
from typing import Any

MISSING = (
    "the math_answer reward needs the 'math-verify' package: pip install 'gyre[math]' "
    "(or pip install math-verify)"
)


def _math_verify() -> tuple[Any, Any]:
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise ImportError(MISSING) from exc
    return parse, verify


def math_answer(
    prompts: list[str],
    completions: list[str],
    answer_field: str = "answer",
    correct: float = 1.0,
    wrong: float = 0.0,
    **columns: Any,
) -> list[float]:
    """``correct`` where ``completions[i]`` verifies against the reference, else ``wrong``.

    A reference that does not parse scores ``wrong`` for that sample (never an exception),
    so one bad row cannot stop a run; a missing reference column is a configuration error.
    """
    parse, verify = _math_verify()
    refs = columns.get(answer_field)
    if refs is None:
        raise ValueError(
            f"math_answer: no column {answer_field!r} (have: {sorted(columns)}); "
            "set kwargs.answer_field to the task field holding the reference answer"
        )
    # math-verify bounds its own parsing time with SIGALRM, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    out = []
    for completion, ref in zip(completions, refs, strict=True):
        if ref is None:
            out.append(wrong)
            continue
        gold = parse(str(ref), parsing_timeout=timeout)
        pred = parse(completion, parsing_timeout=timeout)
        ok = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
        out.append(correct if ok else wrong)
    return out
