"""``trajectories.jsonl`` of a Ray run: one line per trajectory trained or dropped.

Each line: ``step``, ``traj_id``, ``status`` (``trained`` or ``dropped``), ``policy_version``
(the policy that generated it), ``staleness`` (``step - 1 - policy_version``), ``reward`` and
``response_tokens``. A resume cuts the lines past its checkpoint's step: those steps are
trained again.
"""

from __future__ import annotations

import json
from pathlib import Path

from gyre.runners.scheduler import Group


class TrajectoryLog:
    """Appends a step's trained and dropped groups to ``path``; cuts it back on a resume."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def append(self, step: int, trained: list[Group], dropped: list[Group]) -> None:
        with self.path.open("a") as f:
            for status, groups in (("trained", trained), ("dropped", dropped)):
                for g in groups:
                    for t in g.trajs:
                        row = {
                            "step": step,
                            "traj_id": t.traj_id,
                            "status": status,
                            "policy_version": t.policy_version,
                            "staleness": step - 1 - t.policy_version,
                            "reward": t.reward,
                            "response_tokens": t.num_generated,
                        }
                        f.write(json.dumps(row) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (they will be trained again)."""
        if not self.path.exists():
            return
        lines = self.path.read_text().splitlines()
        keep = [line for line in lines if json.loads(line)["step"] <= step]
        self.path.write_text("".join(f"{line}\n" for line in keep))
