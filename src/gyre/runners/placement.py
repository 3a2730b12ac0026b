"""Ray placement arithmetic, with no Ray import: bundles, fitting them to a cluster, the
off-policy default of the async modes and how the trainer ranks' metrics combine.

Fitting (:func:`fit_placement`): the default resources (2 rollout workers + 1 trainer rank, one
CPU each, disaggregated) need 3 CPUs. On a smaller cluster a run whose config leaves
``ray.placement`` and the role resources at their defaults is fitted instead of failing: sync
mode falls back to ``colocated`` (the roles alternate, so sharing CPUs costs nothing), and the
per-actor CPUs are scaled down until the bundles fit; the change is reported in one line. A
placement the config asked for explicitly that cannot fit is a one-line error naming the keys.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from gyre.config import Config
from gyre.plugins import module_root

RAY_MISSING = "the Ray runner needs Ray: pip install 'gyre[ray]'"


def require_ray() -> Any:
    """Import Ray or fail with the extra to install."""
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(RAY_MISSING) from exc
    return ray


def _bundle(*roles: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in roles:
        if r.num_cpus:
            out["CPU"] = out.get("CPU", 0.0) + r.num_cpus
        if r.num_gpus:
            out["GPU"] = out.get("GPU", 0.0) + r.num_gpus
        for name, amount in r.resources.items():  # custom resources pin a role to its nodes
            out[name] = out.get(name, 0.0) + amount
    return out


def placement_bundles(cfg: Config) -> tuple[list[dict[str, float]], list[int], list[int]]:
    """(bundles, bundle of each rollout worker, bundle of each trainer rank).

    colocated: bundle i holds rollout worker i and trainer rank i (max(N, M) bundles), so the two
    roles share devices and must alternate. disaggregated: N rollout bundles, then M trainer ones.
    """
    r = cfg.ray
    N, M = r.rollout_workers, r.trainer_ranks
    for name, role in (("rollout", r.rollout), ("trainer", r.trainer)):
        if role.num_cpus <= 0 and role.num_gpus <= 0:
            raise ValueError(f"ray.{name} reserves nothing; set ray.{name}.num_cpus or num_gpus")
    if r.placement == "colocated":
        bundles = [
            _bundle(*([r.rollout] if i < N else []), *([r.trainer] if i < M else []))
            for i in range(max(N, M))
        ]
        return bundles, list(range(N)), list(range(M))
    bundles = [_bundle(r.rollout) for _ in range(N)] + [_bundle(r.trainer) for _ in range(M)]
    return bundles, list(range(N)), [N + j for j in range(M)]


def bundles_cpus(bundles: list[dict[str, float]]) -> float:
    return sum(b.get("CPU", 0.0) for b in bundles)


def fit_placement(cfg: Config, cluster_cpus: float) -> str | None:
    """Make ``cfg.ray``'s bundles fit ``cluster_cpus`` (see the module docstring); returns a
    message saying what changed, or None. Raises ValueError for an explicit placement that
    cannot fit."""
    r = cfg.ray
    need = bundles_cpus(placement_bundles(cfg)[0])
    if need <= cluster_cpus + 1e-9:
        return None
    explicit = {"placement", "rollout", "trainer"} & r.model_fields_set
    if explicit or r.rollout.model_fields_set or r.trainer.model_fields_set:
        keys = ", ".join(f"ray.{k}" for k in sorted(explicit | {"rollout_workers"}))
        raise ValueError(
            f"the Ray placement needs {need:g} CPUs ({keys}: ray.placement={r.placement}, "
            f"{r.rollout_workers} rollout x {r.rollout.num_cpus:g} + {r.trainer_ranks} trainer x "
            f"{r.trainer.num_cpus:g}); the cluster has {cluster_cpus:g}: lower them, or leave "
            "them unset to fit automatically"
        )
    before = f"{r.placement}, {need:g} CPUs"
    if r.mode == "sync" and r.placement != "colocated":
        r.placement = "colocated"
        need = bundles_cpus(placement_bundles(cfg)[0])
    if need > cluster_cpus:
        scale = cluster_cpus / need
        r.rollout.num_cpus = _floor3(r.rollout.num_cpus * scale)
        r.trainer.num_cpus = _floor3(r.trainer.num_cpus * scale)
        need = bundles_cpus(placement_bundles(cfg)[0])
    return (
        f"ray: the default placement ({before}) does not fit the cluster's {cluster_cpus:g} "
        f"CPUs; using ray.placement={r.placement} with ray.rollout.num_cpus="
        f"{r.rollout.num_cpus:g}, ray.trainer.num_cpus={r.trainer.num_cpus:g} ({need:g} CPUs)"
    )


def _floor3(x: float) -> float:
    return int(x * 1000) / 1000


def gathers_on_every_rank(cfg: Config) -> bool:
    """FSDP2's full-state-dict gather is a collective: every rank must take part."""
    strategy = cfg.ray.strategy
    if strategy == "auto":
        strategy = "fsdp2" if cfg.ray.trainer.num_gpus > 0 else "ddp"
    return strategy == "fsdp2"


def combine_ranks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Rank metrics -> step metrics: per-token means weighted by the tokens each rank scored
    (all of its tokens unless it skipped zero-advantage rows; a rank that skipped every row has
    no token means and adds nothing to them), the loss summed (each rank holds its share of the
    global objective), the grad norm of the synced gradients."""
    if len(per_rank) == 1:
        return dict(per_rank[0])
    scored = [m.get("train/scored_tokens", m["train/tokens"]) for m in per_rank]
    out = {}
    for k in dict.fromkeys(k for m in per_rank for k in m):  # every rank's keys, in order
        have = [(m[k], n) for m, n in zip(per_rank, scored, strict=True) if k in m]
        if k in ("train/loss", "train/skipped_rows", "train/tokens", "train/scored_tokens"):
            out[k] = sum(v for v, _ in have)
        elif k.startswith("sync/") or k in ("train/grad_norm", "train/optimizer_steps"):
            out[k] = have[0][0]  # equal on every rank, or rank 0's (the weights it sends)
        elif k.startswith("time/"):
            out[k] = max(v for v, _ in have)  # the slowest rank sets the pace
        else:
            total = sum(n for _, n in have)
            values = sum(v * n for v, n in have) if total else sum(v for v, _ in have)
            out[k] = values / (total if total else len(have))
    return out


def off_policy_default(cfg: Config) -> bool:
    """Switch on the off-policy correction for runs that train stale trajectories.

    With ``ray.mode`` one-step-off or async and ``ray.max_staleness >= 1`` a batch holds samples
    of older policy versions, so unless the config names ``train.algo.rollout_is`` itself, it
    becomes ``truncate`` (TIS: each token's loss times min(pi_old_train / pi_rollout, C); with
    recomputed or current old log-probs that ratio carries the versions of drift). Returns True
    when it changed the config. Sync runs (and max_staleness 0) are left as they are.
    """
    algo = cfg.train.algo
    stale = cfg.ray.mode != "sync" and cfg.ray.max_staleness >= 1
    if not stale or "rollout_is" in algo.model_fields_set or algo.rollout_is != "none":
        return False
    algo.rollout_is = "truncate"
    return True


def actor_prefix(cfg: Config) -> str:
    """Actor names of a run: ``<prefix>-rollout-<i>``, ``<prefix>-trainer-<rank>``."""
    key = hashlib.sha1(str(Path(cfg.run.dir).resolve()).encode()).hexdigest()[:8]
    return f"gyre-{key}"


def user_module_path(cfg: Config) -> str:
    """``PYTHONPATH`` for the actors: the folders this driver imports the config's user code
    from (``reward.functions[*].fn`` and a plug-in ``env.name`` given as ``module:attr``, e.g.
    a module next to the config), before the inherited path, so an actor resolves them as the
    driver does. File paths (``envs.py:Class``) are absolute after ``load_config`` and need no
    entry. (On a multi-node cluster the folder must exist on every node, e.g. the shared file
    system; see docs/cluster.md.)"""
    specs = [f.fn for f in cfg.reward.functions]
    if ":" in cfg.env.name:
        specs.append(cfg.env.name)
    dirs: list[str] = []
    for spec in specs:
        root = module_root(spec)
        if root is not None and root not in dirs:
            dirs.append(root)
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join([*dirs, *([inherited] if inherited else [])])
