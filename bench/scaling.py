"""Scaling: throughput and peak memory as batch size and sequence length double (4 points each).

Two workloads, each run by gyre and by its plain counterpart side by side, same model, same
threads:

- **rollout**: gyre ``TorchEngine`` vs HF ``model.generate`` sampling groups of G=8 (prompts of
  8..48 tokens, exactly ``new`` tokens per row). Batch sweep: rows = 16, 32, 64, 128 at 32 new
  tokens; length sweep: 32, 64, 128, 256 new tokens at 64 rows. tokens/s = generated tokens/s.
- **train**: one GRPO optimizer step (forward + backward + AdamW) on synthetic trajectories of
  lengths uniform in [T/2, T] with loss on the second half. gyre's packed + chunked scoring vs
  the plain path (right padding, full-vocab log-softmax over every position; ``perf.pack=false
  perf.logprob_chunk=0``). Batch sweep: 32, 64, 128, 256 trajectories at T=128; length sweep:
  T = 64, 128, 256, 512 at 64 trajectories. tokens/s = real (non-pad) tokens/s.
  ``--vocab`` sets the vocabulary of the (randomly initialised, otherwise tiny default) Llama:
  the log-softmax memory that chunking saves grows with it.

Every point runs in a fresh subprocess, so its peak RSS (``ru_maxrss``) is its own; the report
gives the peak and the peak minus the RSS after the model was built (the work's own memory).
Each point is timed ``--repeats`` times (default 3) after a warm-up and the fastest run counts
(other load can only slow a run down).

Run::

    python bench/scaling.py                   # both workloads, tiny model (vocab 99)
    python bench/scaling.py --only train --vocab 32000
    python bench/scaling.py --quick           # smoke test: 2 small points per sweep, in process

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- one point, in a child process ------------------------------------------------------------
def point_rollout(side: str, rows: int, new: int, seed: int, repeats: int = 1) -> dict[str, Any]:
    import rollout as rb  # bench/rollout.py
    from gyre.engines import TorchEngine

    with tempfile.TemporaryDirectory() as tmp:
        model, tok = rb.load_model(None, seed, Path(tmp))
        prompts = rb.make_prompts(tok, max(rows // 8, 1), 8, 48, seed)
        torch.manual_seed(seed)
        base = _rss_mib()
        if side == "gyre":
            engine = TorchEngine(model, tok.pad_token_id, seed=seed)
            rb.single_turn_gyre(engine, prompts[:1], 2, 2)  # warm-up
            runs = [rb.single_turn_gyre(engine, prompts, 8, new) for _ in range(repeats)]
        else:
            rb.single_turn_hf(model, tok, prompts[:1], 2, 2)
            runs = [rb.single_turn_hf(model, tok, prompts, 8, new) for _ in range(repeats)]
    r = min(runs, key=lambda x: x.seconds)  # best of the repeats: load only slows a run
    return {"tok_s": r.tokens_per_s, "seconds": r.seconds, "base_rss_mib": base}


def point_train(
    side: str, rows: int, length: int, vocab: int, seed: int, repeats: int = 1
) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from gyre.config import ModelConfig, TrainConfig
    from gyre.trainer.batch import collate
    from gyre.trainer.scoring import ScoringOptions
    from gyre.trainer.update import policy_update
    from gyre.types import Trajectory

    mc = ModelConfig()
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=mc.hidden_size,
        intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers,
        num_attention_heads=mc.num_heads,
        num_key_value_heads=mc.num_heads,
        max_position_embeddings=max(1024, length),
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(rows):
        T = int(torch.randint(length // 2, length + 1, (1,), generator=g))
        ids = torch.randint(1, vocab, (T,), generator=g).tolist()
        mask = [0] * (T // 2) + [1] * (T - T // 2)
        lps = [-4.0 * m for m in mask]
        trajs.append(Trajectory(ids, mask, lps, 0.0, i // 8, 0, 1, False, i))
    adv = torch.randn(rows, generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # plain: perf.pack=false perf.logprob_chunk=0 (right padding, full-vocab log-softmax)
    scoring = ScoringOptions(pack=False, chunk=0) if side == "plain" else ScoringOptions()
    settings = TrainConfig.model_validate(
        {
            "mini_batches": 1,
            "micro_batch_size": rows,
            "loss_agg": "token-mean",
            "algo": {"old_logprobs": "rollout"},
        }
    )
    batch = collate(trajs, 0, torch.device("cpu"))
    tokens = sum(len(t.token_ids) for t in trajs)
    base = _rss_mib()
    times = []
    for _ in range(repeats):  # the same work every time (the weights change, not the shapes)
        t0 = time.perf_counter()
        policy_update(model, opt, batch, adv, settings, scoring=scoring)
        times.append(time.perf_counter() - t0)
    dt = min(times)
    return {"tok_s": tokens / dt, "seconds": dt, "base_rss_mib": base}


def run_point(kind: str, side: str, rows: int, length: int, args: argparse.Namespace) -> dict:
    if args.quick:  # smoke test: in process (peak RSS is then the process's running peak)
        if kind == "rollout":
            out = point_rollout(side, rows, length, args.seed, args.repeats)
        else:
            out = point_train(side, rows, length, args.vocab, args.seed, args.repeats)
        out["peak_rss_mib"] = _peak_mib()
        return out
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--point",
        kind,
        side,
        str(rows),
        str(length),
        "--threads",
        str(args.threads),
        "--vocab",
        str(args.vocab),
        "--seed",
        str(args.seed),
        "--repeats",
        str(args.repeats),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"point {kind} {side} {rows} {length} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- driver -----------------------------------------------------------------------------------
SWEEPS = {
    "rollout": {"batch": ([16, 32, 64, 128], 32), "seq_len": (64, [32, 64, 128, 256])},
    "train": {"batch": ([32, 64, 128, 256], 128), "seq_len": (64, [64, 128, 256, 512])},
}
SIDES = {"rollout": ("gyre", "hf"), "train": ("gyre", "plain")}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--only", choices=["rollout", "train"], default=None)
    p.add_argument("--vocab", type=int, default=0, help="train: vocab size (0: tiny default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per point (after a warm-up); best"
    )
    p.add_argument("--quick", action="store_true", help="2 small points per sweep")
    p.add_argument(
        "--point", nargs=4, metavar=("KIND", "SIDE", "ROWS", "LEN"), help=argparse.SUPPRESS
    )
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if args.vocab < 0:
        p.error("--vocab must be >= 0")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.quick:
        args.repeats = 1
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.vocab == 0:
        from gyre.models.build import build_char_tokenizer

        args.vocab = len(build_char_tokenizer())
    if args.point:
        kind, side, rows, length = (
            args.point[0],
            args.point[1],
            int(args.point[2]),
            int(args.point[3]),
        )
        if kind == "rollout":
            out = point_rollout(side, rows, length, args.seed, args.repeats)
        else:
            out = point_train(side, rows, length, args.vocab, args.seed, args.repeats)
        out["peak_rss_mib"] = _peak_mib()
        print(json.dumps(out))
        return out

    kinds = [args.only] if args.only else ["rollout", "train"]
    report: dict[str, Any] = {
        "bench": "scaling",
        "threads": args.threads,
        "vocab": args.vocab,
        "repeats": args.repeats,
    }
    for kind in kinds:
        for sweep, (rows_spec, len_spec) in SWEEPS[kind].items():
            pts = []
            rows_list = rows_spec if isinstance(rows_spec, list) else [rows_spec] * 4
            len_list = len_spec if isinstance(len_spec, list) else [len_spec] * 4
            if args.quick:
                rows_list = [8, 16] if sweep == "batch" else [8, 8]
                len_list = [16, 16] if sweep == "batch" else [8, 16]
            for rows, length in zip(rows_list, len_list, strict=True):
                entry: dict[str, Any] = {"rows": rows, "len": length}
                for side in SIDES[kind]:
                    r = run_point(kind, side, rows, length, args)
                    entry[f"{side}_tok_s"] = round(r["tok_s"], 1)
                    entry[f"{side}_peak_rss_mib"] = round(r["peak_rss_mib"], 1)
                    entry[f"{side}_work_rss_mib"] = round(r["peak_rss_mib"] - r["base_rss_mib"], 1)
                other = SIDES[kind][1]
                entry["ratio"] = round(entry["gyre_tok_s"] / entry[f"{other}_tok_s"], 3)
                entry["peak_rss_mib"] = entry["gyre_peak_rss_mib"]
                pts.append(entry)
                print(f"{kind:<8}{sweep:<8} {json.dumps(entry)}", flush=True)
            report[f"{kind}_{sweep}"] = pts
    # flat aliases used by the smoke test: the first workload's sweeps
    report["batch"] = report[f"{kinds[0]}_batch"]
    report["seq_len"] = report[f"{kinds[0]}_seq_len"]
    report["quick"] = args.quick
    report["torch"] = torch.__version__
    print_table(report, kinds)
    print(json.dumps(report))
    return report


def print_table(r: dict[str, Any], kinds: list[str]) -> None:
    for kind in kinds:
        other = SIDES[kind][1]
        print(f"\n{kind}: gyre vs {other} ({r['threads']} thread(s), vocab {r['vocab']})")
        print(
            f"{'sweep':<8}{'rows':>6}{'len':>6}{'gyre tok/s':>12}{other + ' tok/s':>12}{'ratio':>7}"
            f"{'gyre MiB':>10}{other + ' MiB':>10}{'gyre work':>11}{other + ' work':>11}"
        )
        for sweep in ("batch", "seq_len"):
            for e in r[f"{kind}_{sweep}"]:
                print(
                    f"{sweep:<8}{e['rows']:>6}{e['len']:>6}{e['gyre_tok_s']:>12.0f}"
                    f"{e[f'{other}_tok_s']:>12.0f}{e['ratio']:>7.2f}"
                    f"{e['gyre_peak_rss_mib']:>10.0f}{e[f'{other}_peak_rss_mib']:>10.0f}"
                    f"{e['gyre_work_rss_mib']:>11.0f}{e[f'{other}_work_rss_mib']:>11.0f}"
                )


if __name__ == "__main__":
    main()
