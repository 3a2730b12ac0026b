"""LoRA policies with peft: build, reload, reference view, adapter files, merge.

With ``model.lora`` set, the policy is a ``peft.PeftModel`` around the (SFT or base) model; only
the adapter's ``lora_A`` / ``lora_B`` matrices have ``requires_grad``, so the optimizer, the
checkpoint (``save_pretrained`` of a PeftModel writes just the adapter) and weight sync all cover
the adapter alone. The KL reference is the same model with the adapter switched off
(:class:`AdapterDisabled`), so no second copy of the base weights is ever held.

On disk an adapter is peft's own format, ``adapter_model.safetensors`` + ``adapter_config.json``,
which is what ``vllm serve --enable-lora`` / SGLang / ``gyre serve`` load.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from gyre.config import Config, LoraConfig
from gyre.models.build import load_pretrained
from gyre.models.hub import resolve_model_path
from gyre.models.vision import freeze_vision, save_tokenizer, vision_modules

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("LoRA needs peft: pip install 'gyre[lora]'") from exc
    return peft


def is_peft_model(model: torch.nn.Module) -> bool:
    """A ``peft.PeftModel`` (an adapter wrapper), not a plain model."""
    return hasattr(model, "merge_and_unload") and hasattr(model, "peft_config")


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """Wrap ``model`` in a fresh LoRA adapter (B = 0, so the policy starts unchanged).

    A VLM's vision tower and projector are excluded (the adapter sits on the language model
    only; their names would match ``q_proj`` / ``all-linear`` too)."""
    peft = _peft()
    tower = {id(m) for m in vision_modules(model)}
    names = [n for n, m in model.named_modules() if id(m) in tower]
    lcfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        exclude_modules=rf"^({'|'.join(map(re.escape, names))})(\..*)?$" if names else None,
        task_type="CAUSAL_LM",
        bias="none",
    )
    try:
        return peft.get_peft_model(model, lcfg)
    except ValueError as exc:
        raise ValueError(f"model.lora.target_modules={cfg.target_modules!r}: {exc}") from exc


def lora_base_path(cfg: Config, run_dir: Path) -> Path:
    """The weights a run's adapter sits on: its SFT output if any, else the base model."""
    if (run_dir / "sft").is_dir():
        return run_dir / "sft"
    return resolve_model_path(cfg.model.path) if cfg.model.path else run_dir / "init"


def load_policy(
    cfg: Config, run_dir: Path, policy_path: Path, device: torch.device
) -> tuple[torch.nn.Module, Any]:
    """The trainable policy: a plain model, a fresh LoRA on it, or a checkpointed adapter."""
    if cfg.model.lora is None:
        if is_adapter_dir(policy_path) and not (policy_path / "config.json").is_file():
            raise ValueError(
                f"'{policy_path}' holds a LoRA adapter but model.lora is not set; "
                "resume LoRA runs with the same model.lora settings"
            )
        model, tokenizer = load_pretrained(policy_path, device)
        if cfg.model.freeze_vision:
            freeze_vision(model)  # a VLM's tower and projector (nothing for a text model)
        return model, tokenizer
    if is_adapter_dir(policy_path):
        base, tokenizer = load_pretrained(lora_base_path(cfg, run_dir), device)
        model = _peft().PeftModel.from_pretrained(base, policy_path, is_trainable=True)
        return model.to(device), tokenizer
    base, tokenizer = load_pretrained(policy_path, device)
    return apply_lora(base, cfg.model.lora), tokenizer


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """What the optimizer steps: every weight, or only the adapter under LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors that change in an update (keys as in ``model.state_dict()``)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


class AdapterDisabled(torch.nn.Module):
    """The KL reference of a LoRA policy: the same modules, adapter switched off.

    Calling it runs the wrapped PeftModel inside ``disable_adapter()``, which is exactly the
    frozen base (or SFT) model the adapter started from, without a second copy of its weights.
    """

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        self._peft = [peft_model]  # a list, so the policy is not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self._peft[0]
        with model.disable_adapter():
            return model(*args, **kwargs)


def save_adapter_atomic(model: torch.nn.Module, out_dir: Path) -> int:
    """Write the adapter in peft format to ``out_dir`` atomically; return the bytes written.

    It is written into a hidden sibling and renamed, so an engine that sees ``out_dir`` never
    reads a half-written file.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    peft = _peft()
    from safetensors.torch import save_file

    tmp.mkdir(parents=True)
    # The two files peft's save_pretrained writes, without its model card (a third of the time).
    state = peft.get_peft_model_state_dict(model)
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        tmp / ADAPTER_WEIGHTS,
        metadata={"format": "pt"},
    )
    model.peft_config[model.active_adapter].save_pretrained(tmp)
    nbytes = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return nbytes


def save_full_atomic(model: torch.nn.Module, tokenizer: Any, out_dir: Path) -> int:
    """Write a plain Hugging Face folder atomically (merging a LoRA adapter into a copy)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    plain = merged_copy(model) if is_peft_model(model) else model
    plain.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        save_tokenizer(tokenizer, tmp)
    nbytes = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return nbytes


def merged_copy(peft_model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the adapter folded into the weights (the policy itself is untouched)."""
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()


def load_adapter_into(model: torch.nn.Module, adapter_dir: Path, adapter_name: str) -> Any:
    """Load a peft adapter folder into ``model`` (plain or PeftModel); returns the PeftModel."""
    peft = _peft()
    adapter_dir = Path(adapter_dir)
    if not is_adapter_dir(adapter_dir):
        raise FileNotFoundError(
            f"'{adapter_dir}' is not a peft adapter folder (no {ADAPTER_CONFIG})"
        )
    if isinstance(model, peft.PeftModel):
        model.load_adapter(str(adapter_dir), adapter_name=adapter_name, is_trainable=False)
        return model
    return peft.PeftModel.from_pretrained(
        model, str(adapter_dir), adapter_name=adapter_name, is_trainable=False
    )
