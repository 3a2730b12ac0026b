"""The Ray runner on a local 2-CPU Ray cluster shared by this module (one ``ray.init``).

Runs start from one tiny SFT warm start (built once) so rewards vary and the updates are real.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from gyre import loop, runners, sft  # noqa: E402
from gyre.config import load_config  # noqa: E402

STEPS, TASKS, GROUP = 3, 4, 4
SKIP_PREFIXES = ("time/", "perf/", "sync/", "async/", "recovery/", "handover/")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tmp_path_factory.mktemp("ray")
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=str(tmp),
        namespace="gyre-tests",
        log_to_driver=False,
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def warm_model(tmp_path_factory, tiny_cfg) -> Path:
    """A tiny model after a short SFT warm start: it solves some mazes, not all."""
    d = tmp_path_factory.mktemp("warm")
    cfg = load_config(None, [*_tiny(), f"run.dir={d}", "sft.steps=40", "sft.demos=128"])
    run_dir, device = loop.setup(cfg)
    return sft.run_sft(cfg, run_dir, device, loop.base_model_path(cfg, run_dir))


def _tiny() -> list[str]:
    return [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.intermediate_size=64",
        "sft.batch_size=16",
        "sft.lr=0.01",
        "log.console=off",
        "run.threads=1",
    ]


def _cfg(run_dir: Path, model: Path, *extra: str, ray_on: bool = True):
    ov = [
        *_tiny(),
        f"run.dir={run_dir}",
        f"model.path={model}",
        "sft.steps=0",
        f"train.steps={STEPS}",
        f"train.tasks_per_step={TASKS}",
        f"train.group_size={GROUP}",
        "train.mini_batches=2",
        "train.lr=0.003",
        "eval.episodes=8",
        "checkpoint.every=0",
        "train.level_replay.prob=0",  # the maze default replays tasks on the local runner only
    ]
    if ray_on:
        ov += [
            "runner=ray",
            "ray.rollout_workers=2",
            "ray.rollout.num_cpus=0.5",
            "ray.trainer.num_cpus=0.5",
        ]
    return load_config(None, [*ov, *extra])


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _comparable(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(SKIP_PREFIXES)} for r in rows]


def _trained_ids(run_dir: Path) -> list[str]:
    rows = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [r["traj_id"] for r in rows if r["status"] == "trained"]


def _expected_ids(steps: int) -> list[str]:
    return [f"{task}:{j}" for task in range(steps * TASKS) for j in range(GROUP)]


@pytest.fixture(scope="module")
def sync_run(ray_cluster, warm_model, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("sync")
    runners.train(_cfg(d, warm_model, f"ray.tasks_per_share={TASKS}", "ray.placement=colocated"))
    return d


def test_sync_ray_run_matches_local_runner(sync_run, warm_model, tmp_path):
    """One share per step (the two workers take turns; colocated with the trainer): the engine
    batch, its seed and the update are those of the local runner, so every metric and the final
    weights are equal."""
    import torch
    from safetensors.torch import load_file

    local = tmp_path / "local"
    runners.train(_cfg(local, warm_model, ray_on=False))
    a, b = _comparable(_metrics(local)), _comparable(_metrics(sync_run))
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        shared = set(ra) & set(rb)
        assert ra.keys() <= rb.keys() | {"policy_version"}
        # The engine's batched logprobs equal one-at-a-time ones only to float rounding (its
        # kernels see other batch shapes); the gaps (|trainer - rollout| logprob, ~1e-7 here)
        # read that rounding. Tokens, losses, gradients and weights stay exactly equal.
        noise = {"train/logprob_gap", "train/rollout_logprob_gap"}
        assert {k: ra[k] for k in shared - noise} == {k: rb[k] for k in shared - noise}
        for k in shared & noise:
            assert ra[k] == pytest.approx(rb[k], abs=1e-6), k
    rewards = [r["rollout/reward_mean"] for r in a if "rollout/reward_mean" in r]
    assert any(0 < x < 1 for x in rewards), "the warm start should give varied rewards"
    assert any(r.get("train/grad_norm", 0) > 0 for r in a)
    wa = load_file(str(local / "final" / "model.safetensors"))
    wb = load_file(str(sync_run / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert sorted(_trained_ids(sync_run)) == sorted(_expected_ids(STEPS))


def test_async_max_staleness_0_is_sync(sync_run, warm_model, tmp_path):
    d = tmp_path / "a0"
    runners.train(
        _cfg(d, warm_model, f"ray.tasks_per_share={TASKS}", "ray.mode=async", "ray.max_staleness=0")
    )
    assert _comparable(_metrics(d)) == _comparable(_metrics(sync_run))
    assert (d / "trajectories.jsonl").read_text() == (sync_run / "trajectories.jsonl").read_text()


def test_async_max_staleness_1_trains_and_drops_nothing(ray_cluster, warm_model, tmp_path):
    """Two rollout workers, two gloo trainer ranks, generation one batch ahead."""
    d = tmp_path / "a1"
    s = runners.train(
        _cfg(d, warm_model, "ray.mode=async", "ray.max_staleness=1", "ray.trainer_ranks=2")
    )
    steps = [r for r in _metrics(d) if "train/loss" in r]
    assert len(steps) == STEPS
    assert all(r["async/dropped_total"] == 0 for r in steps)
    assert max(r["async/staleness_max"] for r in steps) == 1  # generation really ran ahead
    assert any(r["train/grad_norm"] > 0 for r in steps)
    assert sorted(_trained_ids(d)) == sorted(_expected_ids(STEPS))
    assert s["recovery/rollout_restarts"] == 0
    # stale samples: the off-policy correction (truncated rollout IS) is on by default
    # (a step whose rows all had A = 0 skipped them and measured no token mean)
    weights = [r["train/is_weight"] for r in steps if "train/is_weight" in r]
    assert weights and all(0 < w <= 2.0 for w in weights)
    assert all(r["train/scored_tokens"] == 0 for r in steps if "train/is_weight" not in r)
    assert "rollout_is: truncate" in (d / "config.yaml").read_text()


class _KillAt:
    """A metrics sink that kills a named actor when step ``at`` is logged (from the driver's
    own loop, so the kill lands while the next shares are in flight)."""

    def __init__(self, name: str, at: int) -> None:
        self.name, self.at, self.killed = name, at, False

    def log(self, step: int, metrics: dict) -> None:
        if step == self.at and "train/loss" in metrics and not self.killed:
            ray.kill(ray.get_actor(self.name, namespace="gyre-tests"), no_restart=True)
            self.killed = True

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def test_killed_rollout_worker_is_replaced_and_no_trajectory_is_lost(
    ray_cluster, warm_model, tmp_path
):
    from gyre.runners.ray import actor_prefix

    d = tmp_path / "kill"
    cfg = _cfg(d, warm_model, "ray.mode=one-step-off", "train.steps=4", "eval.episodes=0")
    cfg.run.dir = str(d.resolve())
    killer = _KillAt(f"{actor_prefix(cfg)}-rollout-0", at=1)
    s = runners.train(cfg, killer)
    assert killer.killed
    assert s["recovery/rollout_restarts"] >= 1
    ids = _trained_ids(d)
    assert len(ids) == len(set(ids)), "a trajectory was trained twice"
    assert sorted(ids) == sorted(_expected_ids(4)), "a trajectory was lost"
    assert [r["step"] for r in _metrics(d) if "train/loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GYRE_SLOW") != "1", reason="slow: set GYRE_SLOW=1")
def test_trainer_failure_restarts_from_checkpoint(ray_cluster, warm_model, tmp_path):
    from gyre.runners.ray import actor_prefix

    d = tmp_path / "tkill"
    cfg = _cfg(d, warm_model, "train.steps=4", "checkpoint.every=1", "eval.episodes=0")
    cfg.run.dir = str(d.resolve())
    killer = _KillAt(f"{actor_prefix(cfg)}-trainer-0-e1", at=2)
    s = runners.train(cfg, killer)
    assert killer.killed and s["recovery/trainer_restarts"] == 1
    ids = _trained_ids(d)
    assert sorted(ids) == sorted(_expected_ids(4))  # steps after the checkpoint trained once
    steps = [r["step"] for r in _metrics(d) if "train/loss" in r]
    assert steps[-1] == 4 and set(steps) == {1, 2, 3, 4}


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("GYRE_SLOW") != "1", reason="slow: set GYRE_SLOW=1")
def test_an_async_resume_trains_the_groups_its_checkpoint_buffered(
    ray_cluster, warm_model, tmp_path
):
    """Async, two batches ahead, a checkpoint every step: the groups generated and not yet
    trained at a checkpoint are in its rollout buffer; resumed from it, the run trains those
    very samples (same policy version and length) and every task exactly once. (An evaluation
    every step runs on rollout worker 0 after the share it holds, so that share is back before
    the checkpoint: the buffer is never empty by chance.)"""
    from gyre.runners.scheduler import read_buffer

    d = tmp_path / "resume"
    extra = ["ray.mode=async", "ray.async_ahead=2", "ray.max_staleness=2",
             "ray.tasks_per_share=1", "checkpoint.every=1", "checkpoint.keep=5",
             "eval.every=1", "eval.episodes=2"]  # fmt: skip
    runners.train(_cfg(d, warm_model, *extra, "train.steps=3"))
    ckpt = d / "checkpoints" / "step_000001"
    saved = read_buffer(ckpt)
    groups = [*saved["buffer"], *(g for gs in saved["done"].values() for g in gs)]
    assert json.loads((ckpt / "state.json").read_text())["buffered_groups"] == len(groups)
    held = {t.traj_id: (t.policy_version, t.num_generated)
            for task, ts in groups if task < 4 * TASKS for t in ts}  # fmt: skip
    assert held, "the checkpoint buffered no group (generation did not run ahead)"
    runners.train(_cfg(d, warm_model, *extra, "train.steps=4", f"run.resume={ckpt}"))
    rows = [json.loads(x) for x in (d / "trajectories.jsonl").read_text().splitlines()]
    trained = {r["traj_id"]: (r["policy_version"], r["response_tokens"])
               for r in rows if r["status"] == "trained"}  # fmt: skip
    assert sorted(_trained_ids(d)) == sorted(_expected_ids(4))  # each once, none lost
    assert {i: trained[i] for i in held} == held  # the buffered samples, not regenerated ones
