"""Ray waits with a deadline and a heartbeat (:mod:`gyre.deadlines`): every ``ray.get`` and
``ray.wait`` of the Ray runner goes through here.

A Ray actor that is alive but never returns (a wedged rollout worker, a trainer rank stuck in a
collective) is seen by no health check: Ray only reports actors that *died*. So every call is
given ``faults.call_timeout_s`` (start-up calls: ``faults.startup_timeout_s``); past it the run
stops with a :class:`~gyre.deadlines.PeerFault` naming the stage and the actors (exit 69).
"""

from __future__ import annotations

from typing import Any

from gyre.config.ops import FaultsConfig
from gyre.deadlines import Heartbeat, PeerFault


class Waits:
    """The deadlines of one run's Ray waits (``faults.*``)."""

    def __init__(self, faults: FaultsConfig) -> None:
        self.f = faults

    def get(self, refs: Any, kind: str, stage: str, peer: str, startup: bool = False) -> Any:
        """``ray.get(refs)`` once every ref is ready, within the deadline; else a fault."""
        import ray

        timeout_s, key = self._deadline(startup)
        pending = list(refs) if isinstance(refs, list) else [refs]
        hb = Heartbeat(stage, peer, timeout_s, self.f.heartbeat_s)
        while pending:
            if hb.left <= 0:
                raise PeerFault(kind, stage, peer, hb.waited, key)
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=hb.slice())
            hb.beat()
        return ray.get(refs, timeout=max(hb.left, 1.0))

    def any(self, refs: list[Any], kind: str, stage: str, peer: str) -> list[Any]:
        """The first ready refs of ``refs`` (``ray.wait(num_returns=1)``), within the deadline."""
        import ray

        timeout_s, key = self._deadline(False)
        hb = Heartbeat(stage, peer, timeout_s, self.f.heartbeat_s)
        while True:
            if hb.left <= 0:
                raise PeerFault(kind, stage, peer, hb.waited, key)
            ready, _ = ray.wait(refs, num_returns=1, timeout=hb.slice())
            if ready:
                return ready
            hb.beat()

    def _deadline(self, startup: bool) -> tuple[float, str]:
        s = self.f.startup_timeout_s if startup else self.f.call_timeout_s
        return s, f"faults.{'startup' if startup else 'call'}_timeout_s={s:g}"
