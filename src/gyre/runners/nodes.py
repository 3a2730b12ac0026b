"""Node health of a Ray run: which nodes were lost, and a deadline on waiting for room again.

Ray's GCS checks every node's raylet every ``ray.health_check_period_s``; a check that gets no
answer within the same time fails, and after ``ray.health_check_failures`` failed checks in a
row the node is declared dead; then every actor on it fails, so the pending calls the driver
waits on end with an actor error (never a wait without end). gyre sets these numbers for a local
cluster it starts (:func:`health_system_config`); a cluster started with ``ray start --head``
takes them from its own ``--system-config``. A node that stops answering is therefore declared
lost within ``2 x period x failures`` (:func:`lost_deadline_s`; measured: a raylet stopped with
SIGSTOP, period 0.5 s x 4, was declared dead after about 4 s, tests/integration/test_ray_nodes.py).
A node whose raylet dies is noticed sooner (its connection closes: about 2 s).

:class:`NodeWatch` remembers the nodes alive at start-up; after an actor failure it names the
nodes Ray has since declared dead, in one line each, and counts them (``recovery/lost_nodes``).
A replacement actor whose bundle has no node left (e.g. the lost node held the only
``gyre_rollout`` resource) waits for a replacement node for at most ``ray.replacement_wait_s``
(:meth:`NodeWatch.place`); one placed on a node that was dying but not yet declared dead is
started again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gyre.config import Config


def health_system_config(cfg: Config) -> dict[str, int]:
    """Ray ``_system_config`` for the node-health deadline of ``cfg.ray``."""
    return {
        "health_check_period_ms": int(cfg.ray.health_check_period_s * 1000),
        # Ray's default per-check timeout (10 s) would stretch the deadline far past the period
        "health_check_timeout_ms": int(cfg.ray.health_check_period_s * 1000),
        "health_check_failure_threshold": cfg.ray.health_check_failures,
    }


def lost_deadline_s(cfg: Config) -> float:
    """Seconds after which a node that stopped answering is declared lost."""
    return 2 * cfg.ray.health_check_period_s * cfg.ray.health_check_failures


def _describe(node: dict[str, Any]) -> str:
    res = node.get("Resources", {})
    custom = {
        k: v
        for k, v in res.items()
        if not k.startswith(("node:", "object_store", "memory", "accelerator_type"))
    }
    shown = ", ".join(f"{k}={v:g}" for k, v in sorted(custom.items()))
    return f"{node.get('NodeManagerAddress', '?')} (id {node['NodeID'][:8]}; {shown})"


class NodeWatch:
    """The nodes of the cluster at start-up, and which of them Ray has declared dead since."""

    def __init__(self, ray: Any, deadline_s: float) -> None:
        self.ray = ray
        self.deadline_s = deadline_s
        self.known = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        self.lost: set[str] = set()

    def newly_lost(self) -> list[str]:
        """One line for each node that was alive and is now dead (each named once)."""
        lines = []
        for n in self.ray.nodes():
            nid = n["NodeID"]
            if n["Alive"]:
                self.known.setdefault(nid, n)  # a replacement node that joined
                continue
            if nid in self.known and nid not in self.lost:
                self.lost.add(nid)
                lines.append(
                    f"ray: node {_describe(self.known[nid])} lost: declared dead by Ray's health "
                    f"check (deadline {self.deadline_s:g} s = 2 x ray.health_check_period_s x "
                    "ray.health_check_failures)"
                )
        return lines

    def place(
        self,
        start: Callable[[int], list[Any]],
        probe: Callable[[list[Any], float], None],
        what: str,
        timeout_s: float,
        died: tuple[type[BaseException], ...],
    ) -> list[Any]:
        """``start(attempt)`` actors and ``probe(actors, seconds_left)`` (their first calls,
        bounded by :meth:`wait_placed`); actors that die before answering -- placed on a node
        that is being lost -- are killed and started again until ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        while True:
            actors = start(attempt)
            try:
                probe(actors, max(1.0, deadline - time.monotonic()))
                return actors
            except died as exc:
                for a in actors:
                    self.ray.kill(a, no_restart=True)
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{what}: died on start-up for {timeout_s:g} s "
                        f"(ray.replacement_wait_s): {type(exc).__name__}"
                    ) from None
                attempt += 1
                time.sleep(0.5)

    def wait_placed(self, ref: Any, what: str, timeout_s: float) -> Any:
        """``ray.get(ref)`` on a fresh actor's first call, bounded: it waits for a node with room
        for the actor's bundle (a replacement node may have to join first)."""
        try:
            return self.ray.get(ref, timeout=timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"{what}: no node with room for it within {timeout_s:g} s (ray.replacement_wait_s)"
                f"; alive nodes: {[_describe(n) for n in self.ray.nodes() if n['Alive']]}"
            ) from None
