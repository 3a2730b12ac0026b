"""Peak memory of a GRPO step: ``gyre train`` for one step, full fine-tuning and LoRA.

Each setting runs ``gyre train`` in its own process (the same command a user types; the
trainer and its in-process torch engine together), and its peak resident set size is the
kernel's ``ru_maxrss`` of that process. The run: ``examples/arithmetic`` (single-turn, raw
text) on ``--model``, no SFT, one GRPO step of ``--tasks`` x ``--group`` samples of at most
``--max-new-tokens`` tokens, no evaluation, no checkpoint but the final one.

Settings (``--settings``, comma-separated; each a list of extra ``key=value`` overrides):

- ``full``: full fine-tuning, defaults (the engine samples from a copy of the weights);
- ``full-lean``: full fine-tuning with ``perf.activation_checkpointing=true``,
  ``perf.logprob_chunk=256`` and ``engine.weight_sync=shared`` (no engine copy);
- ``lora``: ``model.lora`` rank 8 (q/k/v/o), defaults;
- ``lora-lean``: LoRA with ``perf.activation_checkpointing=true`` and
  ``perf.logprob_chunk=256``.

Run::

    python bench/step_memory.py --model DIR
    python bench/step_memory.py --model DIR --settings full-lean,lora-lean

The last line is one JSON object: per setting, peak RSS in MiB, wall seconds and exit status.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEAN = ["perf.activation_checkpointing=true", "perf.logprob_chunk=256"]
LORA = ["model.lora.rank=8"]
SETTINGS: dict[str, list[str]] = {
    "full": [],
    "full-lean": [*LEAN, "engine.weight_sync=shared"],
    "lora": LORA,
    "lora-lean": [*LORA, *LEAN],
}


def run_step(args: argparse.Namespace, extra: list[str], run_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-c", "from gyre.cli import main; main()", "train",
        str(ROOT / "examples/arithmetic/config.yaml"), f"model.path={args.model}",
        "sft.steps=0", "train.steps=1", f"train.tasks_per_step={args.tasks}",
        f"train.group_size={args.group}", f"train.sampling.max_new_tokens={args.max_new_tokens}",
        "eval.episodes=0", "checkpoint.every=0", f"run.threads={args.threads}",
        f"run.dir={run_dir}", *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    log = run_dir.parent / f"{run_dir.name}.log"
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak, not all children's
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    tail = log.read_text(errors="replace").strip().splitlines()[-3:]
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024), "seconds": round(seconds, 1),
            "returncode": proc.returncode, "tail": tail, "overrides": extra}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local HF model folder")
    p.add_argument("--tasks", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--settings", default="full,full-lean,lora,lora-lean")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in names if s not in SETTINGS]
    if unknown:
        p.error(f"--settings: unknown {unknown}; valid: {sorted(SETTINGS)}")
    report: dict[str, Any] = {"bench": "step_memory", "model": args.model, "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="gyre-step-memory-") as tmp:
        for name in names:
            r = run_step(args, SETTINGS[name], Path(tmp) / name)
            report[name] = r
            print(f"{name:10s} peak RSS {r['peak_rss_mib']:6d} MiB  {r['seconds']:7.1f} s  "
                  f"exit {r['returncode']}", flush=True)  # fmt: skip
    report["load_average_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
