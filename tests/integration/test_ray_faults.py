"""Faults of the Ray runner on a local Ray cluster (slow: GYRE_SLOW=1; run by hand).

A rollout worker that is alive but never returns (``GYRE_FAULT=rollout.share:pause=...``: every
share hangs) must end the run within ``faults.call_timeout_s`` as a named worker fault, exit 69,
not hang: Ray only reports actors that died. Weights lost with their node before a worker
fetched them are gathered again, and nothing is trained twice.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from gyre.cli import main  # noqa: E402

pytestmark = pytest.mark.slow

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.intermediate_size=64",
    "log.console=off",
    "run.threads=1",
    "sft.steps=0",
    "train.steps=2",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "eval.episodes=0",
    "checkpoint.every=0",
    "train.level_replay.prob=0",
    "runner=ray",
    "ray.rollout_workers=1",
    "ray.rollout.num_cpus=0.5",
    "ray.trainer.num_cpus=0.5",
    "ray.num_cpus=2",
]


def _run_with_fault(fault: str, tmp_path, capsys, *overrides: str) -> tuple[int, float, str, str]:
    """``gyre train`` of TINY on Ray with ``GYRE_FAULT=fault``: (exit code, seconds, the last
    ``gyre:`` line of stderr, stdout and stderr)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["GYRE_FAULT"] = fault
    try:
        t0 = time.monotonic()
        short = tempfile.mkdtemp(prefix="gyr")  # Ray's socket paths must stay short
        args = [*TINY, f"run.dir={tmp_path / 'run'}", f"ray.temp_dir={short}", *overrides]
        rc = main(["train", *args])
        took = time.monotonic() - t0
    finally:
        del os.environ["GYRE_FAULT"]
        if ray.is_initialized():
            ray.shutdown()
    out, err = capsys.readouterr()
    line = ([x for x in err.splitlines() if x.startswith("gyre:")] or [""])[-1]
    return rc, took, line, out + err


def test_a_wedged_rollout_actor_ends_the_run_as_a_named_worker_fault(tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING, logger="gyre.deadlines")
    marker = tmp_path / "wedged"
    rc, took, line, err = _run_with_fault(
        f"rollout.share:pause=3600:{marker}",
        tmp_path,
        capsys,
        "faults.call_timeout_s=20",
        "faults.heartbeat_s=5",
    )
    assert rc == 69, err[-2000:]
    assert marker.exists()  # the share did reach the worker and hang there
    assert line.startswith("gyre: worker fault: rollout: no answer from rollout workers 0 for 2")
    assert "(faults.call_timeout_s=20)" in line
    assert "waiting for rollout on rollout workers 0: 5 s of 20 s" in caplog.text  # heartbeat
    assert took < 20 + 120  # the deadline plus start-up and shutdown


def test_a_rank_that_never_reaches_the_update_collective_is_named(tmp_path, capsys):
    """Two trainer ranks; rank 1 never reaches the update of step 1 (``GYRE_FAULT`` pauses it
    before the update, as a wedged rank would). Rank 0's gradient all-reduce gives up after the
    process group's timeout (``faults.startup_timeout_s``); the driver sees rank 1's call still
    running and stops the run as a collective fault naming rank 1, exit 69, long before
    ``faults.call_timeout_s``."""
    marker = tmp_path / "wedged"
    timeout_s = 60  # also the rendezvous's: room for two ranks starting on a loaded machine
    rc, took, line, err = _run_with_fault(
        f"trainer.update.rank1:pause=3600:{marker}",
        tmp_path,
        capsys,
        "ray.trainer_ranks=2",
        f"faults.startup_timeout_s={timeout_s}",
        "faults.call_timeout_s=3600",
    )
    assert rc == 69, err[-2000:]
    assert marker.exists()  # rank 1 did reach the update and stop short of it
    assert line.startswith(
        "gyre: collective fault: update of step 1: no answer from trainer rank 1 for "
        f"{timeout_s} s (faults.startup_timeout_s={timeout_s}): rank 0 timed out in a "
        "collective that rank 1 never reached"
    ), line
    assert took < timeout_s + 240  # the deadline plus start-up and shutdown, not the hour


def _trained(run) -> list[str]:
    rows = [json.loads(x) for x in (run / "trajectories.jsonl").read_text().splitlines()]
    return [r["traj_id"] for r in rows if r["status"] == "trained"]


@pytest.mark.parametrize("mode", ["sync", "one-step-off"])
def test_weights_lost_before_the_fetch_are_gathered_again(tmp_path, capsys, mode):
    """The weights a rollout worker is to load were lost with their node (Ray's
    ``ObjectLostError`` at every fetch of the first weights object sent, step 2's: a lost
    object stays lost): the worker is fine, so it is not replaced; its share is reissued once,
    the trainer group gathers the weights again into a new object, and the run ends with exit
    0, every planned trajectory trained exactly once. In sync mode
    the reissued share is sampled with the same seeds, so the weights end bitwise equal to a
    run without the fault."""
    steps = ["train.steps=3", f"ray.mode={mode}", "log.console=plain"]
    marker = tmp_path / "lost"
    rc, _, _, err = _run_with_fault(f"rollout.weights:lost:{marker}", tmp_path, capsys, *steps)
    assert rc == 0, err[-2000:]
    assert marker.exists()  # the fault did fire
    assert "were lost with their node before every rollout worker fetched them" in err
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    counted = [r for r in rows if "recovery/reissued_shares" in r]
    assert counted[-1]["recovery/reissued_shares"] == 1
    assert counted[-1]["recovery/regathered_weights"] == 1
    assert counted[-1]["recovery/rollout_restarts"] == 0  # the worker itself was fine
    assert counted[-1]["recovery/trainer_restarts"] == 0
    trained = _trained(run)
    assert len(trained) == len(set(trained)) == 3 * 2 * 2  # steps x tasks x group
    if mode == "sync":
        clean = tmp_path / "clean"
        rc, *_ = _run_with_fault("none:", clean, capsys, *steps)
        assert rc == 0 and _trained(clean / "run") == trained
        a, b = (load_file(str(r / "final" / "model.safetensors")) for r in (run, clean / "run"))
        assert all(torch.equal(a[k], b[k]) for k in a)
