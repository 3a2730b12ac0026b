"""Training models ("tenants") on one shared base model: LoRA adapters or full copies.

Every LoRA tenant is a named adapter of one ``peft.PeftModel`` around the base weights, so two
clients training two adapters share the base in memory but nothing else: each has its own
adapter tensors and its own AdamW state, and a forward pass only ever runs with one adapter
active (all work runs on the server's single worker thread, so switching is safe). A full
fine-tuning tenant (``create_model`` without ``lora_config``) gets its own copy of the model.

Where LoRA goes (the SDK's ``LoraConfig``): ``train_attn`` -> q/k/v/o projections,
``train_mlp`` -> gate/up/down projections, ``train_unembed`` -> ``lm_head``; ``seed`` seeds the
adapter's initialisation; alpha is the server's ``lora_alpha``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gyre.tinker.errors import UserError

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
UNEMBED = ("lm_head",)
KEEP_SAMPLERS = 4  # sampler adapters kept loaded; older ones are reloaded from disk if asked


@dataclass
class LoraSpec:
    rank: int
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True

    def targets(self, model: torch.nn.Module) -> list[str]:
        wanted = (ATTN if self.train_attn else ()) + (MLP if self.train_mlp else ())
        wanted += UNEMBED if self.train_unembed else ()
        # Any module name (once an adapter is injected, q_proj is a peft layer around a Linear).
        present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
        found = sorted(set(wanted) & present)
        if not found:
            raise UserError(f"lora_config: none of {list(wanted)} is a linear layer of this model")
        return found


@dataclass
class Tenant:
    """One training model: where its weights live, its optimizer and its step count."""

    model_id: str
    session_id: str
    base_model: str
    lora: LoraSpec | None
    module: torch.nn.Module  # the PeftModel (LoRA) or the tenant's own full model
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None = None
    steps: int = 0
    user_metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter(self) -> str:
        return adapter_name(self.model_id)

    def activate(self) -> torch.nn.Module:
        """The module to run for this tenant, with its adapter active."""
        if self.lora is not None:
            self.module.set_adapter(self.adapter)
        return self.module

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The tensors an update changes (adapter weights, or every weight of a full model)."""
        if self.lora is None:
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        import peft

        state = peft.get_peft_model_state_dict(
            self.module, adapter_name=self.adapter, save_embedding_layers=False
        )  # the (frozen) embeddings are the base model's, not the adapter's
        return {k: v.detach().clone() for k, v in state.items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is None:
            self.module.load_state_dict(state)
            return
        import peft

        result = peft.set_peft_model_state_dict(self.module, state, adapter_name=self.adapter)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise UserError(f"path: checkpoint has tensors this adapter lacks: {unexpected[:3]}")


def adapter_name(model_id: str) -> str:
    """peft adapter names cannot hold '.'; model ids are 'session:train:N'."""
    return "t_" + "".join(c if c.isalnum() else "_" for c in model_id)


class ModelCard:
    """What the HTTP side knows of the base model without holding its weights: the names it is
    served by, its tokenizer, vocabulary size and architecture (``runner: ray`` builds one in
    the driver; in one process the :class:`BaseModelHost` is its own card)."""

    def __init__(
        self,
        tokenizer: Any,
        name: str,
        path: str,
        alpha: float,
        hub_id: str | None = None,
        arch: tuple[str, int] = ("", 0),
    ) -> None:
        self.tokenizer, self.name, self.path, self.alpha = tokenizer, name, path, alpha
        self.hub_id = hub_id  # the hub id the base was resolved from (path: its cache folder)
        self.arch, self.vocab = arch  # model class name, output vocabulary size

    def names(self) -> set[str]:
        """The names a request may give the base model by: its name, path and hub id."""
        names = {self.name, self.path, str(Path(self.path).resolve())}
        return names | ({self.hub_id} if self.hub_id else set())

    def check_served(self, name: str, key: str = "base_model") -> None:
        """A :class:`UserError` on ``key`` unless ``name`` is this base model."""
        if name not in self.names():
            raise UserError(f"{key}: {name!r} is not served here; this server serves {self.name!r}")

    def identity(self) -> dict[str, Any]:
        """The card's fields but the tokenizer (what an actor sends back to the driver)."""
        return {
            "name": self.name,
            "path": self.path,
            "alpha": self.alpha,
            "hub_id": self.hub_id,
            "arch": (self.arch, self.vocab),
        }


class BaseModelHost(ModelCard):
    """The base model, the peft wrapper its LoRA tenants share, and the tokenizer."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        name: str,
        path: str,
        alpha: float,
        hub_id: str | None = None,
    ) -> None:
        vocab = int(model.get_output_embeddings().weight.shape[0])
        super().__init__(tokenizer, name, path, alpha, hub_id, (type(model).__name__, vocab))
        self.base = model
        self.peft_model: Any = None  # created with the first LoRA tenant
        self._samplers: list[str] = []  # loaded sampler adapters, oldest first

    def add_lora(
        self, model_id: str, spec: LoraSpec
    ) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        import peft

        if spec.rank < 1:
            raise UserError(f"lora_config.rank must be >= 1, got {spec.rank}")
        name = adapter_name(model_id)
        cfg = peft.LoraConfig(
            r=spec.rank,
            lora_alpha=self.alpha,
            lora_dropout=0.0,
            target_modules=spec.targets(self.base),
            task_type="CAUSAL_LM",
            bias="none",
        )
        with torch.random.fork_rng(devices=[]):
            if spec.seed is not None:
                torch.manual_seed(spec.seed)
            if self.peft_model is None:
                self.peft_model = peft.get_peft_model(self.base, cfg, adapter_name=name)
            else:
                self.peft_model.add_adapter(name, cfg)
        self.peft_model.set_adapter(name)
        params = [p for n, p in self.peft_model.named_parameters() if f".{name}." in n]
        for p in params:
            p.requires_grad_(True)
        return self.peft_model, params

    def remove_lora(self, model_id: str) -> None:
        name = adapter_name(model_id)
        if self.peft_model is not None and name in self.peft_model.peft_config:
            self.peft_model.delete_adapter(name)

    def full_copy(self) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
        """A full model with the base's weights (only while no adapter was injected into it)."""
        if self.peft_model is not None:
            raise UserError(
                "lora_config: full fine-tuning cannot share a server with LoRA models "
                "(start a separate gyre tinker-serve for it)"
            )
        model = copy.deepcopy(self.base)
        params = list(model.parameters())
        for p in params:
            p.requires_grad_(True)
        return model, params

    def base_module(self) -> tuple[torch.nn.Module, Any]:
        """(module, context manager) that runs the untouched base model."""
        import contextlib

        if self.peft_model is None:
            return self.base, contextlib.nullcontext()
        return self.peft_model, self.peft_model.disable_adapter()

    def sampler_adapter(self, folder: Any, version: str) -> torch.nn.Module:
        """The peft model with the saved adapter in ``folder`` active (loaded once per version:
        a checkpoint saved again under the same name is a new version)."""
        import peft

        name = f"s_{version}"
        if name in self._samplers:
            self._samplers.remove(name)
        self._samplers.append(name)
        if self.peft_model is None:
            self.peft_model = peft.PeftModel.from_pretrained(
                self.base, str(folder), adapter_name=name, is_trainable=False
            )
        elif name not in self.peft_model.peft_config:
            self.peft_model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
        self.peft_model.set_adapter(name)
        while len(self._samplers) > KEEP_SAMPLERS:  # an RL loop saves a new one every step
            self.peft_model.delete_adapter(self._samplers.pop(0))
        return self.peft_model
