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
from gyre.deadlines import Heartbeat, PeerFault, ray_ready


class Waits:
    """The deadlines of one run's Ray waits (``faults.*``)."""

    def __init__(self, faults: FaultsConfig) -> None:
        self.f = faults

    def get(self, refs: Any, kind: str, stage: str, peer: str, startup: bool = False) -> Any:
        """``ray.get(refs)`` once every ref is ready, within the deadline; else a fault.

        The refs of a ``trainer`` call are one per rank, in rank order: as soon as one rank
        reports a collective that timed out, the ranks whose calls are still running are the
        ones that never reached it, and the run stops naming them (a rank that *died* is
        raised as such instead: the trainer group restarts)."""
        import ray

        timeout_s, key = self._deadline(startup)
        every = list(refs) if isinstance(refs, list) else [refs]
        pending, checked = list(every), 0
        hb = Heartbeat(stage, peer, timeout_s, self.f.heartbeat_s)

        def fault() -> PeerFault:
            return PeerFault(kind, stage, peer, hb.waited, key)

        while pending:
            _, pending = ray_ready(pending, hb, fault)
            if kind == "trainer" and pending and len(every) - len(pending) > checked:
                checked = len(every) - len(pending)
                _stuck_in_a_collective(every, pending)
            hb.beat()
        try:
            return ray.get(refs, timeout=max(hb.left, 1.0))
        except PeerFault as exc:  # raised in an actor: its own one line, not Ray's wrapper
            raise _cause(exc) from None

    def any(self, refs: list[Any], kind: str, stage: str, peer: str) -> list[Any]:
        """The first ready refs of ``refs`` (``ray.wait(num_returns=1)``), within the deadline."""
        timeout_s, key = self._deadline(False)
        hb = Heartbeat(stage, peer, timeout_s, self.f.heartbeat_s)
        return ray_ready(refs, hb, lambda: PeerFault(kind, stage, peer, hb.waited, key))[0]

    def _deadline(self, startup: bool) -> tuple[float, str]:
        s = self.f.startup_timeout_s if startup else self.f.call_timeout_s
        return s, f"faults.{'startup' if startup else 'call'}_timeout_s={s:g}"


def _cause(exc: PeerFault) -> PeerFault:
    cause = getattr(exc, "cause", None)  # a RayTaskError that is also the PeerFault it wraps
    return cause if isinstance(cause, PeerFault) else exc


def _stuck_in_a_collective(ranks: list[Any], pending: list[Any]) -> None:
    """Raise when a finished rank's call failed on a collective timeout while others still
    run: those never reached the collective. A rank that died wins (the group restarts)."""
    import ray

    faults, other = [], None
    for rank, ref in enumerate(ranks):
        if ref in pending:
            continue
        try:
            ray.get(ref, timeout=10)
        except PeerFault as exc:
            faults.append((rank, _cause(exc)))
        except Exception as exc:  # a dead rank: raised as it is, below
            other = other or exc
    if other is not None:
        raise other
    if faults:
        rank, f = faults[0]
        late = ", ".join(str(ranks.index(p)) for p in pending)
        raise PeerFault(
            "collective",
            f.stage,
            f"trainer rank {late}",
            waited_s=f.waited_s,
            key=f.key,
            detail=f"rank {rank} timed out in a collective that rank {late} never reached",
        )
