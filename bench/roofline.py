"""Fraction of this CPU's peak: gyre's decode and GRPO update against a measured roofline.

Two ceilings are measured first, on the same threads as the work:

- **matmul rate**: the best of ``--reps`` fp32 ``torch.mm`` of two 2048 x 2048 matrices
  (FLOP/s = 2 * 2048^3 / s);
- **memory bandwidth**: the best of ``--reps`` reads of a 512 MiB fp32 tensor (``sum``; bytes
  read / s), larger than any cache.

Then two pieces of gyre's own work on ``--model`` (default: gyre's tiny Llama), fp32:

- **decode** at the benchmark's batch (``bench/rollout.py``'s single-turn groups: P prompts x
  G samples, N new tokens, no stop): the engine's ``generate`` with N new tokens minus one with
  1 new token (prefill + first sample) gives the time of N - 1 decode steps. Per step:
  FLOPs = rows x (2 x matmul parameters + attention 4 x layers x heads x head_dim x context);
  bytes = every matmul weight once (fp32) + the keys/values each step must read (a group's
  prompt once per group, each row's own tokens per row). Each is set against its ceiling, and
  the bound that applies is the larger of FLOPs / rate and bytes / bandwidth (the roofline
  time); the fraction is roofline time / measured time.
- **update**: one GRPO optimizer step (``policy_update``, full fine-tuning, the run config's
  defaults but one mini-batch and ``old_logprobs=rollout``, fused AdamW) on the trajectories of
  a rollout of P_u x G_u samples of N_u tokens. FLOPs = 6 x matmul parameters x T + attention
  12 x layers x heads x head_dim x sum over sequences of S^2 / 2, with T the positions the
  trainer feeds (a group's shared prompt once, tree packing) and S each sample's length. The
  LM head is counted at every fed position (the trainer runs it on scored positions only),
  checkpointing's recomputation is not counted (it is work the bound does not need). The update
  is compute-bound; the fraction is FLOPs / rate / measured time. The optimizer step is part
  of the measured time.

Matmul parameters: every layer's projections plus the LM head (a tied embedding counts once,
as the head; the embedding lookup is not a matmul). The last line is one JSON object.

Run::

    python bench/roofline.py --model DIR --threads 1
    python bench/roofline.py --quick     # smoke test on the tiny model
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gyre.config import TrainConfig
from gyre.engines import TorchEngine
from gyre.trainer.batch import collate
from gyre.trainer.update import policy_update
from gyre.types import GenerationRequest, SamplingParams, Trajectory
from rollout import load_model, make_prompts


def best_seconds(fn: Callable[[], object], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_rate(reps: int, n: int = 2048) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), reps)


def read_bandwidth(reps: int, mib: int = 512) -> float:
    x = torch.ones(mib * 2**20 // 4)
    return x.numel() * 4 / best_seconds(lambda: x.sum(), reps)


def shape(model: torch.nn.Module) -> dict[str, int]:
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    return {
        "layers": int(cfg.num_hidden_layers),
        "attn_width": heads * head_dim,
        "kv_width": int(getattr(cfg, "num_key_value_heads", None) or heads) * head_dim,
        "matmul_params": layer_params + model.lm_head.weight.numel(),
    }


def measure_decode(
    model: torch.nn.Module, tok: Any, args: argparse.Namespace, s: dict[str, int]
) -> dict[str, Any]:
    engine = TorchEngine(model, pad_token_id=tok.pad_token_id, seed=args.seed)
    prompts = make_prompts(tok, args.prompts, 8, 48, args.seed)
    reqs = [GenerationRequest(p) for p in prompts for _ in range(args.group_size)]

    def run(n: int) -> Callable[[], object]:
        return lambda: engine.generate(reqs, SamplingParams(1.0, 1.0, n, ()))

    t_full = best_seconds(run(args.max_new_tokens), args.decode_reps)
    t_first = best_seconds(run(1), args.decode_reps)
    steps = args.max_new_tokens - 1
    rows = len(reqs)
    step_s = (t_full - t_first) / steps
    prompt_tokens = sum(len(p) for p in prompts)
    mean_prompt = prompt_tokens / len(prompts)
    ctx = mean_prompt + args.max_new_tokens / 2  # mean context over the decode steps
    flops = rows * (2 * s["matmul_params"] + 4 * s["layers"] * s["attn_width"] * ctx)
    kv_cols = prompt_tokens + rows * args.max_new_tokens / 2  # prompts once per group
    kv_bytes = 2 * s["layers"] * s["kv_width"] * kv_cols * 4
    weight_bytes = s["matmul_params"] * 4
    return {
        "rows": rows,
        "steps": steps,
        "step_ms": step_s * 1e3,
        "tokens_per_s": rows / step_s,
        "flop_per_step": flops,
        "bytes_per_step": weight_bytes + kv_bytes,
        "kv_bytes_per_step": kv_bytes,
    }


def rollout_trajs(model: torch.nn.Module, tok: Any, args: argparse.Namespace) -> list[Trajectory]:
    engine = TorchEngine(model, pad_token_id=tok.pad_token_id, seed=args.seed + 1)
    prompts = make_prompts(tok, args.update_prompts, 8, 48, args.seed + 1)
    reqs = [GenerationRequest(p) for p in prompts for _ in range(args.group_size)]
    outs = engine.generate(reqs, SamplingParams(1.0, 1.0, args.update_tokens, ()))
    trajs = []
    for k, (r, o) in enumerate(zip(reqs, outs, strict=True)):
        n, m = len(r.prompt_ids), len(o.token_ids)
        ids, lps = [*r.prompt_ids, *o.token_ids], [0.0] * n + list(o.logprobs)
        reward = float(k % 3 == 0)  # group-varied rewards: every row gets an advantage
        trajs.append(Trajectory(ids, [0] * n + [1] * m, lps, reward, k // args.group_size, 0, 1,
                                False, k))  # fmt: skip
    return trajs


def measure_update(
    model: torch.nn.Module, tok: Any, args: argparse.Namespace, s: dict[str, int]
) -> dict[str, Any]:
    trajs = rollout_trajs(model, tok, args)
    rows = len(trajs)
    adv = torch.tensor([t.reward for t in trajs]).view(-1, args.group_size)
    adv = ((adv - adv.mean(1, keepdim=True)) / (adv.std(1, keepdim=True) + 1e-6)).flatten()
    settings = TrainConfig.model_validate(
        {"mini_batches": 1, "micro_batch_size": rows, "algo": {"old_logprobs": "rollout"}}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)
    batch = collate(trajs, tok.pad_token_id, torch.device("cpu"))
    seconds = best_seconds(lambda: policy_update(model, opt, batch, adv, settings), args.reps_u)
    lengths = [len(t.token_ids) for t in trajs]
    prompt_len = [t.loss_mask.index(1) for t in trajs]
    fed = sum(ln - p for ln, p in zip(lengths, prompt_len, strict=True))
    fed += sum(prompt_len[::args.group_size])  # a group's prompt once  # fmt: skip
    attn = 12 * s["layers"] * s["attn_width"] * sum(ln * ln / 2 for ln in lengths)
    flops = 6 * s["matmul_params"] * fed + attn
    return {
        "rows": rows,
        "positions": fed,
        "seconds": seconds,
        "flop": flops,
        "attention_flop": attn,
        "tokens_per_s": sum(lengths) / seconds,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="local HF model folder (default: tiny gyre model)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16, help="decode: prompts P")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt G")
    p.add_argument("--max-new-tokens", type=int, default=32, help="decode: new tokens N")
    p.add_argument("--update-prompts", type=int, default=4, help="update: prompts P_u")
    p.add_argument("--update-tokens", type=int, default=64, help="update: new tokens N_u")
    p.add_argument("--reps", type=int, default=5, help="repeats of the ceiling measurements")
    p.add_argument("--decode-reps", type=int, default=1, help="repeats of each decode run")
    p.add_argument("--reps-u", type=int, default=2, help="repeats of the update (best)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes: smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens = 2, 4, 8
        args.update_prompts, args.update_tokens, args.reps, args.reps_u = 2, 8, 1, 1
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be at least 2 (decode steps = N - 1)")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    rate, bw = matmul_rate(args.reps), read_bandwidth(args.reps)
    with tempfile.TemporaryDirectory(prefix="gyre-roofline-") as tmp:
        model, tok = load_model(args.model or None, args.seed, Path(tmp))
    s = shape(model)
    dec = measure_decode(model, tok, args, s)
    upd = measure_update(model, tok, args, s)
    t_step = dec["step_ms"] / 1e3
    dec["flop_s"] = dec["flop_per_step"] / t_step
    dec["bytes_s"] = dec["bytes_per_step"] / t_step
    dec["of_matmul_rate"] = dec["flop_s"] / rate
    dec["of_bandwidth"] = dec["bytes_s"] / bw
    compute_t, memory_t = dec["flop_per_step"] / rate, dec["bytes_per_step"] / bw
    dec["bound"] = "compute" if compute_t >= memory_t else "memory"
    dec["of_bound"] = max(compute_t, memory_t) / t_step
    upd["flop_s"] = upd["flop"] / upd["seconds"]
    upd["of_matmul_rate"] = upd["flop_s"] / rate
    report = {
        "bench": "roofline",
        "model": args.model or "tiny-default",
        "threads": args.threads,
        "matmul_gflop_s": rate / 1e9,
        "read_gb_s": bw / 1e9,
        **{f"model_{k}": v for k, v in s.items()},
        "decode": dec,
        "update": upd,
        "args": {k: v for k, v in vars(args).items()},
        "load_average_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
    }
    print_table(report)
    print(json.dumps(report, default=float))
    return report


def print_table(r: dict[str, Any]) -> None:
    d, u = r["decode"], r["update"]
    print(
        f"roofline | {r['model']} ({r['model_matmul_params']:,} matmul params) | "
        f"threads {r['threads']} | load {r['load_average_1m']}"
    )
    print(
        f"ceilings: fp32 matmul {r['matmul_gflop_s']:.1f} GFLOP/s, read {r['read_gb_s']:.1f} GB/s"
    )
    print(
        f"decode  {d['rows']} rows: {d['step_ms']:.1f} ms/step, {d['tokens_per_s']:.0f} tok/s | "
        f"{d['flop_s'] / 1e9:.1f} GFLOP/s = {100 * d['of_matmul_rate']:.0f} % of matmul | "
        f"{d['bytes_s'] / 1e9:.2f} GB/s = {100 * d['of_bandwidth']:.0f} % of bandwidth | "
        f"{d['bound']}-bound: {100 * d['of_bound']:.0f} % of the bound"
    )
    print(
        f"update  {u['rows']} rows, {u['positions']} positions: {u['seconds']:.2f} s | "
        f"{u['flop_s'] / 1e9:.1f} GFLOP/s (attention {100 * u['attention_flop'] / u['flop']:.1f} % "
        f"of FLOPs) = {100 * u['of_matmul_rate']:.0f} % of matmul"
    )


if __name__ == "__main__":
    main()
