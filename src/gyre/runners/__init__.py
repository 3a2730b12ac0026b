"""Runners: how the loop's phases are placed on processes.

``local`` is :func:`gyre.loop.train` itself (one process). ``ray`` (:mod:`gyre.runners.ray`)
puts rollout workers and a data-parallel trainer group into Ray actors. Only the ``ray_*``
modules import Ray; the loop, algorithms and this package's other modules never do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RAY_MISSING = "the Ray runner needs Ray: pip install 'gyre[ray]'"


def require_ray() -> Any:
    """Import Ray or fail with the extra to install."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(RAY_MISSING) from exc
    return ray


def get_runner(name: str) -> Callable[..., dict[str, Any]]:
    """``train(cfg, sink=None) -> summary`` of the runner ``name``."""
    if name == "local":
        from gyre.loop import train

        return train
    if name == "ray":
        require_ray()
        from gyre.runners.ray import train as ray_train

        return ray_train
    raise ValueError(f"unknown runner {name!r}; valid: local, ray")
