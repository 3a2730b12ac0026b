"""Recorded trajectories: the JSONL schema ``gyre serve --record DIR`` writes, and the offline
source ``gyre train`` reads with ``train.source: DIR``.

One line per finished episode (``DIR/episodes.jsonl``), a JSON object of schema
:data:`RECORD_SCHEMA` whose token fields are a :class:`gyre.types.Trajectory`'s: position t of
``token_ids``, ``loss_mask`` and ``rollout_logprobs`` is token t; the mask is 1 exactly on the
ids the server sampled; the logprob of token t is the sampler's, under the distribution sampled
from (``temperature``, ``top_p``), given tokens ``< t``. Where an agent rewrote its history
mid-episode the episode has several ``segments`` (each a token sequence of its own, trained as
step-wise rows). The full field list is in docs/envs.md ("Agents gyre did not write").

:class:`RecordedSource` serves the recording as GRPO groups: episodes that share a ``group``
key (the agent's task id), in the order their groups first appear, cut into groups of exactly
``train.group_size`` (what is left over is counted and left out). Task index ``k`` of the run's
task stream is group ``k mod (number of groups)``, so a run longer than one pass over the
recording starts again from the first group (and says so in ``rollout/recorded_epoch``).

Off-policy: every recorded token was sampled by the served weights (version
``policy_version``). The trainer recomputes the old log-probs as always (the PPO ratio starts
at 1); the gap between those and the recorded ones is the staleness of the recording, which
``train.algo.rollout_is`` corrects (it defaults to ``truncate`` under ``train.source``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gyre.types import Trajectory

RECORD_SCHEMA = "gyre.recorded/1"
RECORD_FILE = "episodes.jsonl"


def record_files(path: str | Path) -> list[Path]:
    """The JSONL files of a recording: ``path`` itself, or every ``*.jsonl`` in it, by name."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ValueError(f"train.source: {path} is neither a recording directory nor a file")
    files = sorted(p.glob("*.jsonl"))
    if not files:
        raise ValueError(f"train.source: {path} holds no *.jsonl recording")
    return files


def _check_tokens(where: str, ids: Any, mask: Any, lps: Any, vocab: int) -> None:
    if not (isinstance(ids, list) and isinstance(mask, list) and isinstance(lps, list)):
        raise ValueError(f"{where}: token_ids, loss_mask and rollout_logprobs must be lists")
    if not (len(ids) == len(mask) == len(lps)) or not ids:
        raise ValueError(f"{where}: token_ids, loss_mask and rollout_logprobs differ in length")
    if mask[0] != 0:
        raise ValueError(f"{where}: loss_mask[0] must be 0 (position 0 is a prompt token)")
    for t, (i, m, lp) in enumerate(zip(ids, mask, lps, strict=True)):
        if not isinstance(i, int) or not 0 <= i < vocab:
            raise ValueError(f"{where}: token_ids[{t}]={i!r} is outside the vocab [0, {vocab})")
        if m not in (0, 1):
            raise ValueError(f"{where}: loss_mask[{t}]={m!r} is not 0 or 1")
        if not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
            raise ValueError(f"{where}: rollout_logprobs[{t}]={lp!r} is not a finite log-prob")
    if not any(mask):
        raise ValueError(f"{where}: no sampled token (loss_mask is all 0)")


def check_record(where: str, rec: Any, vocab: int, temperature: float, top_p: float) -> None:
    """One record, checked; ``where`` is ``file:line`` for the one-line error."""
    if not isinstance(rec, dict) or rec.get("schema") != RECORD_SCHEMA:
        raise ValueError(f"{where}: not a {RECORD_SCHEMA} record (its 'schema' field)")
    reward = rec.get("reward")
    if not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise ValueError(f"{where}: reward {reward!r} is not a finite number")
    for key, want in (("temperature", temperature), ("top_p", top_p)):
        got = rec.get(key)
        if got is None or abs(float(got) - want) > 1e-9:
            raise ValueError(
                f"{where}: sampled with {key}={got} (null: it changed within the episode) but "
                f"train.sampling.{key}={want}: the trainer scores tokens at train.sampling"
            )
    segments = rec.get("segments")
    if not isinstance(segments, list) or not segments:
        raise ValueError(f"{where}: 'segments' must be a non-empty list")
    for k, s in enumerate(segments):
        if not isinstance(s, dict):
            raise ValueError(f"{where}: segments[{k}] is not an object")
        _check_tokens(
            f"{where}: segments[{k}]",
            s.get("token_ids"),
            s.get("loss_mask"),
            s.get("rollout_logprobs"),
            vocab,
        )


def read_records(
    path: str | Path, vocab: int, temperature: float, top_p: float
) -> list[dict[str, Any]]:
    """Every record of a recording (``DIR`` or one file), checked, in file and line order."""
    out = []
    for f in record_files(path):
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{f}:{n}: not JSON ({exc})") from None
                check_record(f"{f}:{n}", rec, vocab, temperature, top_p)
                out.append(rec)
    return out


def group_records(
    records: Sequence[dict[str, Any]], group_size: int
) -> tuple[list[list[dict[str, Any]]], int]:
    """Groups of exactly ``group_size`` records sharing a ``group`` key (first-appearance order;
    a key with 2G+1 episodes gives two groups), and how many records were left over."""
    groups, left = [], 0
    for recs in _by_group(records).values():
        full = len(recs) // group_size * group_size
        groups += [recs[i : i + group_size] for i in range(0, full, group_size)]
        left += len(recs) - full
    return groups, left


def _segment(s: dict[str, Any], group_id: int, version: int) -> Trajectory:
    return Trajectory(
        token_ids=list(s["token_ids"]),
        loss_mask=list(s["loss_mask"]),
        rollout_logprobs=[float(x) for x in s["rollout_logprobs"]],
        reward=0.0,
        group_id=group_id,
        policy_version=version,
        num_turns=1,
        success=False,
        task_seed=0,
    )


def to_trajectory(rec: dict[str, Any], group_id: int, traj_id: str) -> Trajectory:
    """A record as the trainer's :class:`Trajectory` (several segments: step-wise rows)."""
    version = int(rec.get("policy_version", 0))
    segs = [_segment(s, group_id, version) for s in rec["segments"]]
    whole = segs[0]
    info = {
        "session": rec.get("session"),
        "group": rec.get("group"),
        "template_drift": bool(rec.get("template_drift")),
        "tool_calls": int(rec.get("tool_calls", 0)),
        "tool_errors": int(rec.get("malformed_tool_calls", 0)),
        "rerender_drift_calls": int(rec.get("rerender_drift_calls", 0)),
    }
    traj = Trajectory(
        token_ids=[i for s in segs for i in s.token_ids],
        loss_mask=[m for s in segs for m in s.loss_mask],
        rollout_logprobs=[x for s in segs for x in s.rollout_logprobs],
        reward=float(rec["reward"]),
        group_id=group_id,
        policy_version=whole.policy_version,
        num_turns=int(rec.get("num_calls", 1)),
        success=bool(rec.get("success", rec["reward"] > 0)),
        task_seed=0,
        info=info,
        truncated=bool(rec.get("truncated", False)),
        traj_id=traj_id,
        steps=segs if len(segs) > 1 else None,
    )
    if len(segs) == 1:
        traj.turn_spans = [tuple(x) for x in rec["segments"][0].get("turn_spans", [])]
    return traj


class RecordedSource:
    """``train.source``: the recording's groups, served by task index (see the module doc)."""

    def __init__(
        self, path: str | Path, group_size: int, vocab: int, temperature: float, top_p: float
    ) -> None:
        records = read_records(path, vocab, temperature, top_p)
        self.groups, self.left_out = group_records(records, group_size)
        if not self.groups:
            sizes = sorted({len(v) for v in _by_group(records).values()})
            raise ValueError(
                f"train.source: no group in {path} has train.group_size={group_size} episodes "
                f"({len(records)} episodes, group sizes {sizes}); send the same gyre_group "
                "for that many attempts at a task, or lower train.group_size"
            )
        self.episodes = len(records)

    def describe(self) -> str:
        n, g = len(self.groups), len(self.groups[0])
        left = f"; {self.left_out} left out (incomplete groups)" if self.left_out else ""
        return f"train.source: {self.episodes} recorded episodes -> {n} groups of {g}{left}"

    def play(
        self, tasks: Sequence[int], m: dict[str, float] | None = None, version: int = 0
    ) -> list[Trajectory]:
        """The trajectories of task indices ``tasks`` (group ``k mod len(groups)``), taken at
        the run's policy ``version``: a recording is data, not a stale rollout of this run, so
        its rows carry the version they are served at (the staleness checks of the async Ray
        runner would otherwise drop them) and the recorded one in ``info``."""
        out = []
        for k in tasks:
            for j, rec in enumerate(self.groups[k % len(self.groups)]):
                traj = to_trajectory(rec, k, f"{k}:{j}")
                traj.info["recorded_policy_version"] = traj.policy_version
                traj.policy_version = version
                for step in traj.steps or []:
                    step.policy_version = version
                out.append(traj)
        if m is not None and tasks:
            m["rollout/recorded_epoch"] = float(max(tasks) // len(self.groups))
        return out


def _by_group(records: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_key: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        by_key.setdefault(str(rec.get("group") or rec.get("session")), []).append(rec)
    return by_key
