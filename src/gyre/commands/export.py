"""``gyre export RUN_DIR --out DIR``: the run's policy as a plain Hugging Face folder.

The policy is ``RUN_DIR/final`` (or, when the run has not finished, its newest checkpoint's
``model/``). A LoRA run's policy is an adapter: it is loaded on the weights it was trained on
(``RUN_DIR/sft`` or the base model, as in
:func:`gyre.models.lora.lora_base_path`) and merged, so the
output loads with ``AutoModelForCausalLM.from_pretrained`` and no peft.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gyre.checkpoint.store import (
    CheckpointError,
    check_finite,
    check_manifest,
    list_checkpoints,
)
from gyre.config import Config, ConfigError, load_config
from gyre.errors import InputError
from gyre.models.build import load_pretrained
from gyre.models.lora import is_adapter_dir, lora_base_path, save_full_atomic


def policy_dir(run_dir: Path) -> Path:
    """Where the run's latest policy is: ``final/`` or the newest checkpoint's ``model/``."""
    if (run_dir / "final").is_dir():
        return run_dir / "final"
    ckpts = list_checkpoints(run_dir)
    if ckpts:
        return ckpts[-1] / "model"
    raise FileNotFoundError(f"'{run_dir}' has neither final/ nor a checkpoint to export")


def export_run(run_dir: str | Path, out: str | Path) -> Path:
    """Write the run's policy (adapter merged, if any) to ``out``; return ``out``."""
    from gyre.models.lora import load_adapter_into

    run_dir, out = Path(run_dir), Path(out)
    src = policy_dir(run_dir)
    check_manifest(src)  # final/ and checkpoints carry one: a torn or edited copy is refused
    cpu = torch.device("cpu")
    if is_adapter_dir(src) and not (src / "config.json").is_file():
        cfg_file = run_dir / "config.yaml"
        cfg = load_config(cfg_file) if cfg_file.is_file() else Config()
        base, tokenizer = load_pretrained(lora_base_path(cfg, run_dir), cpu)
        model = load_adapter_into(base, src, "default")
    else:
        model, tokenizer = load_pretrained(src, cpu)
    check_finite(model, out)  # a nan/inf policy is refused, naming the tensor
    out.parent.mkdir(parents=True, exist_ok=True)
    save_full_atomic(model, tokenizer, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="gyre export",
        description="Write a run's policy as a plain Hugging Face folder (LoRA merged).",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR")
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder")
    ns = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = export_run(ns.run_dir, ns.out)
    except (InputError, ConfigError) as exc:  # a bad folder / manifest / config: exit 2
        print(f"gyre export: error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, CheckpointError) as exc:
        print(f"gyre export: error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {ns.run_dir} to {out}")
    return 0
