"""What padding costs a VLM SFT step: consecutive micro-batches against length order.

A VLM batch is scored right-padded through the Hugging Face forward (docs/vision.md,
"Trainer"). On the visual maze's step-wise rows an episode's opening turn (with the intro) is
about three times a later turn, so consecutive slices of ``train.micro_batch_size`` rows pad
most micro-batches to the longest row; :func:`gyre.trainer.batch.micro_batches` takes the rows
shortest first and cuts by padded size. Both sides run :func:`gyre.trainer.sft.sft_step` on
the same batches of the visual-maze example's describe setting (the tiny Qwen3-VL with the
example's 4 x 128 language model), with a zero learning rate so every step sees the same
weights; the best of ``--repeats`` interleaved runs is reported, with the padded sizes.

    python bench/vlm_micro_batches.py --episodes 16 --repeats 3
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import gyre.trainer.sft as sft
from gyre.config import load_config
from gyre.models.vision import load_vlm, vision_of
from gyre.models.vision_build import LMSize, create_tiny_vlm
from gyre.sft import demonstrations, expand_steps
from gyre.trainer.batch import TokenBatch, collate, consecutive_slices, micro_batches

DESCRIBE = [
    "examples/visual-maze/config.yaml", "model.kind=qwen3_vl", "env.visual_maze.cell_px=16",
    "env.visual_maze.pad_to=32", "env.visual_maze.view=agent", "env.visual_maze.image_last=true",
    "env.visual_maze.describe=true", "env.maze.observation=compass", "env.maze.view=1",
    "rollout.history_turns=0", "rollout.keep_opening=false", "env.maze.demonstrator=careful",
]  # fmt: skip


def consecutive(batch: TokenBatch, size: int) -> list[slice]:
    return consecutive_slices(batch.input_ids.shape[0], size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=16, help="demonstrations per SFT batch")
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--micro-batch-size", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(__file__).resolve().parents[1]
    over = [f"sft.demos={args.episodes * args.batches}", *DESCRIBE[1:]]
    cfg = load_config(root / DESCRIBE[0], over)
    with tempfile.TemporaryDirectory() as tmp:
        lm = LMSize(**cfg.model.tiny_vlm.model_dump())
        model, tok = load_vlm(create_tiny_vlm("qwen3_vl", Path(tmp) / "vlm", 0, lm), "cpu")
        demos = demonstrations(cfg, Path(tmp), tok)
    batches = []
    for k in range(args.batches):
        rows, _ = expand_steps(demos[k * args.episodes : (k + 1) * args.episodes])
        batches.append(collate(rows, tok.pad_token_id, torch.device("cpu"), vision_of(tok)))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sides = {"consecutive": consecutive, "length order": micro_batches}
    times: dict[str, list[float]] = {name: [] for name in sides}
    padded: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, cut in sides.items():
            sft.micro_batches = cut  # what sft_step splits with
            t0 = time.perf_counter()
            for b in batches:
                sft.sft_step(model, opt, b, args.micro_batch_size)
            times[name].append((time.perf_counter() - t0) / len(batches))
            padded[name] = sum(
                b.rows(s).input_ids.numel() for b in batches for s in cut(b, args.micro_batch_size)
            )
    sft.micro_batches = micro_batches
    real = sum(int(b.attention_mask.sum()) for b in batches)
    rows = sum(b.input_ids.shape[0] for b in batches)
    print(f"{args.batches} SFT batches of {args.episodes} episodes ({rows} rows, {real} tokens)")
    for name in sides:
        print(f"{name:>13}: {min(times[name]):.2f} s a step (best of {args.repeats}), "
              f"{padded[name]} padded positions")  # fmt: skip
    ratio = min(times["consecutive"]) / min(times["length order"])
    print(f"length order is {ratio:.2f}x faster")


if __name__ == "__main__":
    main()
