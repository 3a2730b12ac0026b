"""Value models for PPO with GAE: a value head on the policy, or a separate critic.

Both read the last hidden state of a causal LM and map it to a scalar with a linear head.
``values[:, t]`` is V of the state *before* token t (the head's output at position t - 1), the
same alignment as the log-probs (gyre.types): token t's advantage uses V_t and V_{t+1}.

- ``head``: the head sits on the policy's own backbone, so the value loss also trains the
  policy's shared layers (one forward for both; ``vf_coef`` balances the two losses).
- ``critic``: a separate copy of the starting policy with its own head; policy and critic share
  no parameters.

The head starts at zero (V = 0 everywhere), so the first GAE advantages equal the discounted
rewards. Each kind has its own AdamW over the parameters only it owns.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Literal

import torch

from gyre.trainer.batch import Entropy, TokenBatch, logits_to_token_logprobs, token_logprobs
from gyre.trainer.scoring import ScoringOptions

VALUE_MODES = ("critic", "head")


def _hidden_size(model: torch.nn.Module) -> int:
    return int(model.config.hidden_size)


class ValueModel(torch.nn.Module):
    """A scalar value per token position from a causal LM's last hidden state."""

    def __init__(
        self,
        policy: torch.nn.Module,
        mode: Literal["head", "critic"] = "critic",
        lr: float = 1e-3,
    ) -> None:
        super().__init__()
        if mode not in VALUE_MODES:
            raise ValueError(f"unknown value model {mode!r}; valid: {', '.join(VALUE_MODES)}")
        self.mode = mode
        device = next(policy.parameters()).device
        self.head = torch.nn.Linear(_hidden_size(policy), 1).to(device)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        # A separate critic owns a copy of the backbone; the shared head reads the policy's.
        self.backbone = copy.deepcopy(policy).train() if mode == "critic" else None
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=0.0)

    @property
    def shared(self) -> bool:
        return self.backbone is None

    def values_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) last hidden states -> (B, T) values aligned to tokens (position 0 is 0)."""
        v = self.head(hidden.float()).squeeze(-1)  # (B, T): value after reading token t
        return torch.nn.functional.pad(v[:, :-1], (1, 0))

    FILE = "value_model.pt"

    def save(self, ckpt_dir: Path) -> None:
        """Write the head (and critic backbone) with its optimizer into a checkpoint folder,
        atomically (a temp file renamed), so a resumed PPO run continues with the same critic."""
        tmp = Path(ckpt_dir) / (self.FILE + ".tmp")
        torch.save(
            {"mode": self.mode, "model": self.state_dict(), "optim": self.optimizer.state_dict()},
            tmp,
        )
        tmp.replace(Path(ckpt_dir) / self.FILE)

    def load(self, ckpt_dir: Path) -> bool:
        """Restore from a checkpoint folder; warn and keep the fresh value model if it has none
        (a checkpoint written without a value model) or one of the other kind."""
        path = Path(ckpt_dir) / self.FILE
        if not path.is_file():
            warnings.warn(
                f"{ckpt_dir} holds no value model: the critic restarts from scratch", stacklevel=2
            )
            return False
        saved = torch.load(path, map_location=self.head.weight.device, weights_only=True)
        if saved["mode"] != self.mode:
            warnings.warn(
                f"{path} holds a '{saved['mode']}' value model, not '{self.mode}': restarting it",
                stacklevel=2,
            )
            return False
        self.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optim"])
        return True

    def forward(self, batch: TokenBatch) -> torch.Tensor:
        """Values (B, T) from the critic's own backbone (``critic`` mode only)."""
        _no_images(batch)
        if self.backbone is None:
            raise RuntimeError("a value head on the policy reads the policy's hidden states")
        out = self.backbone(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            output_hidden_states=True,
        )
        return self.values_from_hidden(out.hidden_states[-1])


def policy_forward(
    model: torch.nn.Module,
    batch: TokenBatch,
    temperature: float,
    top_p: float,
    *,
    entropy: Entropy = "off",
    value_model: ValueModel | None = None,
    options: ScoringOptions | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One forward of the policy: (logprobs (B, T), entropy or None, values (B, T) or None).

    ``options``: the scoring paths (:class:`gyre.trainer.scoring.ScoringOptions`, the run's
    ``perf.*``; default: the ``perf:`` defaults).

    Values come from the same forward when the value head sits on the policy, else from the
    critic's own forward.
    """
    shared = value_model is not None and value_model.shared
    if not shared:
        # No hidden states needed: the packed / chunked scoring path (gyre.trainer.scoring) applies.
        # Only the loss-masked tokens are ever read (loss, old / ref log-probs, metrics):
        # scoring just those skips each row's last token and everything after its last action.
        logp, ent = token_logprobs(
            model,
            batch,
            temperature,
            top_p,
            entropy,
            options=options,
            score_mask=batch.loss_mask,
        )
        return logp, ent, value_model(batch) if value_model is not None else None
    _no_images(batch)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        output_hidden_states=shared,
    )
    logp, ent = logits_to_token_logprobs(out.logits, batch.input_ids, temperature, top_p, entropy)
    values = None
    if value_model is not None:
        if shared:
            values = value_model.values_from_hidden(out.hidden_states[-1])
        else:
            values = value_model(batch)
    return logp, ent, values


def _no_images(batch: TokenBatch) -> None:
    if batch.images is not None:
        raise ValueError(
            "value models (train.algo.advantage=gae, a critic) are not supported for VLM "
            "batches yet (docs/vision.md): use an outcome advantage such as grpo"
        )
