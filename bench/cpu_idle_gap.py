"""Does this machine run a burst of work slower right after an idle gap?

A sync Ray run alternates the roles: each actor computes, then sleeps while the other one
works. ``gyre plan`` takes one throughput per role; if a core is slower right after idling (a
virtual CPU given back to the host, a lower clock), a throughput measured in alternation does
not hold when the roles overlap. This times the same one-thread matmul burst back to back and
after ``--gap`` seconds of sleep, interleaved ``--repeats`` times, and prints the ratio.

    python bench/cpu_idle_gap.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
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
    ratios = []
    for r in range(args.repeats):
        busy = statistics.median(burst(a, 400) for _ in range(args.bursts))
        gapped = []
        for _ in range(args.bursts):
            time.sleep(args.gap)
            gapped.append(burst(a, 400))
        idle = statistics.median(gapped)
        ratios.append(idle / busy)
        print(f"repeat {r}: back to back {busy:.4f} s, after {args.gap} s idle {idle:.4f} s, "
              f"ratio {idle / busy:.2f}", flush=True)  # fmt: skip
    print(f"median ratio (after idle / back to back): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
