"""Do two single-threaded torch processes get two full cores here? (docs/cluster.md)

    python bench/cores.py

Times the same fixed work -- a forward + backward of the default maze model on a 64 x 105
token batch, the trainer's shape -- in one process alone, then in two processes at once, one
torch thread each. On two independent cores the concurrent runs take as long as the lone one;
the ratio printed is how much longer each takes when both run (CPU seconds, so waiting for a
core is not counted: what remains is what the two processes cost each other -- shared
physical cores, caches, memory bandwidth). It bounds any overlap of rollout and training.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import sys
import time

REPS = 12


def _work(q: mp.Queue) -> None:  # type: ignore[type-arg]
    import torch

    from gyre.config import ModelConfig
    from gyre.models.build import build_char_tokenizer, build_tiny_model

    torch.set_num_threads(1)
    model = build_tiny_model(ModelConfig(), build_char_tokenizer(), 0)
    ids = torch.randint(3, 90, (64, 105), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids).logits.sum().backward()  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(REPS):
        model.zero_grad()
        model(input_ids=ids).logits.sum().backward()
    q.put((time.perf_counter() - t0, time.process_time() - c0))


def _run(n: int) -> list[tuple[float, float]]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_work, args=(q,)) for _ in range(n)]
    for p in procs:
        p.start()
    out = [q.get() for _ in procs]
    for p in procs:
        p.join()
    return out


def cpu_slowdown() -> tuple[tuple[float, float], list[tuple[float, float]], float]:
    """(alone (wall, CPU s), concurrent [(wall, CPU s)] * 2, the CPU time ratio)."""
    alone = _run(1)[0]
    both = _run(2)
    return alone, both, max(c for _, c in both) / alone[1]


def main() -> int:
    alone, both, slow = cpu_slowdown()
    print(f"alone: {alone[0]:.2f} s wall, {alone[1]:.2f} s CPU for {REPS} fwd+bwd")
    for w, c in both:
        print(f"concurrent: {w:.2f} s wall, {c:.2f} s CPU")
    print(f"each process costs {slow:.2f}x the CPU time when both run")
    print(json.dumps({"alone": alone, "concurrent": both, "cpu_slowdown": slow}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
