"""The trainer's side of a colocated pool: take the devices for the update, give them back after.

With ``ray.placement=colocated`` the engines and the trainer share devices. Each update, on
every trainer rank (``ray.handover``):

1. ``to_trainer``: rank 0 puts the engines to sleep (``ray.handover.sleep_engines``, HTTP engines:
   ``gyre.engines.handover``); every rank moves its optimizer state (and, with
   ``offload_weights``, its weights) back onto its device;
2. the update runs;
3. ``to_engines``: every rank moves its optimizer state (and weights) to host memory
   (``offload_optimizer``) and rank 0 wakes the engines, before the new weights are loaded into
   them and the next rollout starts.

Metrics (``handover/*``): the seconds of each move, the optimizer bytes moved off the device (0
when the trainer runs on the CPU, where there is no device memory to free) and what the engines
report freed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gyre.config import Config


def _move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Move every state tensor to ``device``; returns the bytes that changed device."""
    moved = 0
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.device != device:
                if v.device.type != "cpu" or device.type != "cpu":
                    moved += v.numel() * v.element_size()
                state[k] = v.to(device, non_blocking=False)
    return moved


class Handover:
    """One trainer rank's part of the hand-over (rank 0 also drives the engines)."""

    def __init__(self, cfg: Config, trainer: Any, device: torch.device, engine: Any) -> None:
        self.opts = cfg.ray.handover
        self.trainer, self.device, self.engine = trainer, device, engine

    def to_trainer(self) -> dict[str, float]:
        m: dict[str, float] = {}
        if self.engine is not None and self.opts.sleep_engines:
            from gyre.engines.handover import sleep_engines

            m.update(sleep_engines(self.engine, self.opts.sleep_level))
        t0 = time.perf_counter()
        if self.opts.offload_weights:
            self.trainer.model.to(self.device)
        if self.opts.offload_optimizer:
            _move_optimizer(self.trainer.optimizer, self.device)
        m["handover/trainer_load_s"] = time.perf_counter() - t0
        return m

    def to_engines(self) -> dict[str, float]:
        m: dict[str, float] = {}
        t0 = time.perf_counter()
        cpu = torch.device("cpu")
        if self.opts.offload_optimizer:
            m["handover/optimizer_offload_bytes"] = float(
                _move_optimizer(self.trainer.optimizer, cpu)
            )
        if self.opts.offload_weights:
            self.trainer.model.to(cpu)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        m["handover/trainer_offload_s"] = time.perf_counter() - t0
        if self.engine is not None and self.opts.sleep_engines:
            from gyre.engines.handover import wake_engines

            m.update(wake_engines(self.engine))
        return m
