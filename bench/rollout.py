"""Rollout throughput: gyre's ``TorchEngine`` against Hugging Face ``model.generate``.

Both sides use the same model object, the same batch, the same sampling distribution
(temperature 1.0, no top-k, top-p 1.0) and the same number of torch threads (default 1). Only
policy-generated tokens are counted; throughput is generated tokens per wall-clock second.

Scenario 1, "single-turn groups" (GRPO-style): P prompts of varied length (random strings of
the tiny tokenizer's characters, 8..48 long, seeded), each sampled G times, exactly
``max_new_tokens`` tokens per row (no stop token).

- gyre: ``engine.generate`` on the P*G requests; the engine prefills each distinct prompt once
  and forks the KV cache for the group.
- HF: one ``model.generate`` call on the P left-padded prompts with
  ``num_return_sequences=G`` (``min_new_tokens=max_new_tokens`` so every row has the same
  length as on the gyre side).

Scenario 2, "multi-turn maze episodes": E maze tasks (``MazeEnv`` defaults) times G episodes
each, with an untrained model, so most episodes run until the move budget. Each turn samples
at most 4 tokens and stops at a newline or EOS.

- gyre: ``gyre.rollout.episodes.run_episodes`` (the engine keeps each episode's KV cache between
  turns
  and prefills only the new observation).
- HF: the same loop written the way a ``generate`` user would: every turn, one
  ``model.generate`` call on the full token sequences of all active episodes (left-padded, no
  KV reuse across turns), then append the sampled tokens and the next observation's ids.

The env seeds are the same on both sides. The sampling RNGs differ (gyre draws each request's
tokens from a counter-based stream keyed by its seed; HF uses torch's global generator), so in
scenario 2 the episodes are not token-identical and may differ slightly in length: the table
reports turns, episodes and generated tokens of each side, and throughput is per generated
token. (In scenario 1 the work is identical: exactly ``max_new_tokens`` per row; HF's
``min_new_tokens`` masks EOS while gyre does not stop on it, which changes at most a sampled
token, never the amount of work.)

Timing: each side is warmed up once (scenario 1 with 4 new tokens, scenario 2 on one task only,
to save CPU), then
timed R times with ``time.perf_counter``, gyre and HF runs interleaved so that background load
hits both alike. The headline figure is the BEST (fastest) of the R runs -- other load on the
machine can only slow a run down -- and the median is reported next to it.

Run::

    python bench/rollout.py                  # defaults: 1 thread, P=8, G=8, 32 new tokens
    python bench/rollout.py --threads 2 --repeats 5
    python bench/rollout.py --model /path/to/hf-folder
    python bench/rollout.py --model DIR --prompts 16 --group-size 8 --max-new-tokens 128 \
        --scenarios single --repeats 2   # single-turn groups at a real model's size
    python bench/rollout.py --quick          # smoke test, a few seconds
    python bench/rollout.py --perf compaction=false  # one optimisation off (docs/performance.md)
    python bench/rollout.py --perf engine_lean_forward=false  # the engine on the HF forward

``--perf KEY=VALUE`` (repeatable) sets a key of the run config's ``perf:`` section for the gyre
side, exactly as ``gyre train perf.KEY=VALUE`` would (the engine's switches and
``continuous``; the trainer's keys do nothing here).

The last line of output is one JSON object with every figure and the gyre/HF ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import GenerationConfig, PreTrainedTokenizerBase

from gyre.config import ModelConfig, PerfConfig, load_config
from gyre.engines import TorchEngine
from gyre.engines.factory import torch_engine_options
from gyre.envs import MazeEnv
from gyre.models.build import CHARSET, count_parameters, create_tiny_checkpoint, load_pretrained
from gyre.rollout.episodes import RolloutStats, run_episodes, stop_ids
from gyre.rollout.transcript import encode_obs, prompt_ids
from gyre.types import GenerationRequest, SamplingParams

TEMPERATURE = 1.0
TOP_P = 1.0


@dataclass
class RunResult:
    """One timed run of one side of one scenario."""

    seconds: float
    generated_tokens: int
    turns: int = 0
    episodes: int = 0
    prompt_tokens: int = 0  # prompt tokens pushed through the model (prefill work)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class SideSummary:
    runs: list[RunResult] = field(default_factory=list)

    def best(self) -> RunResult:
        return max(self.runs, key=lambda r: r.tokens_per_s)

    def median_tok_s(self) -> float:
        return statistics.median(r.tokens_per_s for r in self.runs)

    def as_dict(self, prefix: str) -> dict[str, Any]:
        b = self.best()
        return {
            f"{prefix}_tok_s": round(b.tokens_per_s, 1),
            f"{prefix}_tok_s_median": round(self.median_tok_s(), 1),
            f"{prefix}_seconds": round(b.seconds, 4),
            f"{prefix}_generated_tokens": b.generated_tokens,
            f"{prefix}_prompt_tokens": b.prompt_tokens,
            f"{prefix}_turns": b.turns,
            f"{prefix}_episodes": b.episodes,
        }


# -- model and data ---------------------------------------------------------------------------
def load_model(
    path: str | None, seed: int, workdir: Path
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The model at ``path``, or gyre's tiny default built from ``seed`` into ``workdir``."""
    if not path:
        path = str(create_tiny_checkpoint(ModelConfig(), workdir / "tiny", seed))
    model, tokenizer = load_pretrained(path, torch.device("cpu"))
    model.eval()
    return model, tokenizer


def make_prompts(
    tokenizer: PreTrainedTokenizerBase, n: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """``n`` prompts: BOS + a random string of CHARSET characters of length min_len..max_len."""
    rng = np.random.default_rng(seed)
    chars = [c for c in CHARSET if c != "\n"]
    out = []
    for _ in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        text = "".join(rng.choice(chars, size=length))
        out.append(prompt_ids(tokenizer, text))
    return out


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded (input_ids, attention_mask), as HF decoder-only batched generation wants."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def hf_config(
    tokenizer: PreTrainedTokenizerBase,
    max_new_tokens: int,
    eos: Sequence[int] | None,
    num_return_sequences: int = 1,
) -> GenerationConfig:
    """Plain ancestral sampling (temperature 1, no top-k / top-p / penalties).

    With ``eos=None`` no stop token applies: ``min_new_tokens`` forces exactly
    ``max_new_tokens`` tokens per row.
    """
    kw: dict[str, Any] = {}
    if eos is None:
        kw["min_new_tokens"] = max_new_tokens
        kw["eos_token_id"] = tokenizer.eos_token_id
    else:
        kw["eos_token_id"] = list(eos)
    return GenerationConfig(
        do_sample=True,
        temperature=TEMPERATURE,
        top_k=0,
        top_p=TOP_P,
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        pad_token_id=tokenizer.pad_token_id,
        **kw,
    )


# -- scenario 1: single-turn groups -----------------------------------------------------------
def single_turn_gyre(
    engine: TorchEngine, prompts: list[list[int]], group_size: int, max_new_tokens: int
) -> RunResult:
    reqs = [GenerationRequest(p) for p in prompts for _ in range(group_size)]
    params = SamplingParams(
        temperature=TEMPERATURE, top_p=TOP_P, max_new_tokens=max_new_tokens, stop_token_ids=()
    )
    before = engine.stats["prefill_tokens"]
    t0 = time.perf_counter()
    outs = engine.generate(reqs, params)
    dt = time.perf_counter() - t0
    engine.release([None])  # fresh-batch requests carry no session
    n = sum(len(o.token_ids) for o in outs)
    assert n == len(reqs) * max_new_tokens, n
    return RunResult(dt, n, prompt_tokens=engine.stats["prefill_tokens"] - before)


def single_turn_hf(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
) -> RunResult:
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    cfg = hf_config(tokenizer, max_new_tokens, None, num_return_sequences=group_size)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    dt = time.perf_counter() - t0
    rows, new = out.shape[0], out.shape[1] - ids.shape[1]
    assert rows == len(prompts) * group_size and new == max_new_tokens, (rows, new)
    return RunResult(dt, rows * new, prompt_tokens=int(mask.sum()) * group_size)


# -- scenario 2: multi-turn maze episodes -----------------------------------------------------
def multi_turn_gyre(
    engine: TorchEngine,
    tokenizer: PreTrainedTokenizerBase,
    make_env: Callable[[], MazeEnv],
    seeds: Sequence[int],
    group_size: int,
    max_new_tokens: int,
    continuous: bool = True,
) -> RunResult:
    params = SamplingParams(
        temperature=TEMPERATURE,
        top_p=TOP_P,
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids(tokenizer),
    )
    stats = RolloutStats()
    before = engine.stats["prefill_tokens"]
    t0 = time.perf_counter()
    trajs = run_episodes(
        make_env, engine, tokenizer, seeds, group_size, params, stats, continuous=continuous
    )
    dt = time.perf_counter() - t0
    return RunResult(
        dt,
        stats.generated_tokens,
        turns=stats.turns,
        episodes=len(trajs),
        prompt_tokens=engine.stats["prefill_tokens"] - before,
    )


def _trim(row: list[int], stops: set[int]) -> list[int]:
    """HF pads a row after its stop token; keep the tokens up to and including the stop."""
    for k, t in enumerate(row):
        if t in stops:
            return row[: k + 1]
    return row


def multi_turn_hf(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    make_env: Callable[[], MazeEnv],
    seeds: Sequence[int],
    group_size: int,
    max_new_tokens: int,
) -> RunResult:
    """The maze loop of ``run_episodes``, re-feeding every full sequence to ``generate``."""
    stops = stop_ids(tokenizer)
    stop_set = set(stops)
    cfg = hf_config(tokenizer, max_new_tokens, stops)
    t0 = time.perf_counter()
    n = len(seeds) * group_size
    envs = [make_env() for _ in range(n)]
    ids = [
        prompt_ids(tokenizer, envs[k * group_size + j].reset(int(seed)))
        for k, seed in enumerate(seeds)
        for j in range(group_size)
    ]
    active = list(range(n))
    gen_tokens = turns = prompt_tokens = 0
    while active:
        batch, mask = left_pad([ids[i] for i in active], tokenizer.pad_token_id)
        prompt_tokens += int(mask.sum())
        with torch.no_grad():
            out = model.generate(input_ids=batch, attention_mask=mask, generation_config=cfg)
        new_rows = out[:, batch.shape[1] :].tolist()
        still = []
        for i, row in zip(active, new_rows, strict=True):
            toks = _trim(row, stop_set)
            ids[i].extend(toks)
            gen_tokens += len(toks)
            turns += 1
            obs, _r, done, _info = envs[i].step(tokenizer.decode(toks, skip_special_tokens=True))
            if not done:
                ids[i].extend(encode_obs(tokenizer, obs))
                still.append(i)
        active = still
    dt = time.perf_counter() - t0
    return RunResult(dt, gen_tokens, turns=turns, episodes=n, prompt_tokens=prompt_tokens)


# -- driver -----------------------------------------------------------------------------------
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--prompts", type=int, default=8, help="single-turn: distinct prompts P")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt / task G")
    p.add_argument("--max-new-tokens", type=int, default=32, help="single-turn: tokens per row")
    p.add_argument("--episodes", type=int, default=4, help="multi-turn: maze tasks E")
    p.add_argument("--turn-tokens", type=int, default=4, help="multi-turn: max tokens per turn")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side (R)")
    p.add_argument("--model", default="", help="local HF model folder (default: tiny gyre model)")
    p.add_argument("--seed", type=int, default=0, help="model init, prompts, env seeds, RNG")
    p.add_argument(
        "--compile", action="store_true", help="gyre: torch.compile the decode step (slow warm-up)"
    )
    p.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: smoke test")
    p.add_argument(
        "--scenarios",
        default="single,multi",
        help="comma-separated: single (single-turn groups), multi (multi-turn maze)",
    )
    p.add_argument(
        "--perf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="gyre: a perf.* config key, e.g. compaction=false (repeatable)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.group_size, args.max_new_tokens = 2, 4, 8
        args.episodes, args.repeats = 1, 1
    for name in ("threads", "prompts", "group_size", "max_new_tokens", "episodes", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    args.scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    if not args.scenarios or set(args.scenarios) - {"single", "multi"}:
        p.error("--scenarios: a comma-separated subset of single,multi")
    overrides = [f"perf.{item}" for item in args.perf]
    if args.compile:
        overrides.append("perf.compile_decode=true")
    try:
        args.perf_config = load_config(None, overrides).perf
    except ValueError as exc:
        p.error(str(exc))
    return args


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else float("nan")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(args.threads)
    except RuntimeError:  # already set by an earlier parallel op in this process
        pass
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="gyre-bench-") as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model, tokenizer = load_model(args.model or None, args.seed, workdir)
    perf: PerfConfig = args.perf_config
    engine = TorchEngine(
        model,
        pad_token_id=tokenizer.pad_token_id,
        seed=args.seed,
        options=torch_engine_options(perf),
    )
    torch.manual_seed(args.seed)  # HF generate samples from the global RNG

    G = args.group_size
    prompts = make_prompts(tokenizer, args.prompts, 8, 48, args.seed)
    seeds = [args.seed * 1000 + k for k in range(args.episodes)]

    def make_env() -> MazeEnv:
        return MazeEnv()

    single: dict[str, Callable[[int], RunResult]] = {
        "gyre": lambda n: single_turn_gyre(engine, prompts, G, n),
        "hf": lambda n: single_turn_hf(model, tokenizer, prompts, G, n),
    }
    multi: dict[str, Callable[[Sequence[int]], RunResult]] = {
        "gyre": lambda s: multi_turn_gyre(
            engine, tokenizer, make_env, s, G, args.turn_tokens, perf.continuous
        ),
        "hf": lambda s: multi_turn_hf(model, tokenizer, make_env, s, G, args.turn_tokens),
    }
    do_single, do_multi = "single" in args.scenarios, "multi" in args.scenarios
    results: dict[str, dict[str, SideSummary]] = {}
    if do_single:
        results["single_turn"] = {"gyre": SideSummary(), "hf": SideSummary()}
    if do_multi:
        results["multi_turn"] = {"gyre": SideSummary(), "hf": SideSummary()}
    warmup: dict[str, float] = {}
    for side in ("gyre", "hf"):  # warm-up, untimed (with --compile: includes compilation)
        t0 = time.perf_counter()
        if do_single:
            single[side](min(4, args.max_new_tokens))
        if do_multi:
            multi[side](seeds[:1])
        warmup[side] = round(time.perf_counter() - t0, 2)
    for _ in range(args.repeats):  # interleaved so background load hits both sides alike
        for side in ("gyre", "hf") if do_single else ():
            results["single_turn"][side].runs.append(single[side](args.max_new_tokens))
        for side in ("gyre", "hf") if do_multi else ():
            results["multi_turn"][side].runs.append(multi[side](seeds))

    report: dict[str, Any] = {"bench": "rollout", "threads": args.threads, "stat": "best"}
    for scen, sides in results.items():
        g, h = sides["gyre"], sides["hf"]
        entry = {**g.as_dict("gyre"), **h.as_dict("hf")}
        entry["ratio"] = _ratio(g.best().tokens_per_s, h.best().tokens_per_s)
        entry["ratio_median"] = _ratio(g.median_tok_s(), h.median_tok_s())
        report[scen] = entry
    if do_single:
        report["single_turn"].update(
            prompts=args.prompts, group_size=G, max_new_tokens=args.max_new_tokens
        )
    if do_multi:
        report["multi_turn"].update(
            tasks=args.episodes, group_size=G, max_new_tokens=args.turn_tokens
        )
    report.update(
        # the perf.* keys the gyre side ran with; lean_forward: whether it really ran
        engine_flags={**perf.model_dump(), "lean_forward": engine.runner.lean() is not None},
        load_average_1m=round(os.getloadavg()[0], 2),
        warmup_s=warmup,
        repeats=args.repeats,
        quick=args.quick,
        model=args.model or "tiny-default",
        model_params=count_parameters(model),
        torch=torch.__version__,
        transformers=transformers.__version__,
    )
    print_table(report)
    print(json.dumps(report))
    return report


def print_table(r: dict[str, Any]) -> None:
    print(
        f"gyre TorchEngine vs HF generate | model {r['model']} ({r['model_params']:,} params) | "
        f"threads {r['threads']} | torch {r['torch']} | transformers {r['transformers']}"
    )
    print(f"tokens/s = generated tokens / wall s; best of {r['repeats']} (median in brackets)")
    head = f"{'scenario':<14}{'side':<6}{'tok/s':>18}{'gen tok':>9}{'prompt tok':>12}"
    head += f"{'turns':>7}{'eps':>5}{'sec':>9}"
    print(head)
    print("-" * len(head))
    for scen in ("single_turn", "multi_turn"):
        if scen not in r:
            continue
        e = r[scen]
        for side in ("gyre", "hf"):
            tps = f"{e[f'{side}_tok_s']:.0f} ({e[f'{side}_tok_s_median']:.0f})"
            print(
                f"{scen:<14}{side:<6}{tps:>18}{e[f'{side}_generated_tokens']:>9}"
                f"{e[f'{side}_prompt_tokens']:>12}{e[f'{side}_turns']:>7}"
                f"{e[f'{side}_episodes']:>5}{e[f'{side}_seconds']:>9.3f}"
            )
        print(f"{scen:<14}ratio gyre/HF: {e['ratio']:.2f}x (median {e['ratio_median']:.2f}x)")


if __name__ == "__main__":
    main()
