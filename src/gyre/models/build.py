"""The policy model: any local Hugging Face causal LM, or a tiny Llama built on the spot.

The tiny default is a Llama-config model with a character-level tokenizer. Both are created
locally (no download) and written with ``save_pretrained``, then read back with
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` -- the same path that
loads a real checkpoint a user has on disk.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from gyre.config import ModelConfig
from gyre.errors import InputError
from gyre.models.hub import resolve_model_path
from gyre.models.vision import is_vlm_folder, load_vision, load_vlm

# Every character the built-in envs and their prompts can produce. Unknown characters map to
# <unk>, so a user prompt with other symbols still tokenises.
CHARSET = (
    "\n !\"#$%&'()*+,-./0123456789:;<=>?@"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~"
)
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer: one token per character, decoding concatenates them back."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARSET))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def build_tiny_model(
    cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase, seed: int
) -> LlamaForCausalLM:
    """A small Llama initialised from ``seed``; about 1M parameters at the defaults."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def create_tiny_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int) -> Path:
    """Build the tiny default model + tokenizer and save both as a Hugging Face folder."""
    out = Path(out_dir)
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(cfg, tokenizer, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def resolve_device(name: str, key: str = "run.device") -> torch.device:
    """'auto' picks cuda when available; anything else is passed to torch as given (``key``:
    the config field the name came from, for the error)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key}={name!r} but CUDA is not available on this machine")
    return dev


def load_pretrained(
    path: str | Path, device: torch.device
) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, in fp32 on ``device``, from a local folder or a hub
    id (:func:`gyre.models.hub.resolve_model_path`)."""
    p = resolve_model_path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path '{p}' is not a Hugging Face model folder (no config.json there)"
        )
    check_model_config(p)
    if is_vlm_folder(p):  # image-text-to-text: AutoModelForImageTextToText + AutoProcessor
        return load_vlm(p, device)
    tokenizer = load_tokenizer(p)
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    model.to(device)
    return model, tokenizer


def check_model_config(folder: Path) -> None:
    """A model folder's ``config.json`` must be a JSON object; else an :class:`InputError`
    naming the file (transformers would fail with a multi-line traceback)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: must hold a JSON object, got {type(data).__name__}")


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """A local folder's (or hub id's) tokenizer, with EOS as padding when it has no pad token."""
    path = resolve_model_path(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_model_config(Path(path))
    if is_vlm_folder(path):  # the tokenizer of a VLM carries its image processor
        from transformers import AutoConfig

        return load_vision(path, AutoConfig.from_pretrained(Path(path)))[1]
    tokenizer = AutoTokenizer.from_pretrained(Path(path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
