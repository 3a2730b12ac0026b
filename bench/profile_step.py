"""Where the time goes: one GRPO step of gyre and of TRL, and one decode step, by phase.

Phases are timed by wrapping the functions that do them (``time.perf_counter`` around each
call; nothing else changes):

- gyre step (``bench/vs_trl.py``'s loop): rollout (``run_episodes``), old log-probs
  (``prepare_batch``, only when recomputed), forward (``policy_forward``), backward
  (``Tensor.backward``), optimizer (``Optimizer.step``, grad clipping), weight sync
  (``engine.load_weights``), glue (the rest: advantages, collate, loss maths, Python).
- TRL step (``GRPOTrainer.train``): generation (``_generate``, HF ``generate``), old/ref
  log-probs (``_get_per_token_logps_and_entropies`` under no-grad), forward (the same under
  grad, inside ``compute_loss``), backward, optimizer, glue (reward, dataloader, logging).
- decode (``--decode``): ``torch.profiler`` op totals of one engine ``generate`` (lean and HF
  forward) and one HF ``generate`` on the single-turn scenario of ``bench/rollout.py``.

Run::

    OMP_NUM_THREADS=1 python bench/profile_step.py            # gyre + TRL step phases
    OMP_NUM_THREADS=1 python bench/profile_step.py --decode   # + per-op decode profile

Last line: one JSON object with seconds per step and phase, per side.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl
import vs_trl_tasks
from gyre.config import ModelConfig
from gyre.models.build import create_tiny_checkpoint


class Phases:
    """Seconds per phase; nested timed calls count only in the innermost phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list[float]] = []  # per open call: [start, child seconds]

    def wrap(self, phase: str, fn: Callable[..., Any], when: Callable[[], bool] | None = None):
        @functools.wraps(fn)
        def timed(*a: Any, **k: Any) -> Any:
            if when is not None and not when():
                return fn(*a, **k)
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                self._stack.pop()
                total = time.perf_counter() - frame[0]
                self.seconds[phase] += total - frame[1]
                if self._stack:
                    self._stack[-1][1] += total

        return timed


@contextmanager
def patched(targets: list[tuple[Any, str, str, Callable[[], bool] | None]], ph: Phases) -> Iterator:
    saved = []
    for owner, name, phase, when in targets:
        fn = getattr(owner, name)
        saved.append((owner, name, fn))
        setattr(owner, name, ph.wrap(phase, fn, when))
    try:
        yield
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)


def _common() -> list[tuple[Any, str, str, Callable[[], bool] | None]]:
    return [
        (torch.Tensor, "backward", "backward", None),
        (torch.optim.AdamW, "step", "optimizer", None),
        (torch.nn.utils, "clip_grad_norm_", "optimizer", None),
    ]


_EVAL = [False]  # inside the held-out evaluation after the timed steps: not timed


def _not_eval() -> bool:
    return not _EVAL[0]


def _untimed_eval(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def run(*a: Any, **k: Any) -> Any:
        _EVAL[0] = True
        try:
            return fn(*a, **k)
        finally:
            _EVAL[0] = False

    return run


def profile_gyre(path: Path, args: argparse.Namespace) -> dict[str, float]:
    import gyre.trainer.update as upd

    ph = Phases()
    saved = vs_trl.evaluate
    vs_trl.evaluate = _untimed_eval(saved)
    targets = [
        *_common(),
        (vs_trl_tasks, "run_episodes", "rollout", _not_eval),
        (upd, "prepare_batch", "old_logprobs", None),
        (upd, "policy_forward", "forward", None),
        (vs_trl.TorchEngine, "load_weights", "weight_sync", None),
    ]
    try:
        with patched(targets, ph):
            res = vs_trl.run_gyre(path, _task(args), args)
    finally:
        vs_trl.evaluate = saved
    return _per_step(ph, res["seconds"], args.steps)


def profile_trl(path: Path, args: argparse.Namespace, work: Path) -> dict[str, float]:
    trl = vs_trl._require_trl()
    G = trl.GRPOTrainer
    ph = Phases()
    targets = [
        *_common(),
        (G, "_generate", "generation", None),
        (
            G,
            "_get_per_token_logps_and_entropies",
            "old_logprobs",
            lambda: not torch.is_grad_enabled(),
        ),
        (G, "_get_per_token_logps_and_entropies", "forward", torch.is_grad_enabled),
    ]
    with patched(targets, ph):
        res = vs_trl.run_trl(path, _task(args), args, work)
    return _per_step(ph, res["seconds"], args.steps)


def _task(args: argparse.Namespace) -> vs_trl_tasks.ArithmeticTask:
    return vs_trl_tasks.ArithmeticTask(args.max_operand, args.seed)


def _per_step(ph: Phases, wall: float, steps: int) -> dict[str, float]:
    out = {k: round(v / steps, 4) for k, v in sorted(ph.seconds.items())}
    out["step"] = round(wall / steps, 4)
    out["glue"] = round(out["step"] - sum(v for k, v in out.items() if k != "step"), 4)
    return out


def profile_decode(path: Path) -> dict[str, Any]:
    """torch.profiler op totals (ms) of one single-turn generate: engine lean / HF forward, and
    HF ``generate``; the same 8 prompts x G = 8 x 32 tokens as bench/rollout.py."""
    import rollout as rb
    from gyre.engines import TorchEngine
    from gyre.models.build import load_pretrained
    from gyre.types import GenerationRequest, SamplingParams

    model, tok = load_pretrained(path, torch.device("cpu"))
    prompts = rb.make_prompts(tok, 8, 8, 48, 0)
    reqs = [GenerationRequest(p, seed=8 * i + j) for i, p in enumerate(prompts) for j in range(8)]
    params = SamplingParams(1.0, 1.0, 32, (), seed=0)
    sides: dict[str, Callable[[], Any]] = {}
    for lean in (True, False):
        eng = TorchEngine(copy.deepcopy(model), tok.pad_token_id, lean_forward=lean)
        sides["engine_lean" if lean else "engine_hf_forward"] = functools.partial(
            eng.generate, reqs, params
        )
    sides["hf_generate"] = functools.partial(rb.single_turn_hf, model, tok, prompts, 8, 32)
    out: dict[str, Any] = {}
    for name, fn in sides.items():
        fn()  # warm-up
        t = time.perf_counter()
        fn()
        wall = time.perf_counter() - t
        with torch.profiler.profile() as prof:
            fn()
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        top = {e.key: round(e.self_cpu_time_total / 1e3, 1) for e in ops[:8]}
        total = sum(e.self_cpu_time_total for e in ops) / 1e3
        out[name] = {
            "wall_ms": round(wall * 1e3, 1),
            "profiled_op_ms": round(total, 1),
            "top_ops_ms": top,
        }
        print(f"{name}: wall {wall * 1e3:.1f} ms; top ops (self CPU ms, profiled): {top}")
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-operand", type=int, default=9)
    p.add_argument("--decode", action="store_true", help="also profile one decode run")
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--quick", action="store_true", help="vs_trl.py --quick sizes: smoke test")
    a = p.parse_args(argv)
    args = vs_trl.parse_args(
        [
            "--steps",
            str(a.steps),
            "--sft-steps",
            str(a.sft_steps),
            "--eval-tasks",
            "8",
            "--max-new-tokens",
            str(a.max_new_tokens),
            "--max-operand",
            str(a.max_operand),
            *(["--quick"] if a.quick else []),
        ]
    )
    torch.set_num_threads(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    transformers.utils.logging.set_verbosity_error()
    report: dict[str, Any] = {
        "bench": "profile_step",
        "steps": args.steps,
        "max_new_tokens": args.max_new_tokens,
        "max_operand": args.max_operand,
        "sft_steps": args.sft_steps,
        "load_average_1m": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory(prefix="gyre-prof-") as tmp:
        work = Path(tmp)
        base = create_tiny_checkpoint(ModelConfig(), work / "tiny", 0)
        warm = vs_trl.warm_start(base, work / "warm", args.sft_steps, 0, args.max_operand)
        quick = vs_trl.parse_args(["--quick"])
        vs_trl.run_gyre(warm, _task(quick), quick)  # warm-up (imports, caches)
        report["gyre"] = profile_gyre(warm, args)
        print("gyre s/step by phase:", report["gyre"], flush=True)
        if not a.no_trl:
            report["trl"] = profile_trl(warm, args, work)
            print("TRL  s/step by phase:", report["trl"], flush=True)
        if a.decode:
            report["decode"] = profile_decode(warm)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
