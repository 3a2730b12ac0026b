"""Write examples/smollm2-math/tasks.jsonl: seeded one-step arithmetic word problems.

    python examples/smollm2-math/make_tasks.py   # rewrites tasks.jsonl (deterministic, seed 0)

2,000 distinct problems: sums and differences of numbers up to 20 in a short story ("Ana has 7
apples and gets 5 more. How many apples does Ana have now?"). The last 200 rows are the held-out
set (``env.dataset.eval_rows: 200``); no held-out question is also a training question, so a
rise in held-out accuracy is not memorisation.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Ana", "Ben", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lea"]
ITEMS = ["apples", "pens", "cards", "coins", "books", "shells", "stamps", "marbles"]
ROWS, HELD_OUT = 2000, 200


def problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        return {"prompt": q, "answer": a + b}
    a, b = max(a, b), min(a, b)
    q = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
    return {"prompt": q, "answer": a - b}


def main() -> None:
    rng = random.Random(0)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < ROWS:
        p = problem(rng)
        if p["prompt"] not in seen:
            seen.add(p["prompt"])
            rows.append(dict(p, id=len(rows)))
    out = Path(__file__).with_name("tasks.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} rows to {out} (the last {HELD_OUT} are held out)")


if __name__ == "__main__":
    main()
