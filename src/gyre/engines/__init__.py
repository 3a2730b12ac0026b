"""Rollout engines: anything that turns prompt token ids into sampled token ids + logprobs.

``TorchEngine`` runs in process; ``HttpEngine`` (``gyre.engines.http_engine``, needs the
``serve`` extra) drives vLLM / SGLang / ``gyre serve`` over HTTP. ``build_engine`` picks one
from ``cfg.engine``.
"""

from gyre.engines.base import Engine
from gyre.engines.factory import build_engine, initial_sync
from gyre.engines.sync import WeightSync
from gyre.engines.torch_engine import TorchEngine

__all__ = ["Engine", "TorchEngine", "WeightSync", "build_engine", "initial_sync"]
