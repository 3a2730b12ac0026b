"""``gyre export`` of a full fine-tuning run (the LoRA case is in test_http_training.py)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from gyre.cli import main

RUN = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "log.console=off",
    "run.threads=1",
    "env.name=arithmetic",
    "sft.steps=0",
    "train.steps=1",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "eval.episodes=0",
    "checkpoint.every=1",
]


def test_export_full_run_and_errors(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *RUN, f"run.dir={run}"]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 0
    a = AutoModelForCausalLM.from_pretrained(run / "final", dtype=torch.float32).eval()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    x = torch.randint(4, 60, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(a(input_ids=x).logits, b(input_ids=x).logits)
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "o2")]) == 1
    assert "neither final/ nor a checkpoint" in capsys.readouterr().err
