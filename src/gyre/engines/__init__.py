"""Rollout engines: anything that turns prompt token ids into sampled token ids + logprobs."""

from gyre.engines.base import Engine
from gyre.engines.torch_engine import TorchEngine

__all__ = ["Engine", "TorchEngine"]
