"""Reward functions beyond the env's rule: the contract, the weighted total, per-term metrics.

A reward function is named in the config by import path (``reward.functions[i].fn``,
``"module:function"``) and is **batched** — one call scores a whole step (TRL's contract)::

    def my_reward(prompts: list[str], completions: list[str], **columns) -> list[float]: ...
    async def my_reward(prompts, completions, **columns) -> list[float]: ...  # awaited

``prompts[i]`` is sample i's first observation (the task), ``completions[i]`` everything the
policy wrote in the episode (decoded from its own tokens). ``columns`` are lists aligned with
the samples — ``env_reward``, ``group_id``, ``info`` (the env's last-step info dict) and every
key of the task's metadata (``info["task"]``; for the dataset env: ``answer`` and the row's
other fields, ``None`` where a row lacks the key) — plus the term's constant ``kwargs`` from the
config. Accept ``**kwargs`` to ignore the columns you do not use. Return one finite number per
sample (a list, tuple, numpy array or 1-D tensor).

How terms combine: the env's own reward is the term named ``env`` with weight
``reward.env_weight``; the total is ``env_weight * env + sum_i weight_i * f_i`` and replaces
``Trajectory.reward`` (the env's value is kept in ``info["env_reward"]``, every term's in
``info["rewards"]``). With no functions configured nothing is built and the env's reward is used
exactly as before. Async terms of a step run concurrently; sync ones run in order, in the
calling thread (``math-verify`` needs the main thread for its own timeouts).

Trusted (in-process) functions that raise or return a wrong shape stop the run with an error
naming their config field. Functions with ``sandbox: true`` run one sample per call in
:mod:`gyre.rewards.sandbox`; a failed call gives that sample ``reward.sandbox.failure_reward``, is
counted and logged with its traceback, and the run stops only when more than
``reward.sandbox.max_failure_frac`` of a step's sandboxed calls fail.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gyre.config import RewardConfig
from gyre.plugins import PluginError, load_object
from gyre.rewards.errors import RewardError, RewardSandboxError
from gyre.types import Trajectory

log = logging.getLogger("gyre.rewards")

FAILURE_KINDS = ("timeout", "memory", "crash", "exception", "bad_output")
RESERVED_COLUMNS = ("env_reward", "group_id", "info")


def resolve_callable(path: str, field_name: str) -> Callable[..., Any]:
    """Import ``module:attr`` or load ``file.py:attr`` (``attr`` may be dotted; see
    :mod:`gyre.plugins`); errors name ``field_name``."""
    try:
        obj = load_object(path, field_name)
    except PluginError as exc:
        raise RewardError(str(exc)) from exc
    if not callable(obj):
        raise RewardError(f"{field_name}: {path!r} is a {type(obj).__name__}, not a callable")
    return obj


def as_values(out: Any, n: int, field_name: str, finite: bool = True) -> list[float]:
    """Check a function's return value: ``n`` numbers, finite unless ``finite=False`` (the
    :class:`Rewarder` checks finiteness per sample itself, as a failure of that sample)."""
    if hasattr(out, "tolist") and not isinstance(out, list | tuple):
        out = out.tolist()  # numpy array / torch tensor
    if not isinstance(out, list | tuple):
        raise RewardError(
            f"{field_name}: must return a list of {n} floats, got {type(out).__name__}"
        )
    if len(out) != n:
        raise RewardError(f"{field_name}: returned {len(out)} values for a batch of {n} samples")
    values = []
    for i, v in enumerate(out):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise RewardError(f"{field_name}: value {i} is {v!r}, not a number")
        if finite and not math.isfinite(v):
            raise RewardError(f"{field_name}: value {i} is {v}, not finite")
        values.append(float(v))
    return values


@dataclass
class RewardBatch:
    """What every reward function is called with (see the module docstring)."""

    prompts: list[str]
    completions: list[str]
    columns: dict[str, list[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def sample(self, i: int) -> RewardBatch:
        """The one-sample batch of sample ``i``."""
        return RewardBatch(
            [self.prompts[i]], [self.completions[i]], {k: [v[i]] for k, v in self.columns.items()}
        )


def batch_from_trajectories(trajs: Sequence[Trajectory], tokenizer: Any) -> RewardBatch:
    """Decode prompts (tokens before the first policy token) and completions (policy tokens)."""
    prompts, completions = [], []
    for t in trajs:
        first = t.loss_mask.index(1) if 1 in t.loss_mask else len(t.token_ids)
        prompts.append(tokenizer.decode(t.token_ids[:first], skip_special_tokens=True))
        policy = [tok for tok, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
        completions.append(tokenizer.decode(policy, skip_special_tokens=True))
    tasks = [t.info.get("task") or {} for t in trajs]
    keys = sorted({k for task in tasks for k in task})
    columns: dict[str, list[Any]] = {k: [task.get(k) for task in tasks] for k in keys}
    clash = set(columns) & set(RESERVED_COLUMNS)
    if clash:
        raise RewardError(f"task metadata uses reserved column names {sorted(clash)}")
    # The env's own reward; once scored, t.reward holds the total and info keeps the env's value.
    columns["env_reward"] = [float(t.info.get("env_reward", t.reward)) for t in trajs]
    columns["group_id"] = [int(t.group_id) for t in trajs]
    columns["info"] = [dict(t.info) for t in trajs]
    return RewardBatch(prompts, completions, columns)


@dataclass
class RewardTerm:
    """One configured function: where it comes from, its weight and how it runs."""

    name: str
    path: str
    weight: float
    kwargs: dict[str, Any]
    sandbox: bool
    field: str  # the config field, for error messages
    fn: Callable[..., Any] | None = None  # None for sandboxed terms (never imported here)


def _run_coroutines(coros: list[Any]) -> list[Any]:
    async def gather() -> list[Any]:
        # Exceptions come back as values, so the caller can name the function that raised.
        return list(await asyncio.gather(*coros, return_exceptions=True))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    # Called from inside a running event loop (e.g. a notebook): use a private loop elsewhere.
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = asyncio.run(gather())
        except BaseException as exc:
            box["err"] = exc

    th = threading.Thread(target=target)
    th.start()
    th.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


class Rewarder:
    """Scores a step's trajectories with the env term plus every configured function."""

    def __init__(self, cfg: RewardConfig, failure_log: str | Path | None = None) -> None:
        self.cfg = cfg
        self.failure_log = Path(failure_log) if failure_log else None
        self.terms: list[RewardTerm] = []
        self.failures_total = 0
        self.inprocess_failures_total = 0  # samples an in-process function raised on
        self._step_failures: int | None = None
        self.step = 0
        names = {"env"}
        for i, fc in enumerate(cfg.functions):
            fld = f"reward.functions[{i}].fn"
            name = fc.name or fc.fn.partition(":")[2].split(".")[-1]
            if name in names:
                raise RewardError(
                    f"reward.functions[{i}].name: term name {name!r} is already used "
                    "('env' is the env's own reward); set a distinct name"
                )
            names.add(name)
            clash = set(fc.kwargs) & ({"prompts", "completions", *RESERVED_COLUMNS})
            if clash:
                raise RewardError(f"reward.functions[{i}].kwargs: reserved names {sorted(clash)}")
            fn = None if fc.sandbox else resolve_callable(fc.fn, fld)
            self.terms.append(
                RewardTerm(name, fc.fn, fc.weight, dict(fc.kwargs), fc.sandbox, fld, fn)
            )
        self.pool = None
        sandboxed = [t for t in self.terms if t.sandbox]
        if sandboxed:
            from gyre.rewards.sandbox import SandboxPool

            # The run dir (where the failure log lives: checkpoints, metrics) is read-only to
            # reward code.
            protect = [str(self.failure_log.parent)] if self.failure_log else []
            self.pool = SandboxPool(cfg.sandbox, sorted({t.path for t in sandboxed}), protect)
            for t in sandboxed:
                err = self.pool.import_errors.get(t.path)
                if err:
                    self.close()
                    last = err.strip().splitlines()[-1]
                    raise RewardError(f"{t.field}: cannot load {t.path!r} in the sandbox: {last}")

    # -- scoring ------------------------------------------------------------------------------
    def score_batch(self, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]], dict]:
        """``(totals, values per term, sandbox metrics)`` for one batch."""
        n = len(batch)
        values: dict[str, list[float]] = {"env": list(batch.columns.get("env_reward", [0.0] * n))}
        pending: list[tuple[RewardTerm, Any]] = []
        for term in self.terms:
            if term.sandbox:
                continue
            assert term.fn is not None
            kwargs = self._kwargs(term, batch)
            try:
                out = term.fn(list(batch.prompts), list(batch.completions), **kwargs)
                if inspect.isawaitable(out):
                    pending.append((term, out))
                else:
                    values[term.name] = self._finite(term, as_values(out, n, term.field, False))
            except Exception as exc:
                try:
                    if isinstance(exc, RewardError):
                        raise
                    values[term.name] = self._per_sample(term, batch, exc)
                except RewardError:
                    for _, aw in pending:  # never started: close them quietly
                        if inspect.iscoroutine(aw):
                            aw.close()
                    raise
        if pending:
            outs = _run_coroutines([aw for _, aw in pending])
            for (term, _), out in zip(pending, outs, strict=True):
                if isinstance(out, RewardError):
                    raise out
                if isinstance(out, BaseException):
                    values[term.name] = self._per_sample(term, batch, out)
                    continue
                values[term.name] = self._finite(term, as_values(out, n, term.field, False))
        sandbox_metrics = self._score_sandboxed(batch, values)
        if self._step_failures is not None:
            sandbox_metrics["reward/failures"] = float(self._step_failures)
            sandbox_metrics["reward/failures_total"] = float(self.inprocess_failures_total)
            self._step_failures = None
        totals = self._totals(values)
        if self._step_failures is not None:  # only the weighted total failed this step
            sandbox_metrics["reward/failures"] = float(self._step_failures)
            sandbox_metrics["reward/failures_total"] = float(self.inprocess_failures_total)
            self._step_failures = None
        return totals, values, sandbox_metrics

    def _count_failures(self, k: int) -> None:
        self.inprocess_failures_total += k
        self._step_failures = (self._step_failures or 0) + k

    def _too_many(self, k: int, n: int) -> str | None:
        frac = k / max(n, 1)
        if frac <= self.cfg.sandbox.max_failure_frac:
            return None
        return (
            f"{k}/{n} samples at step {self.step} ({frac:.0%} > reward.sandbox.max_failure_frac="
            f"{self.cfg.sandbox.max_failure_frac})"
        )

    def _finite(self, term: RewardTerm, vals: list[float]) -> list[float]:
        """A non-finite value is a failure of that sample: ``failure_reward``, logged, counted;
        past ``max_failure_frac`` of the batch the run stops naming the function and sample."""
        bad = [(i, v) for i, v in enumerate(vals) if not math.isfinite(v)]
        if not bad:
            return vals
        for i, v in bad:
            self._log_failure(term, i, "non_finite", f"{term.path} returned {v} for sample {i}")
        self._count_failures(len(bad))
        why = self._too_many(len(bad), len(vals))
        if why:
            i, v = bad[0]
            raise RewardError(f"{term.field} ({term.path}): value {i} is {v}, not finite; {why}")
        out = list(vals)
        for i, _ in bad:
            out[i] = self.cfg.sandbox.failure_reward
        return out

    def _totals(self, values: dict[str, list[float]]) -> list[float]:
        """``env_weight * env + sum weight_i * f_i`` per sample. Finite terms can still overflow
        (1.7e308 with weight 2): such a sample's total is ``failure_reward``, logged and counted
        like a failed call, and past ``max_failure_frac`` the run stops naming the terms."""
        weights = {"env": self.cfg.env_weight, **{t.name: t.weight for t in self.terms}}
        totals = [0.0] * len(values["env"])
        for name, w in weights.items():
            totals = [a + w * b for a, b in zip(totals, values[name], strict=True)]
        bad = [i for i, v in enumerate(totals) if not math.isfinite(v)]
        if not bad:
            return totals
        parts = {
            i: " + ".join(f"{weights[k]:g} * {k}({values[k][i]:g})" for k in weights) for i in bad
        }
        for i in bad:
            msg = f"weighted reward total of sample {i} is {totals[i]}: {parts[i]}"
            fail = self.cfg.sandbox.failure_reward
            log.warning("%s at step %d; it gets %s", msg, self.step, fail)
            self._write_failure({"term": "total", "fn": "", "sample": i, "error": msg})
            totals[i] = self.cfg.sandbox.failure_reward
        self._count_failures(len(bad))
        why = self._too_many(len(bad), len(totals))
        if why:
            raise RewardError(
                f"reward total is not finite for sample {bad[0]}: {parts[bad[0]]} "
                f"(overflow; scale the reward or its weight); {why}"
            )
        return totals

    def _per_sample(self, term: RewardTerm, batch: RewardBatch, exc: BaseException) -> list[float]:
        """An in-process function raised on the batch: call it sample by sample, so only the
        samples it fails on get ``reward.sandbox.failure_reward`` (logged with the traceback and
        counted); stop when more than ``reward.sandbox.max_failure_frac`` of the batch fails."""
        n = len(batch)
        vals = [self.cfg.sandbox.failure_reward] * n
        failed: list[tuple[int, str]] = []
        for i in range(n):
            one = batch.sample(i)
            try:
                out = term.fn(list(one.prompts), list(one.completions), **self._kwargs(term, one))
                if inspect.isawaitable(out):
                    out = _run_coroutines([out])[0]
                    if isinstance(out, BaseException):
                        raise out
                v = as_values(out, 1, term.field, False)[0]
                if not math.isfinite(v):
                    raise ValueError(f"{term.path} returned {v} for sample {i}")
                vals[i] = v
            except RewardError:
                raise
            except Exception as err:
                failed.append((i, "".join(traceback.format_exception(err)).strip()))
        for i, tb in failed:
            self._log_failure(term, i, "exception", tb)
        self.inprocess_failures_total += len(failed)
        self._step_failures = (self._step_failures or 0) + len(failed)
        frac = len(failed) / max(n, 1)
        if frac > self.cfg.sandbox.max_failure_frac:
            raise RewardError(
                f"{term.field} ({term.path}) raised {exc!r} on {len(failed)}/{n} samples at step "
                f"{self.step} ({frac:.0%} > reward.sandbox.max_failure_frac="
                f"{self.cfg.sandbox.max_failure_frac})"
            ) from exc
        return vals

    def _kwargs(self, term: RewardTerm, batch: RewardBatch) -> dict[str, Any]:
        # The term's configured kwargs win over a task column of the same name.
        return {**batch.columns, **term.kwargs}

    def _score_sandboxed(self, batch: RewardBatch, values: dict[str, list[float]]) -> dict:
        terms = [t for t in self.terms if t.sandbox]
        if not terms:
            return {}
        assert self.pool is not None
        requests, where = [], []
        for term in terms:
            for i in range(len(batch)):
                requests.append(
                    {
                        "fn": term.path,
                        "prompts": [batch.prompts[i]],
                        "completions": [batch.completions[i]],
                        "columns": {k: [col[i]] for k, col in batch.columns.items()},
                        "kwargs": term.kwargs,
                    }
                )
                where.append((term, i))
        results = self.pool.map(requests)
        counts = dict.fromkeys(FAILURE_KINDS, 0)
        for term in terms:
            values[term.name] = [self.cfg.sandbox.failure_reward] * len(batch)
        failures = []
        for (term, i), res in zip(where, results, strict=True):
            if res.ok and res.values is not None and len(res.values) == 1:
                values[term.name][i] = res.values[0]
                continue
            kind = res.kind if res.ok is False else "bad_output"
            counts[kind if kind in counts else "exception"] += 1
            failures.append((term, i, kind, res.error))
        for term, i, kind, error in failures:
            self._log_failure(term, i, kind, error)
        n_fail = len(failures)
        self.failures_total += n_fail
        frac = n_fail / len(requests)
        metrics = {
            "reward/sandbox_calls": float(len(requests)),
            "reward/sandbox_failures": float(n_fail),
            "reward/sandbox_failure_frac": frac,
            "reward/sandbox_failures_total": float(self.failures_total),
            **{f"reward/sandbox_{k}": float(v) for k, v in counts.items()},
        }
        if frac > self.cfg.sandbox.max_failure_frac:
            term, i, kind, error = failures[0]
            last = error.strip().splitlines()[-1] if error.strip() else kind
            where_log = f"; tracebacks in {self.failure_log}" if self.failure_log else ""
            raise RewardSandboxError(
                f"reward sandbox: {n_fail}/{len(requests)} calls failed at step {self.step} "
                f"({frac:.0%} > reward.sandbox.max_failure_frac="
                f"{self.cfg.sandbox.max_failure_frac}); first: {term.field} ({term.path}) "
                f"sample {i}: [{kind}] {last}{where_log}"
            )
        return metrics

    def _log_failure(self, term: RewardTerm, index: int, kind: str, error: str) -> None:
        log.warning(
            "%s %s (%s) failed on sample %d at step %d [%s]; it gets %s\n%s",
            "sandboxed reward" if term.sandbox else "reward",
            term.name,
            term.path,
            index,
            self.step,
            kind,
            self.cfg.sandbox.failure_reward,
            error,
        )
        rec = {"term": term.name, "fn": term.path, "sample": index, "kind": kind, "error": error}
        self._write_failure(rec)

    def _write_failure(self, rec: dict[str, Any]) -> None:
        if self.failure_log is not None:
            rec = {"step": self.step, "kind": "non_finite", **rec}
            with self.failure_log.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def score(self, trajs: Sequence[Trajectory], tokenizer: Any, step: int = 0) -> dict[str, float]:
        """Set every trajectory's ``reward`` to the weighted total; return the step's metrics.

        Metrics: ``reward/<term>_mean`` for ``env`` and every function, ``reward/total_mean``,
        ``reward/total_std`` and, with sandboxed terms, ``reward/sandbox_*`` counts.
        """
        self.step = step
        batch = batch_from_trajectories(trajs, tokenizer)
        totals, values, metrics = self.score_batch(batch)
        for k, t in enumerate(trajs):
            t.info["env_reward"] = batch.columns["env_reward"][k]
            t.info["rewards"] = {name: vals[k] for name, vals in values.items()}
            t.reward = totals[k]
        metrics.update(reward_metrics(trajs))
        return metrics

    def close(self) -> None:
        """Stop the sandbox workers (also done at interpreter exit)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None


def reward_metrics(trajs: Sequence[Trajectory]) -> dict[str, float]:
    """``reward/<term>_mean``, ``reward/total_mean`` and ``reward/total_std`` of scored
    trajectories (their ``info["rewards"]`` and total ``reward``); the Ray driver recomputes
    them over a whole batch of shares scored by several workers."""
    totals = [t.reward for t in trajs]
    n = max(1, len(totals))
    metrics: dict[str, float] = {}
    names = list(trajs[0].info.get("rewards", {})) if trajs else []
    for name in names:
        metrics[f"reward/{name}_mean"] = sum(t.info["rewards"][name] for t in trajs) / n
    mean = sum(totals) / n
    metrics["reward/total_mean"] = mean
    metrics["reward/total_std"] = math.sqrt(sum((v - mean) ** 2 for v in totals) / n)
    return metrics


def build_rewarder(cfg: RewardConfig, failure_log: str | Path | None = None) -> Rewarder | None:
    """A :class:`Rewarder` when ``reward.functions`` is set, else None (env reward as is)."""
    if not cfg.functions:
        return None
    return Rewarder(cfg, failure_log)
