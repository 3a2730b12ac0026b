"""Runners place the loop's phases on processes; :func:`train` picks one from ``cfg.runner``.

``local`` (:mod:`gyre.runners.local`) calls the :class:`~gyre.trainer.Trainer` and
:class:`~gyre.rollout.Rollout` in this process. ``ray`` (:mod:`gyre.runners.ray`) wraps the very
same objects in Ray actors: rollout workers and a data-parallel trainer group. Both run
:func:`gyre.loop.train`. Only ``runners/ray.py`` and ``runners/submit.py`` import Ray.
"""

from __future__ import annotations

from typing import Any

from gyre.runners.placement import require_ray


def train(cfg: Any, sink: Any = None) -> dict[str, Any]:
    """Run ``cfg`` (SFT, then GRPO) on the runner it names; returns the run summary."""
    if cfg.runner == "local":
        from gyre.runners.local import train as local_train

        return local_train(cfg, sink)
    if cfg.runner == "ray":
        require_ray()
        from gyre.runners.ray import train as ray_train

        return ray_train(cfg, sink)
    raise ValueError(f"unknown runner {cfg.runner!r}; valid: local, ray")
