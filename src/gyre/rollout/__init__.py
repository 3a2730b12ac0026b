"""Rollout: the :class:`Rollout` (engine, env factory, rewards, dynamic sampling), episodes of
env x engine (``episodes``), DAPO dynamic sampling (``dapo``) and held-out evaluation
(``evaluate``)."""

from gyre.rollout.core import Rollout

__all__ = ["Rollout"]
