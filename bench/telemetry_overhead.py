"""Cost of one ``log(step, metrics)`` call per sink, with the 17 keys a GRPO step logs.

JSONL is the baseline every run pays; TensorBoard and the Prometheus exporter are what
``telemetry.tensorboard`` / ``telemetry.prometheus_port`` add. One GRPO step of the default run
takes seconds, so the per-step cost of a sink is what matters. Prints one line per sink and,
last, one JSON object.

    python bench/telemetry_overhead.py [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

KEYS = [
    "rollout/reward_mean", "rollout/success_rate", "rollout/turns_mean",
    "rollout/response_tokens_mean", "rollout/frac_reward_zero_std", "train/loss", "train/kl",
    "train/clipfrac", "train/entropy", "train/grad_norm", "train/logprob_gap", "train/tokens",
    "time/rollout_s", "time/train_s", "time/sync_s", "perf/rollout_tokens_per_s",
    "policy_version",
]  # fmt: skip


def main() -> None:
    from gyre.telemetry.prometheus import PrometheusExporter
    from gyre.telemetry.sinks import JsonlSink
    from gyre.telemetry.tensorboard_sink import TensorBoardSink

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    ns = p.parse_args()
    out = {"bench": "telemetry_overhead", "keys": len(KEYS), "calls": ns.calls}
    with tempfile.TemporaryDirectory() as d:
        sinks = {
            "jsonl": JsonlSink(f"{d}/metrics.jsonl"),
            "tensorboard": TensorBoardSink(f"{d}/tb"),
            "prometheus": PrometheusExporter(d, 0),
        }
        for name, sink in sinks.items():
            t = time.perf_counter()
            for step in range(1, ns.calls + 1):
                sink.log(step, {k: 0.001 * step + i for i, k in enumerate(KEYS)})
            ms = (time.perf_counter() - t) / ns.calls * 1e3
            sink.close()
            out[f"{name}_ms_per_log"] = round(ms, 4)
            print(f"{name:12s} {ms:.3f} ms per log call ({len(KEYS)} keys)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
