"""GRPO on a vision-language model through the one loop: the coloured-square image env
(tests/vision_helpers.py), tiny Qwen2.5-VL / Idefics3 built locally, full and LoRA training."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from gyre.config import load_config
from gyre.runners import train

BASE = [
    "run.threads=1", "log.console=off", "sft.steps=0", "train.steps=2", "train.tasks_per_step=2",
    "train.group_size=4", "train.lr=0.05", "train.mini_batches=1", "train.kl_coef=0",
    "train.sampling.max_new_tokens=6", "eval.episodes=2", "checkpoint.every=0",
    "env.name=vision_helpers:ColourEnv", "env.kwargs.turns=2",
]  # fmt: skip
VISION = ("visual.", "model.visual.", "model.vision_model.", "model.connector.")


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def _run(tmp_path, *extra: str):
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*BASE, f"run.dir={run_dir}", *extra])
    train(cfg)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 2
    # the trainer recomputed the engine's log-probs with the same pixels and positions
    assert all(r["train/rollout_logprob_gap"] < 1e-4 for r in steps)
    return run_dir


def _check_frozen_tower(run_dir, init):
    before, after = _weights(init), _weights(run_dir / "final")
    tower = [n for n in before if n.startswith(VISION)]
    assert tower
    assert all(torch.equal(before[n], after[n]) for n in tower)  # bitwise unchanged
    moved = [n for n in before if not n.startswith(VISION) and not torch.equal(before[n], after[n])]
    assert moved, "the language model did not change"


def test_gyre_train_tiny_qwen_vl_with_an_image_env(tmp_path):
    """The built-in tiny Qwen2.5-VL (model.kind), 2 GRPO steps, multi-turn images: the vision
    tower is frozen (model.freeze_vision) and bitwise unchanged; the final folder loads back."""
    run_dir = _run(tmp_path, "model.kind=qwen2_5_vl")
    _check_frozen_tower(run_dir, run_dir / "init")
    from gyre.models.build import load_pretrained

    model, tok = load_pretrained(run_dir / "final", torch.device("cpu"))
    assert model.config.model_type == "qwen2_5_vl" and tok.chat_template


def test_tiny_idefics3_loads_and_trains_two_steps(tmp_path):
    from vision_helpers import tiny_vlm

    init = tiny_vlm("idefics3", tmp_path / "vlms")
    run_dir = _run(tmp_path, f"model.path={init}")
    _check_frozen_tower(run_dir, init)


def test_lora_on_the_language_model_leaves_the_vision_tower_bitwise_unchanged(tmp_path):
    pytest.importorskip("peft")
    run_dir = _run(tmp_path, "model.kind=qwen2_5_vl", "model.lora.rank=4",
                   "model.lora.target_modules=all-linear", "model.freeze_vision=false")  # fmt: skip
    adapter = load_file(run_dir / "final" / "adapter_model.safetensors")
    assert adapter and not [k for k in adapter if "visual" in k]  # the LM's layers only
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())
    import peft
    from transformers import AutoModelForImageTextToText

    base = AutoModelForImageTextToText.from_pretrained(run_dir / "init")
    merged = peft.PeftModel.from_pretrained(base, run_dir / "final").merge_and_unload()
    before, after = _weights(run_dir / "init"), merged.state_dict()
    tower = [n for n in before if n.startswith(VISION)]
    assert tower and all(torch.equal(before[n], after[n.replace("visual.", "model.visual.")])
                         for n in tower)  # fmt: skip


@pytest.mark.parametrize("window", [[], ["rollout.history_turns=0", "rollout.keep_opening=false"]])
def test_gyre_train_visual_maze_sft_then_grpo(tmp_path, window):
    """`gyre train env.name=visual_maze model.kind=qwen2_5_vl`: 3 SFT steps on image
    demonstrations (the loss falls, finite), then 2 GRPO steps on the SFT checkpoint; also
    memoryless (rollout.history_turns=0: one image per turn prompt, each turn a row)."""
    run_dir = tmp_path / "run"
    over = [*window,
        "run.threads=1", "log.console=off", "model.kind=qwen2_5_vl", "env.name=visual_maze",
        "sft.steps=3", "sft.demos=8", "sft.batch_size=4", "sft.lr=0.01", "train.steps=2",
        "train.tasks_per_step=2", "train.group_size=2", "train.sampling.max_new_tokens=2",
        "eval.episodes=2", "checkpoint.every=0", f"run.dir={run_dir}",
        "train.algo.skip_zero_advantage=false",  # score every row: the log-prob gap is checked
    ]  # fmt: skip
    train(load_config(None, over))
    sft = [json.loads(line) for line in (run_dir / "sft_metrics.jsonl").read_text().splitlines()]
    losses = [r["sft/loss"] for r in sft if "sft/loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses) and losses[-1] < losses[0]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "train/loss" in r]
    assert len(steps) == 2 and all(r["train/rollout_logprob_gap"] < 1e-4 for r in steps)
    assert (run_dir / "sft" / "preprocessor_config.json").is_file()
    _check_frozen_tower(run_dir, run_dir / "init")
    # `gyre eval` of the VLM folder (its env and rollout from gyre_env.json) plays the held-out
    # mazes as the run's last evaluation did: the same greedy episodes
    from gyre.cli import main

    ev = tmp_path / "ev"
    args = ["eval", f"model.path={run_dir / 'final'}", f"run.dir={ev}", "eval.episodes=2",
            "log.console=off", "run.threads=1", "train.sampling.max_new_tokens=2"]  # fmt: skip
    assert main(args) == 0
    got = json.loads((ev / "eval.json").read_text())
    after = json.loads((run_dir / "summary.json").read_text())["after"]
    for key in ("eval/success_greedy", "eval/moves_greedy", "eval/bump_frac_greedy"):
        assert got[key] == after[key], key


@pytest.mark.slow
def test_sft_on_images_learns_to_read_the_pixels(tmp_path):
    """SFT alone on image demonstrations (the coloured square, its colour the answer): the
    tiny Qwen2.5-VL, vision tower frozen, goes from 0 to >= 90 % held-out greedy success, so the
    answer is read from the pixels (about 45 s on one loaded core). 300 steps: at 150 the
    same run read 67.5 % on an Intel (AVX-512) machine, where MKL takes other kernels."""
    run_dir = tmp_path / "run"
    over = [
        "run.threads=1", "log.console=off", "model.kind=qwen2_5_vl",
        "env.name=vision_helpers:ColourDemoEnv", "env.kwargs.turns=1", "sft.steps=300",
        "sft.batch_size=16", "sft.demos=800", "sft.noise=0", "train.steps=1",
        "train.tasks_per_step=2", "train.group_size=2", "train.sampling.max_new_tokens=8",
        "eval.episodes=40", "eval.sampled=false", "checkpoint.every=0", f"run.dir={run_dir}",
    ]  # fmt: skip
    train(load_config(None, over))
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r["eval/success_greedy"] for r in evals if "eval/success_greedy" in r)
    assert first >= 0.9  # step 0: the SFT checkpoint, before any GRPO


@pytest.mark.parametrize("mix", [False, True])
def test_visual_maze_probe_script_reads_a_describe_run(tmp_path, mix):
    """scripts/visual_maze_probe.py on a 2-step SFT of the describe reply: every turn scored,
    every failed episode counted once, the fields' shares bounded by the whole line's. With a
    mixed teacher each rule is scored apart: a move is the teacher's when it is either rule's."""
    import importlib.util
    from pathlib import Path

    from gyre.cli import main

    run = tmp_path / "run"
    args = ["sft", "model.kind=qwen3_vl", "env.name=visual_maze", "env.visual_maze.describe=true",
            "env.maze.observation=compass", "env.maze.view=1", "env.visual_maze.cell_px=16",
            "env.visual_maze.pad_to=32", "rollout.history_turns=0", "sft.steps=2",
            "sft.demos=4", "sft.batch_size=2", "train.sampling.max_new_tokens=16",
            "log.console=off", "run.threads=1", f"run.dir={run}"]  # fmt: skip
    if mix:
        args += ["env.maze.demonstrator=greedy", "env.maze.demonstrator_mix={careful: 0.35}"]
    assert main(args) == 0
    script = Path(__file__).resolve().parents[2] / "scripts" / "visual_maze_probe.py"
    spec = importlib.util.spec_from_file_location("visual_maze_probe", script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.probe(run, "sft", episodes=3)
    assert out["episodes"] == 3 and out["turns"] >= 3
    shares = out["turn shares"]
    assert all(0.0 <= v <= 1.0 for v in shares.values())
    assert shares["description exact"] <= min(shares[k] for k in ("up", "goal offset"))
    failed = round(3 * (1 - out["success"]))
    assert sum(out["failures by first move not the teacher's"].values()) == failed
    assert ("where the rules disagree, the move" in out) == mix
    if mix:
        rules = [shares["move = greedy's"], shares["move = careful's"]]
        assert max(rules) <= shares["move = teacher's"] <= sum(rules)
        split = out["where the rules disagree, the move"]
        assert 0 <= split["turns"] <= out["turns"] and split["greedy"] + split["careful"] <= 1.0
