"""The in-process engine's switches (:class:`gyre.engines.torch_engine.TorchEngine`).

A run sets them from its ``perf:`` section (:func:`gyre.engines.factory.torch_engine_options`).
Results never depend on any of them; each can be switched off to measure what it buys
(``bench/rollout.py --engine-flags``, docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """How :class:`~gyre.engines.torch_engine.TorchEngine` batches and runs its model.

    Scheduling (:mod:`gyre.engines.scheduler`):

    - ``max_batch_size``: the most rows decoded together (0 = unbounded).
    - ``prefix_sharing``: identical prompts admitted together are prefilled once and forked.
    - ``compaction``: finished rows leave the decode batch (off: static batching).
    - ``admit_ratio``: how many requests must wait, relative to running rows, before a
      mid-decode admission prefill is worth its forward call.
    - ``compact_min``: the fraction of finished rows at which compaction gathers the live rows
      (0: every step a row finishes; default half: on a small model a decode step costs about
      the same for 17 rows as for 64, while the gather out of the grouped layout costs ~1 ms).

    Model forward (:mod:`gyre.engines.model_runner`):

    - ``compile_decode``: run the one-token decode step through ``torch.compile`` (off by
      default: it pays per step but costs minutes of compilation on a small CPU).
    - ``lean_forward``: run Llama-family models through :class:`gyre.models.lean.LeanForward`,
      falling back to the HF forward for anything else.
    - ``shared_prefix_attention``: decode attends a forked group's prompt once per group
      (lean forward only).
    """

    max_batch_size: int = 0
    prefix_sharing: bool = True
    compaction: bool = True
    admit_ratio: float = 0.5
    compact_min: float = 0.5
    compile_decode: bool = False
    lean_forward: bool = True
    shared_prefix_attention: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_size < 0:
            raise ValueError(
                f"max_batch_size must be >= 0 (0 = unbounded), got {self.max_batch_size}"
            )
        if not 0.0 <= self.compact_min <= 1.0:
            raise ValueError(f"compact_min must be in [0, 1], got {self.compact_min}")
