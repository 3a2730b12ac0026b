"""Write examples/math/tasks.jsonl: seeded arithmetic word problems with reference answers.

    python examples/math/make_tasks.py   # rewrites tasks.jsonl (deterministic, seed 0)

Answers are integers or fractions written as ``a/b`` (sharing pizzas), so ``math_answer``
(math-verify) accepts ``3/4``, ``0.75`` or ``\\frac{3}{4}`` alike while the env's own strict
string check would not.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

NAMES = ["Ana", "Ben", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal"]
ITEMS = ["apples", "pens", "cards", "coins", "books", "shells"]


def problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "add", "sub", "mul", "share"])
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    if kind == "add":
        return {"prompt": f"{name} has {a} {item} and gets {b} more. Total? ", "answer": a + b}
    if kind == "sub":
        a, b = max(a, b), min(a, b)
        return {"prompt": f"{name} has {a} {item} and gives away {b}. Left? ", "answer": a - b}
    if kind == "mul":
        return {"prompt": f"{name} buys {a} bags of {b} {item}. Total? ", "answer": a * b}
    n = rng.randint(2, 4)
    frac = Fraction(a, n)
    ans = str(frac.numerator) if frac.denominator == 1 else f"{frac.numerator}/{frac.denominator}"
    return {"prompt": f"{name} shares {a} pizzas among {n} friends. Each gets? ", "answer": ans}


def main() -> None:
    rng = random.Random(0)
    rows = [dict(problem(rng), id=i) for i in range(64)]
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
