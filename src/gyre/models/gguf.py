"""GGUF files in: ``gyre import FILE.gguf --out DIR`` writes a plain Hugging Face folder.

transformers reads a GGUF file (``from_pretrained(dir, gguf_file=...)``) and dequantises it to
fp32, but the model it returns refuses ``save_pretrained`` ("quantized with gguf and is not
serializable"). This module loads it that way, moves the weights into a fresh model built from the
same config (without the quantization marker), and saves weights (safetensors), tokenizer, chat
template and generation config, so every later load is an ordinary ``from_pretrained(DIR)``.

The folder records where it came from in ``gyre_import.json``: the source file, its size and
sha256, the architecture and the transformers version that dequantised it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from gyre.errors import InputError

MAGIC = b"GGUF"
RECORD = "gyre_import.json"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_architecture(src: Path) -> str:
    """``general.architecture`` of a GGUF file; an :class:`InputError` naming the file when it
    is not one or the ``gguf`` package is missing."""
    src = Path(src)
    if not src.is_file():
        raise InputError(f"{src}: no such file")
    with open(src, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise InputError(
            f"{src}: not a GGUF file (it starts with {head!r}, GGUF files with {MAGIC!r})"
        )
    try:
        from gguf import GGUFReader
    except ImportError:
        raise InputError(
            f"{src}: reading GGUF files needs the gguf package: pip install 'gyre[gguf]'"
        ) from None
    try:
        field = GGUFReader(src).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except (KeyError, ValueError, IndexError) as exc:
        raise InputError(
            f"{src}: a GGUF file without a readable general.architecture ({exc})"
        ) from None


def _check_supported(src: Path, arch: str) -> None:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # the list also holds the metadata groups "general" and "tokenizer"; transformers renames a
    # few architectures (e.g. "qwen2moe" is read as "qwen2_moe") and decides the rest
    known = set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"}
    if not {arch, arch.replace("moe", "_moe")} & known:
        raise InputError(
            f"{src}: architecture '{arch}' cannot be dequantised by transformers "
            f"(it reads {', '.join(sorted(known))})"
        )


def load_gguf(src: Path) -> tuple[torch.nn.Module, Any]:
    """(an fp32 causal LM that can be saved, its tokenizer) from a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(src).resolve()
    arch = gguf_architecture(src)
    _check_supported(src, arch)
    try:
        tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            src.parent, gguf_file=src.name, dtype=torch.float32
        )
    except (ValueError, KeyError, NotImplementedError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InputError(f"{src}: transformers cannot load it ({first})") from None
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are already fp32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.eval()
    return model, tok


def import_gguf(src: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the Hugging Face folder ``out`` from the GGUF file ``src``; returns its record.

    ``out`` must not exist or be empty. The folder is written beside it and renamed into place,
    so a failed import never leaves a half-written ``out``.
    """
    src, out = Path(src).expanduser(), Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty folder")
    model, tok = load_gguf(src)
    stage = out.parent / f".{out.name}.importing"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    model.save_pretrained(stage)
    tok.save_pretrained(stage)
    record = {
        "source": str(src.resolve()),
        "size": src.stat().st_size,
        "sha256": sha256_of(src),
        "architecture": gguf_architecture(src),
        "model_type": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "chat_template": bool(getattr(tok, "chat_template", None)),
        "transformers": __import__("transformers").__version__,
    }
    (stage / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    stage.rename(out)
    return record
