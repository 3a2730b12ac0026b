"""Golden runs: the metrics of two short runs, recorded before a refactor and compared after.

``python tests/golden/record.py`` (re)writes ``tests/golden/*.json`` from the current code;
``tests/integration/test_golden.py`` runs the same configs and asserts every metric and every
weight is bitwise equal. Re-record only for a change that is *meant* to alter numerics, and say
so in the commit.

Both runs use ``run.threads=1`` (the two-thread update is not bitwise reproducible run to run).
Timings (``time/*``, ``perf/*``, any ``*_s``) and wall clocks are left out; everything else in
``sft_metrics.jsonl`` and ``metrics.jsonl`` is kept, floats as ``float.hex`` so the comparison is
exact. The final weights are hashed tensor by tensor (sha256 of the raw bytes, sorted by name).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# name -> (config file or None for the built-in default, overrides)
RUNS: dict[str, tuple[str | None, list[str]]] = {
    "maze": (
        "tests/golden/maze_compass.yaml",
        [
            "sft.steps=3",
            "sft.demos=200",
            "train.steps=3",
            "eval.episodes=40",
            "eval.every=2",
            "checkpoint.every=2",
            "checkpoint.sft_every=0",
            "sft.lr=0.01",
        ],
    ),
    "arithmetic": (
        "examples/arithmetic/config.yaml",
        [
            "sft.steps=100",
            "sft.demos=400",
            "train.steps=5",
            "eval.episodes=40",
            "eval.every=2",
            "checkpoint.every=0",
            "train.kl_coef=0.01",
        ],
    ),
    # beyond the two: the value model (GAE critic), and LoRA with DAPO dynamic sampling
    "arithmetic_gae": (
        "examples/arithmetic/config.yaml",
        [
            "sft.steps=100",
            "sft.demos=400",
            "train.steps=3",
            "eval.episodes=20",
            "eval.every=0",
            "checkpoint.every=0",
            "train.algo.advantage=gae",
        ],
    ),
    "arithmetic_lora": (
        "examples/arithmetic/config.yaml",
        [
            "sft.steps=100",
            "sft.demos=400",
            "train.steps=3",
            "eval.episodes=20",
            "eval.every=0",
            "checkpoint.every=0",
            "model.lora.rank=4",
            "train.lr=0.003",
            "train.dapo.dynamic_sampling=true",
            "train.kl_coef=0.01",
        ],
    ),
}
_SKIP_PREFIXES = ("time/", "perf/")


def _exact(v: Any) -> Any:
    if isinstance(v, float):
        return v.hex()
    if isinstance(v, dict):
        return {k: _exact(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_exact(x) for x in v]
    return v


def _metrics(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        rows.append(
            {
                k: _exact(v)
                for k, v in sorted(row.items())
                if not k.startswith(_SKIP_PREFIXES)
                and not k.endswith("_s")
                and k not in ("wall_time", "time")
            }
        )
    return rows


def weights_digest(folder: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        for name, t in sorted(load_file(str(f)).items()):
            out[name] = hashlib.sha256(
                t.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes()
            ).hexdigest()[:16]
    return out


def golden_run(name: str, run_dir: Path) -> dict[str, Any]:
    """Run ``name`` into ``run_dir`` and return its golden record."""
    sys.path.insert(0, str(ROOT / "src"))
    from gyre.cli import main

    path, overrides = RUNS[name]
    args = (
        ["train"]
        + ([str(ROOT / path)] if path else [])
        + overrides
        + [f"run.dir={run_dir}", "run.threads=1", "log.console=off"]
    )
    rc = main(args)
    if rc not in (0, None):
        raise RuntimeError(f"golden run {name} exited {rc}")
    return {
        "args": ([path] if path else []) + overrides,
        "sft_metrics": _metrics(run_dir / "sft_metrics.jsonl"),
        "metrics": _metrics(run_dir / "metrics.jsonl"),
        "final_weights": weights_digest(run_dir / "final"),
    }


@functools.cache
def blas_family() -> str:
    """Which records this CPU replays: ``"intel"`` on an Intel CPU, whose MKL takes other
    kernels than on the AMD CPUs the first records were made on (``tests/golden/intel/``, made
    with ``MKL_CBWR=AVX2``), else ``""`` (``tests/golden/*.json``)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return "intel" if "GenuineIntel" in info else ""


def replay_env() -> dict[str, str]:
    """The environment a record is made and replayed in: torch's AVX2 kernels, and on Intel
    MKL's AVX2 code path (conditional numerical reproducibility)."""
    env = {"ATEN_CPU_CAPABILITY": "avx2"}
    if blas_family() == "intel":
        env["MKL_CBWR"] = "AVX2"
    return env


def record_path(name: str) -> Path:
    """Where ``name``'s record for this CPU's family lives."""
    family = blas_family()
    return (HERE / family if family else HERE) / f"{name}.json"


def cpu_capability() -> str:
    """The SIMD code path torch's CPU kernels take here (``AVX2``, ``AVX512``, ``DEFAULT``...)."""
    import torch

    return str(torch.backends.cpu.get_cpu_capability())


if __name__ == "__main__":
    # The records are made with torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 on a CPU that
    # has more): other SIMD paths give other bits (docs/operations.md, "Guarantees").
    # ``--out FILE NAME``: write NAME's record to FILE instead (the test's subprocess).
    # On an Intel CPU the records are tests/golden/intel/*.json, made with MKL_CBWR=AVX2 too.
    args = sys.argv[1:]
    out = None
    if args[:1] == ["--out"]:
        out, args = Path(args[1]), args[2:]
    for name in args or list(RUNS):
        with tempfile.TemporaryDirectory() as d:
            rec = golden_run(name, Path(d) / "run")
        text = json.dumps(rec, indent=1, sort_keys=True) + "\n"
        if out is not None:
            out.write_text(json.dumps({"cpu_capability": cpu_capability(), "record": rec}))
            continue
        if cpu_capability() != "AVX2":
            raise SystemExit(
                f"record with torch's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2), "
                f"not {cpu_capability()}"
            )
        if blas_family() == "intel" and os.environ.get("MKL_CBWR") != "AVX2":
            raise SystemExit("on an Intel CPU record with MKL_CBWR=AVX2 (see replay_env)")
        record_path(name).parent.mkdir(exist_ok=True)
        record_path(name).write_text(text)
        print(f"{name}: {len(rec['metrics'])} metric rows, {len(rec['final_weights'])} tensors")
