"""The prepared GPU check: correctness in fp32 and bf16, throughput, MFU and scale, in one run.

Sections (each guarded: a failure records its error and the run goes on; each writes the
report again, so a run killed at its time limit still leaves what it measured):

- ``lean_vs_hf``: the lean forward (``gyre.models.lean``) against the Hugging Face forward of
  the same module, fp32 and bf16, a Llama (GQA, untied) and a Qwen2 (Q/K/V bias): max abs
  logit difference at a right-padded prefill and over cached one-token decode steps.
- ``engine_vs_trainer``: multi-turn maze episodes (``run_episodes``, ``MazeEnv`` defaults)
  through ``TorchEngine``, rescored by the trainer (``token_logprobs``): max and mean
  |engine - trainer| log-prob over policy tokens, per dtype and sampling setting; for bf16 also
  against an fp32 trainer (rollouts in bf16, training in fp32). The bf16 gap is the
  train-inference mismatch.
- ``pytest_gpu``: ``pytest -m gpu`` on the test files that carry ``@pytest.mark.gpu``.
- ``matmul_peak``: a dense n x n matmul in bf16 and fp32 (the MFU denominators).
- ``rollout_throughput``: gyre's engine vs HF ``generate`` on a random-init Qwen2.5-0.5B-shaped
  model in bf16, G samples of P random prompts, exactly ``new`` tokens per row; tokens/s, peak
  GPU memory (``torch.cuda.max_memory_allocated``), MFU (formula in ``bench/gpu_perf.py``).
- ``grpo_step``: one gyre GRPO step (rollout + update) on that model in fp32; TRL's side is
  recorded as skipped with the reason.
- ``scale``: the largest Qwen2.5-shaped model (0.5B .. 14B, fp32 weights, AdamW) whose GRPO
  update fits, with gyre's default trainer path (lean forward, no activation checkpointing)
  and with ``model.gradient_checkpointing_enable()`` (HF forward); OOM is caught and recorded.
- ``grpo_run``: ``gyre train`` on the maze default (short SFT + GRPO) on the device, in a
  subprocess with a timeout; before/after held-out success from its ``summary.json``.

A total budget (``--budget-s``) skips what no longer fits, with a note. ``--smoke`` runs every
section at tiny sizes on the CPU in seconds (tests/test_bench_gpu_smoke.py).

Run (docs/performance.md, "GPU check")::

    PYTHONPATH=src python bench/gpu_check.py --out /tmp/gpu          # full: needs CUDA
    PYTHONPATH=src python bench/gpu_check.py --smoke --out /tmp/gs   # CPU, tiny sizes

Writes ``report.json`` and ``report.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import gpu_perf  # noqa: E402
from gpu_markdown import to_markdown  # noqa: E402
from gpu_runs import Skipped, grpo_run, pytest_gpu  # noqa: E402
from gyre.config import ModelConfig  # noqa: E402
from gyre.engines import TorchEngine  # noqa: E402
from gyre.envs import MazeEnv  # noqa: E402
from gyre.models.build import build_char_tokenizer, build_tiny_model  # noqa: E402
from gyre.models.lean import lean_for, unsupported_reason  # noqa: E402
from gyre.rollout.episodes import run_episodes, stop_ids  # noqa: E402
from gyre.trainer.batch import collate, token_logprobs  # noqa: E402
from gyre.types import SamplingParams  # noqa: E402


@dataclass
class Sizes:
    """Every size of one mode; the report records them."""

    lean_hidden: int = 512
    lean_layers: int = 6
    lean_vocab: int = 4096
    lean_tokens: int = 64
    maze_tasks: int = 8
    maze_group: int = 4
    mid_model: str = "0.5b"  # engine-vs-trainer on this shape too ("" = tiny only)
    perf_shape: str = "0.5b"
    group: int = 8
    prompt_batches: tuple[int, ...] = (64, 256)
    new_tokens: int = 256
    prompt_lo: int = 32
    prompt_hi: int = 96
    throughput_need_s: float = 60.0  # the largest batch, both sides
    step_prompts: int = 16
    step_micro: int = 32
    matmul_n: int = 8192
    matmul_iters: int = 10
    ladder: tuple[str, ...] = ("0.5b", "1.5b", "3b", "7b", "14b")
    scale_tasks: int = 1
    scale_prompt: int = 128
    scale_new: int = 256
    scale_micro: int = 8
    rung_need_s: float = 25.0
    train_overrides: tuple[str, ...] = (
        "sft.steps=100",
        "sft.demos=1000",
        "train.steps=20",
        "eval.episodes=200",
    )
    train_min_s: float = 60.0
    pytest_timeout_s: float = 120.0


SMOKE = Sizes(
    lean_hidden=32,
    lean_layers=2,
    lean_vocab=61,
    lean_tokens=9,
    maze_tasks=3,
    maze_group=2,
    mid_model="tiny-b",
    perf_shape="tiny-a",
    group=2,
    prompt_batches=(2, 4),
    new_tokens=8,
    prompt_lo=4,
    prompt_hi=12,
    throughput_need_s=5.0,
    step_prompts=2,
    step_micro=4,
    matmul_n=128,
    matmul_iters=3,
    ladder=("tiny-a", "tiny-b"),
    scale_prompt=8,
    scale_new=8,
    scale_micro=4,
    rung_need_s=2.0,
    train_overrides=(
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.intermediate_size=64",
        "sft.steps=2",
        "sft.demos=16",
        "sft.batch_size=8",
        "train.steps=2",
        "train.tasks_per_step=2",
        "train.group_size=2",
        "train.mini_batches=1",
        "eval.episodes=4",
        "run.threads=1",
    ),
    train_min_s=5.0,
    pytest_timeout_s=60.0,
)


class Budget:
    """Seconds left of ``--budget-s``; a step that needs more is skipped with a note."""

    def __init__(self, total: float) -> None:
        self.total, self.t0 = total, time.perf_counter()

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.t0)

    def allows(self, need_s: float) -> bool:
        return self.left() >= need_s

    def note(self) -> str:
        return f"time budget: {self.left():.0f} s of {self.total:.0f} s left"


@dataclass
class Ctx:
    sizes: Sizes
    device: torch.device
    budget: Budget
    smoke: bool
    peaks: dict[str, float]


# -- correctness --------------------------------------------------------------------------
def _hf_cache_kwarg(model: torch.nn.Module) -> str:
    """The installed transformers' name of the KV-cache argument (renamed within 5.x)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _lean_models(sz: Sizes) -> dict[str, torch.nn.Module]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = dict(
        vocab_size=sz.lean_vocab,
        hidden_size=sz.lean_hidden,
        intermediate_size=2 * sz.lean_hidden,
        num_hidden_layers=sz.lean_layers,
        num_attention_heads=8 if sz.lean_hidden >= 256 else 4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    return {
        "llama-gqa-untied": LlamaForCausalLM(LlamaConfig(**dims, tie_word_embeddings=False)),
        "qwen2-bias": Qwen2ForCausalLM(Qwen2Config(**dims, use_sliding_window=False)),
    }


def _lean_diffs(model: torch.nn.Module, sz: Sizes, dev: torch.device, dtype: torch.dtype) -> dict:
    lean = lean_for(model)
    if lean is None:
        return {"error": f"lean forward refused: {unsupported_reason(model)}"}
    kw = _hf_cache_kwarg(model)
    g = torch.Generator().manual_seed(2)
    B, T = 4, sz.lean_tokens
    P = T // 2
    ids = torch.randint(0, sz.lean_vocab, (B, T), generator=g).to(dev)
    am = torch.ones(B, T, dtype=torch.long, device=dev)
    am[1, T - 3 :] = 0  # right padding
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=am).logits
        got = lean.logits(lean.hidden(ids, pos, lean.padded_mask(am, dtype)))
        real = am.bool()
        prefill = (got[real].float() - ref[real].float()).abs().max().item()
        scale = ref[real].float().abs().max().item()
        hf_cache, lean_cache = DynamicCache(config=model.config), DynamicCache(config=model.config)
        model(input_ids=ids[:, :P], use_cache=True, **{kw: hf_cache})
        colmask = torch.ones(B, P, dtype=torch.long, device=dev)
        lean.hidden(ids[:, :P], pos[:, :P], lean.cached_mask(colmask, P, dtype), lean_cache)
        decode = 0.0
        for t in range(P, T):
            step = {"input_ids": ids[:, t : t + 1], "position_ids": pos[:, t : t + 1]}
            ref = model(**step, use_cache=True, **{kw: hf_cache}).logits
            colmask = torch.cat([colmask, torch.ones(B, 1, dtype=torch.long, device=dev)], dim=1)
            h = lean.hidden(
                step["input_ids"],
                step["position_ids"],
                lean.cached_mask(colmask, 1, dtype),
                lean_cache,
            )
            decode = max(decode, (lean.logits(h).float() - ref.float()).abs().max().item())
    return {
        "prefill_max_abs_diff": prefill,
        "decode_max_abs_diff": decode,
        "logits_abs_max": scale,
        "decode_steps": T - P,
    }


def lean_vs_hf(ctx: Ctx) -> dict[str, Any]:
    out: dict[str, Any] = {}
    models = _lean_models(ctx.sizes)
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        out[name] = {}
        for label, base in models.items():
            m = copy.deepcopy(base).to(ctx.device, dtype).eval()
            out[name][label] = _lean_diffs(m, ctx.sizes, ctx.device, dtype)
    return out


def _engine_models(ctx: Ctx, tok: Any) -> dict[str, torch.nn.Module]:
    """The unit tests' sharp tiny model (tests/unit/test_engine.py) and, in full mode, a
    Qwen2.5-0.5B-shaped model with the char vocabulary (default init)."""
    dims = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}
    base = build_tiny_model(ModelConfig(**dims), tok, seed=2)
    g = torch.Generator().manual_seed(2 + 12345)
    with torch.no_grad():  # sharp: peaked next-token distributions make the check meaningful
        for p in base.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5, generator=g)
    models = {"tiny-sharp": base.eval()}
    if ctx.sizes.mid_model:
        cfg = gpu_perf.qwen2_config(ctx.sizes.mid_model, vocab=len(tok))
        cfg.pad_token_id, cfg.bos_token_id = tok.pad_token_id, tok.bos_token_id
        cfg.eos_token_id = tok.eos_token_id
        models[f"qwen2-{ctx.sizes.mid_model}-shape-char-vocab"] = gpu_perf.build(
            cfg, ctx.device, torch.float32
        ).eval()
    return models


def _gap(model: torch.nn.Module, trajs: list, pad: int, dev: torch.device, t: float, p: float):
    """|trainer - engine| log-prob over policy tokens. A token the trainer puts outside its
    top-p nucleus (log-prob -inf: the two sides rounded the nucleus edge differently) is
    counted in ``outside_nucleus`` and left out of max / mean."""
    batch = collate(trajs, pad, dev)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, t, p)
    m = batch.loss_mask.bool()
    d = (logp[m].double() - batch.rollout_logprobs[m].double()).abs()
    fin = torch.isfinite(d)
    d = d[fin]
    return {
        "max": d.max().item() if d.numel() else None,
        "mean": d.mean().item() if d.numel() else None,
        "tokens": int(m.sum()),
        "outside_nucleus": int((~fin).sum()),
    }


def engine_vs_trainer(ctx: Ctx) -> dict[str, Any]:
    sz, dev = ctx.sizes, ctx.device
    tok = build_char_tokenizer()
    seeds = list(range(1, sz.maze_tasks + 1))
    out: dict[str, Any] = {"tasks": sz.maze_tasks, "group_size": sz.maze_group}
    for label, base in _engine_models(ctx, tok).items():
        fp32 = copy.deepcopy(base).to(dev, torch.float32).eval()
        res: dict[str, Any] = {"params": sum(p.numel() for p in base.parameters())}
        for dtype in (torch.float32, torch.bfloat16):
            m = fp32 if dtype == torch.float32 else copy.deepcopy(base).to(dev, dtype).eval()
            engine = TorchEngine(m, tok.pad_token_id, seed=0)
            for temp, top_p in ((1.0, 1.0), (0.7, 0.9)):
                params = SamplingParams(temp, top_p, 4, stop_ids(tok), seed=11)
                trajs = run_episodes(MazeEnv, engine, tok, seeds, sz.maze_group, params)
                key = f"{str(dtype).removeprefix('torch.')}_t{temp}_p{top_p}"
                entry = {
                    "same_dtype": _gap(m, trajs, tok.pad_token_id, dev, temp, top_p),
                    "max_turns": max(t.num_turns for t in trajs),
                    "episodes": len(trajs),
                }
                if dtype != torch.float32:
                    entry["vs_fp32_trainer"] = _gap(fp32, trajs, tok.pad_token_id, dev, temp, top_p)
                res[key] = entry
            del engine
        out[label] = res
    return out


# -- driver ---------------------------------------------------------------------------------
SECTIONS: list[tuple[str, float, Callable[[Ctx], dict[str, Any]]]] = [
    ("lean_vs_hf", 5, lean_vs_hf),
    ("engine_vs_trainer", 10, engine_vs_trainer),
    ("pytest_gpu", 10, pytest_gpu),
    (
        "matmul_peak",
        3,
        lambda c: gpu_perf.matmul_peak(c.device, c.sizes.matmul_n, c.sizes.matmul_iters),
    ),
    ("rollout_throughput", 20, gpu_perf.rollout_throughput),
    ("grpo_step", 20, gpu_perf.grpo_step),
    ("scale", 10, gpu_perf.scale_ladder),
    ("grpo_run", 5, grpo_run),
]


def _meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except Exception:
        commit = None
    meta = {
        "mode": "smoke" if args.smoke else "full",
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "git_commit": commit,
        "budget_s": args.budget_s,
        "flops_formula": gpu_perf.FLOPS_FORMULA,
    }
    return meta


def run_check(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --smoke for the CPU smoke run)")
        device = torch.device("cuda")
    sizes = SMOKE if args.smoke else Sizes()
    ctx = Ctx(sizes, device, Budget(args.budget_s), args.smoke, {})
    report: dict[str, Any] = {"meta": _meta(args, device), "sizes": asdict(sizes), "sections": {}}
    wanted = set(args.only) if args.only else None
    for name, need_s, fn in SECTIONS:
        if wanted is not None and name not in wanted:
            continue
        entry: dict[str, Any]
        if not ctx.budget.allows(need_s):
            entry = {"status": "skipped", "note": ctx.budget.note()}
        else:
            t0 = time.perf_counter()
            try:
                entry = {"status": "ok", "result": fn(ctx)}
            except Skipped as e:
                entry = {"status": "skipped", "note": str(e)}
            except Exception as e:
                entry = {
                    "status": "error",
                    "error": f"{type(e).__name__}: {e}"[:1000],
                    "traceback": traceback.format_exc()[-3000:],
                }
            entry["seconds"] = round(time.perf_counter() - t0, 2)
            gpu_perf.free_memory(device)
        if name == "matmul_peak" and entry["status"] == "ok":
            ctx.peaks.update(
                {k: v for k, v in entry["result"].items() if k in ("bfloat16", "float32")}
            )
        report["sections"][name] = entry
        report["meta"]["elapsed_s"] = round(ctx.budget.total - ctx.budget.left(), 1)
        _write(out_dir, report)
        print(f"[gpu_check] {name}: {entry['status']} ({entry.get('seconds', 0)} s)", flush=True)
    return report


def _write(out_dir: Path, report: dict[str, Any]) -> None:
    tmp = out_dir / "report.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out_dir / "report.json")
    (out_dir / "report.md").write_text(to_markdown(report))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for report.json and report.md")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, seconds")
    p.add_argument("--budget-s", type=float, default=420.0, help="total seconds (default 420)")
    p.add_argument("--only", nargs="*", choices=[s[0] for s in SECTIONS], help="these sections")
    args = p.parse_args(argv)
    if args.budget_s <= 0:
        p.error("--budget-s must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    transformers.utils.logging.set_verbosity_error()
    report = run_check(parse_args(argv))
    print(json.dumps({k: v["status"] for k, v in report["sections"].items()}))
    return report


if __name__ == "__main__":
    main()
