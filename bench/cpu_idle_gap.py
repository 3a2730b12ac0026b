"""Does this machine run a burst of work at another speed after an idle gap, or beside a busy
neighbour?

A sync Ray run alternates the roles: each actor computes, then sleeps while the other one
works. ``gyre plan`` takes one throughput per role; if a core is slower right after idling (a
virtual CPU given back to the host, a lower clock), or faster while the other core is busy, a
throughput measured in alternation does not hold when the roles overlap. This times the same
one-thread matmul burst back to back, after ``--gap`` seconds of sleep, and back to back while
another process spins on the other core, interleaved ``--repeats`` times, and prints the
ratios to the first.

    python bench/cpu_idle_gap.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch


def burst(a: torch.Tensor, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        a @ a
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.4, help="seconds idle before each burst")
    ap.add_argument("--bursts", type=int, default=8, help="bursts per measurement")
    args = ap.parse_args()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    burst(a, 50)
    after_idle, beside_busy = [], []
    for r in range(args.repeats):
        alone = statistics.median(burst(a, 400) for _ in range(args.bursts))
        gapped = []
        for _ in range(args.bursts):
            time.sleep(args.gap)
            gapped.append(burst(a, 400))
        spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(0.2)
            beside = statistics.median(burst(a, 400) for _ in range(args.bursts))
        finally:
            spin.kill()
            spin.wait()
        after_idle.append(statistics.median(gapped) / alone)
        beside_busy.append(beside / alone)
        print(
            f"repeat {r}: back to back {alone:.4f} s; after {args.gap} s idle "
            f"x{after_idle[-1]:.2f}; beside a busy core x{beside_busy[-1]:.2f}",
            flush=True,
        )
    print(f"median, beside a busy core / back to back: {statistics.median(beside_busy):.2f}")
    print(f"median, after idle / back to back: {statistics.median(after_idle):.2f}")


if __name__ == "__main__":
    main()
