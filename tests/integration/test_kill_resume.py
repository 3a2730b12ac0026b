"""Kill it anywhere, resume, get the run that was never killed -- and the faults around that.

Every run is the tiny 2-layer model on one thread; SFT and GRPO both short. The kill -9 test
forks this process for each launch (no seconds of ``import torch``); the slow variant and
``gyre verify-resume`` start real ``python -m gyre.cli`` processes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gyre.loop
import gyre.rollout.core
import gyre.runners
import gyre.trainer.core
import gyre.trainer.sft
from gyre.checkpoint.files import verify_dir
from gyre.checkpoint.resume import EXIT_ABORTED, EXIT_FAULTS, EXIT_PREEMPTED, Preempted
from gyre.checkpoint.store import CheckpointStore, set_fault_hook
from gyre.cli import main
from gyre.commands.verify_resume import _ForkProc, compare_runs, verify_resume
from gyre.config import load_config, load_recipe

TINY = [
    "model.hidden_size=32",
    "model.num_layers=2",
    "model.intermediate_size=64",
    "sft.steps=6",
    "sft.demos=12",
    "sft.batch_size=4",
    "sft.warmup_steps=4",
    # constant LRs at the old defaults: these runs are stopped and resumed with a longer
    # train.steps, which re-times a decaying schedule (the test below reads the SFT LR values)
    "sft.lr=0.003",
    "sft.lr_schedule=constant",
    "train.lr_schedule=constant",
    "checkpoint.sft_every=2",
    "train.steps=6",
    "train.tasks_per_step=2",
    "train.group_size=2",
    "eval.episodes=2",
    "eval.every=0",
    "checkpoint.every=1",
    "checkpoint.keep=2",
    "log.console=off",
    "run.threads=1",
]
# arithmetic with answers 0..4: GRPO gets a real (non-zero) gradient after a short SFT
ARITH = [
    "env.name=arithmetic",
    "env.arithmetic.max_operand=2",
    "env.arithmetic.ops=+",
    "sft.lr=0.02",
    "train.group_size=4",
    "train.lr=0.001",
]


def _train(run_dir: Path, *extra: str) -> int:
    return main(["train", *TINY, f"run.dir={run_dir}", *extra])


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _train_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in _lines(run_dir / "metrics.jsonl") if "train/loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run (arithmetic, so GRPO really moves the weights)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    assert _train(run_dir, *ARITH) == 0
    return run_dir


def _signal_at(step_to_signal: int, sig: int = signal.SIGTERM):
    class Sink:
        def log(self, step, metrics):
            if step == step_to_signal and "train/loss" in metrics:
                os.kill(os.getpid(), sig)

        def message(self, text):
            pass

        def close(self):
            pass

    return Sink()


# -- exactness ---------------------------------------------------------------------------------
def test_kill9_at_five_moments_is_bit_exact(tmp_path):
    """>= 5 SIGKILLs (one inside a checkpoint write) + a SIGTERM, resumed each time: same
    weights bit for bit, every metrics step exactly once with the same values."""
    report = verify_resume(
        [*TINY, *ARITH], kills=5, seed=1, workdir=tmp_path, fork=True, timeout=300
    )
    assert report.ok, report.summary()
    assert report.kills >= 5
    kinds = [e.kind for e in report.events]
    assert "checkpoint-write" in kinds and "sigterm" in kinds
    assert [e.rc for e in report.events if e.kind != "sigterm"] == [-9] * report.kills
    assert all(e.rc in (EXIT_PREEMPTED, 0) for e in report.events if e.kind == "sigterm")
    # the comparison is not vacuous: GRPO changed the weights after SFT
    final = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    sft = load_file(tmp_path / "straight" / "sft" / "model.safetensors")
    assert any(not torch.equal(final[k], sft[k]) for k in final)


@pytest.mark.slow
def test_kill9_resume_exact_long_subprocesses(tmp_path):
    """The long variant: real `python -m gyre.cli` processes, more steps, 8 kills."""
    args = [
        *TINY,
        *ARITH,
        "sft.steps=40",
        "sft.demos=64",
        "checkpoint.sft_every=5",
        "train.steps=24",
        "checkpoint.every=2",
        "checkpoint.keep=3",
    ]
    report = verify_resume(args, kills=8, seed=3, workdir=tmp_path, timeout=900)
    assert report.ok, report.summary()
    assert report.kills == 8


def test_compare_runs_catches_a_difference(straight, tmp_path):
    """The comparison itself can fail: one changed weight or metric value is reported."""
    import shutil

    other = tmp_path / "other"
    shutil.copytree(straight, other)
    assert compare_runs(straight, other) == []
    w = load_file(other / "final" / "model.safetensors")
    from safetensors.torch import save_file

    k = next(iter(w))
    w[k] = w[k].clone()
    w[k].view(-1)[0] += 1e-7
    save_file(w, other / "final" / "model.safetensors", metadata={"format": "pt"})
    recs = _lines(other / "metrics.jsonl")
    recs[2]["train/loss"] = (recs[2].get("train/loss") or 0.0) + 1.0
    recs.append(recs[-1])
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    problems = compare_runs(straight, other)
    assert any("final" in p for p in problems)
    assert any("records" in p for p in problems)


# -- preemption --------------------------------------------------------------------------------
def test_sigterm_stops_at_a_safe_point_with_checkpoint(straight, tmp_path):
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*TINY, *ARITH, f"run.dir={run_dir}", "checkpoint.every=4"])
    with pytest.raises(Preempted) as info:
        gyre.runners.train(cfg, sink=_signal_at(2))
    assert info.value.step == 2 and info.value.signame == "SIGTERM"
    assert Path(info.value.path).name == "step_000002"  # written although every=4
    assert verify_dir(Path(info.value.path)) == []
    assert _train_steps(run_dir) == [1, 2]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    assert _train(run_dir, *ARITH, "checkpoint.every=4", "run.resume=auto") == 0
    assert compare_runs(straight, run_dir) == []


def test_second_sigint_aborts_at_once_without_corruption(straight, tmp_path):
    """SIGINT inside a checkpoint write, then SIGINT again: exit 130 right away; the half
    written checkpoint never shows up under a step name and the resume is still exact."""
    run_dir = tmp_path / "run"
    marker = tmp_path / "marker"
    args = ["train", *TINY, *ARITH, f"run.dir={run_dir}", "run.resume=auto"]
    proc = _ForkProc(args, tmp_path / "log", {"GYRE_FAULT": f"checkpoint.write:pause=60:{marker}"})
    t0 = time.perf_counter()
    while not marker.exists() and proc.poll() is None and time.perf_counter() - t0 < 120:
        time.sleep(0.02)
    assert marker.exists(), (tmp_path / "log").read_text()
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    assert proc.poll() is None  # first SIGINT: waits for a safe point
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == EXIT_ABORTED
    assert "second SIGINT" in (tmp_path / "log").read_text()
    store = CheckpointStore(run_dir / "checkpoints")
    assert all(verify_dir(store.local_path(n)) == [] for n in store.names())
    assert _train(run_dir, *ARITH, "run.resume=auto") == 0
    assert compare_runs(straight, run_dir) == []


# -- peer bugs ---------------------------------------------------------------------------------
def test_sft_resume_at_epoch_boundary_and_scheduler_steps_once(tmp_path):
    """verl #7401 (epoch boundary), slime #1547 / prime-rl #1095 (scheduler stepped twice):
    preempted SFT exactly at the end of an epoch resumes with the same data order and the same
    LR schedule as the run that was never stopped."""
    extra = ["sft.steps=6", "sft.demos=8", "sft.batch_size=4", "train.steps=0"]  # epoch: 2 steps
    ref = tmp_path / "ref"
    assert _train(ref, *extra) == 0
    run_dir = tmp_path / "run"

    def term_at_boundary() -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    set_fault_hook("checkpoint.write", term_at_boundary)  # first checkpoint: SFT step 2
    try:
        # the CLI with no config file runs the maze recipe: so does this run, for the resume below
        cfg = load_recipe(overrides=[*TINY, *extra, f"run.dir={run_dir}"])
        with pytest.raises(Preempted) as info:
            gyre.runners.train(cfg)
    finally:
        set_fault_hook("checkpoint.write", None)
    assert info.value.phase == "sft" and info.value.step == 2
    state = json.loads((Path(info.value.path) / "state.json").read_text())
    assert state["data"]["epoch"] == 0 and state["data"]["pos"] == 8  # end of epoch 0
    assert _train(run_dir, *extra, "run.resume=auto") == 0
    a, b = _lines(ref / "sft_metrics.jsonl"), _lines(run_dir / "sft_metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    lr = 3e-3
    assert [r["sft/lr"] for r in b] == pytest.approx([lr / 4, lr / 2, 3 * lr / 4, lr, lr, lr])
    assert [r["sft/lr"] for r in a] == [r["sft/lr"] for r in b]
    assert [r["sft/loss"] for r in a] == [r["sft/loss"] for r in b]
    assert compare_runs(ref, run_dir) == []
    assert not CheckpointStore(run_dir / "checkpoints").names("sft_")  # dropped once sft/ is done


def test_resume_replays_and_skips_no_data(straight, tmp_path):
    """open-instruct #1523 / open-r1 #450: resumed steps see the same tasks and rewards."""
    run_dir = tmp_path / "run"
    assert _train(run_dir, *ARITH, "train.steps=3") == 0
    state = json.loads((run_dir / "checkpoints" / "step_000003" / "state.json").read_text())
    assert state["cursor"] == 3 * 2  # tasks consumed: 2 a step
    assert _train(run_dir, *ARITH, "run.resume=auto") == 0
    a, b = _lines(straight / "metrics.jsonl"), _lines(run_dir / "metrics.jsonl")
    keys = ("rollout/reward_mean", "train/loss", "train/grad_norm", "train/entropy")
    pick = [(r["step"], *(r.get(k) for k in keys)) for r in a if "train/loss" in r]
    assert pick == [(r["step"], *(r.get(k) for k in keys)) for r in b if "train/loss" in r]
    final = json.loads((run_dir / "checkpoints" / "step_000006" / "state.json").read_text())
    assert final["cursor"] == 6 * 2


def test_second_run_in_same_dir(straight, tmp_path, capsys):
    """NeMo-RL #1624/#1637: a second run in a used dir refuses, overwrites only when told,
    and relaunching a finished run with resume=auto changes nothing."""
    run_dir = tmp_path / "run"
    assert _train(run_dir, *ARITH) == 0
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert _train(run_dir, *ARITH, "run.resume=auto") == 0  # finished: nothing redone
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    capsys.readouterr()
    assert _train(run_dir, *ARITH) == 1  # resume=never in a used dir
    err = capsys.readouterr().err
    assert "run.resume=auto" in err and "run.overwrite=true" in err
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    assert _train(run_dir, *ARITH, "run.overwrite=true") == 0  # told to start over
    assert compare_runs(straight, run_dir) == []


def test_config_mismatch_on_resume_lists_fields(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(run_dir, "train.steps=2") == 0
    capsys.readouterr()
    rc = _train(run_dir, "train.steps=4", "run.resume=auto", "train.lr=0.5", "run.seed=3")
    assert rc == 1
    err = capsys.readouterr().err
    assert "train.lr: checkpoint=0.0003, now=0.5" in err and "run.seed: checkpoint=0, now=3" in err
    assert _train_steps(run_dir) == [1, 2]  # nothing ran


def test_explicit_resume_path_and_memory_url(straight, tmp_path):
    """Checkpoints on an fsspec URL (memory://), resumed by an explicit path to one of them."""
    run_dir = tmp_path / "run"
    url = f"memory://gyre-test-{tmp_path.name}"
    assert (
        _train(run_dir, *ARITH, "train.steps=4", f"checkpoint.dir={url}", "checkpoint.keep=10") == 0
    )
    store = CheckpointStore(url)
    assert store.names()[-1] == "step_000004" and not (run_dir / "checkpoints").exists()
    # continue from step 3 explicitly (step 4's lines are dropped and recomputed)
    assert (
        _train(
            run_dir, *ARITH, f"checkpoint.dir={url}", f"run.resume={store.url_of('step_000003')}"
        )
        == 0
    )
    assert compare_runs(straight, run_dir) == []
    store.fs.rm(store.root, recursive=True)


def test_torn_metrics_tail_repaired_on_resume(straight, tmp_path):
    run_dir = tmp_path / "run"
    assert _train(run_dir, *ARITH, "train.steps=3") == 0
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rollout/rew')  # what a kill mid-write leaves
    assert _train(run_dir, *ARITH, "run.resume=auto") == 0
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    # same values as the straight run (this one also holds the 3-step run's final evaluation)
    a, b = _lines(straight / "metrics.jsonl"), _lines(run_dir / "metrics.jsonl")
    assert [r["train/loss"] for r in a if "train/loss" in r] == [
        r["train/loss"] for r in b if "train/loss" in r
    ]


# -- faults ------------------------------------------------------------------------------------
def _enospc_on(calls: list[int], which: int):
    def hook() -> None:
        calls.append(1)
        if len(calls) == which:
            raise OSError(errno.ENOSPC, "No space left on device")

    return hook


def test_disk_full_stops_with_clear_error_previous_intact(tmp_path, capsys):
    run_dir = tmp_path / "run"
    calls: list[int] = []
    set_fault_hook("checkpoint.write", _enospc_on(calls, 3))  # 3rd GRPO checkpoint
    try:
        capsys.readouterr()
        assert _train(run_dir, "sft.steps=0") == 1
    finally:
        set_fault_hook("checkpoint.write", None)
    err = capsys.readouterr().err
    assert "step_000003" in err and "No space left on device" in err
    store = CheckpointStore(run_dir / "checkpoints")
    assert store.names() == ["step_000001", "step_000002"]
    assert all(verify_dir(store.local_path(n)) == [] for n in store.names())
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == store.names()
    assert _train(run_dir, "sft.steps=0", "run.resume=auto") == 0
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5, 6]


def test_disk_full_continue_policy(tmp_path, caplog):
    run_dir = tmp_path / "run"
    calls: list[int] = []
    set_fault_hook("checkpoint.write", _enospc_on(calls, 2))
    try:
        with caplog.at_level(logging.WARNING):
            assert _train(run_dir, "sft.steps=0", "checkpoint.on_error=continue") == 0
    finally:
        set_fault_hook("checkpoint.write", None)
    assert "No space left on device" in caplog.text and "on_error=continue" in caplog.text
    assert _train_steps(run_dir) == [1, 2, 3, 4, 5, 6]


@pytest.fixture
def nan_loss(monkeypatch):
    """Make the PPO loss NaN on the GRPO steps listed in ``bad`` (1-based update calls)."""
    bad: set[int] = set()
    calls = {"n": 0}
    real_update = gyre.trainer.core.policy_update

    def update(model, optimizer, batch, adv, *a, **k):
        calls["n"] += 1
        if calls["n"] in bad:
            adv = adv * float("nan")
        return real_update(model, optimizer, batch, adv, *a, **k)

    monkeypatch.setattr(gyre.trainer.core, "policy_update", update)
    return bad


def test_nan_step_is_skipped_and_counted(nan_loss, tmp_path):
    nan_loss.update({2, 3})
    run_dir = tmp_path / "run"
    assert _train(run_dir, *ARITH, "sft.steps=0", "train.mini_batches=1") == 0
    recs = [r for r in _lines(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["train/nonfinite_skipped"] for r in recs] == [0, 1, 1, 0, 0, 0]
    assert recs[-1]["faults/nonfinite_steps"] == 2
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["faults"]["nonfinite_steps"] == 2
    # no NaN reached the weights
    w = load_file(run_dir / "final" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in w.values())


def test_nan_streak_aborts(nan_loss, tmp_path, capsys):
    nan_loss.update({2, 3, 4})
    run_dir = tmp_path / "run"
    capsys.readouterr()
    rc = _train(run_dir, "sft.steps=0", "faults.max_nonfinite_streak=3")
    assert rc == EXIT_FAULTS
    assert "3 steps in a row had a NaN/inf" in capsys.readouterr().err
    assert _train_steps(run_dir) == [1, 2, 3, 4]


class _FlakyEnv:
    """Wraps an env; raises in step() for every 3rd episode it is asked to play."""

    count = 0

    def __init__(self, inner):
        self.inner = inner
        _FlakyEnv.count += 1
        self.broken = _FlakyEnv.count % 3 == 0

    def reset(self, seed):
        return self.inner.reset(seed)

    def step(self, action):
        if self.broken:
            raise RuntimeError("reward server exploded")
        return self.inner.step(action)


@pytest.fixture
def flaky_env(monkeypatch):
    real = gyre.rollout.core.env_factory

    def factory(cfg):
        make = real(cfg)
        return lambda: _FlakyEnv(make())

    _FlakyEnv.count = 0
    monkeypatch.setattr(gyre.rollout.core, "env_factory", factory)


def test_env_exceptions_counted_logged_and_tolerated(flaky_env, tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="gyre.rollout.episodes"):
        assert (
            _train(
                run_dir,
                "sft.steps=0",
                "train.steps=2",
                "faults.max_failed_fraction=0.5",
                "eval.episodes=0",
            )
            == 0
        )
    recs = [r for r in _lines(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert sum(r["rollout/failed_episodes"] for r in recs) > 0
    assert "reward server exploded" in caplog.text and "Traceback" in caplog.text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 0 < summary["faults"]["failed_episodes"] <= summary["faults"]["episodes"]


def test_env_failure_fraction_aborts(flaky_env, tmp_path, capsys):
    run_dir = tmp_path / "run"
    capsys.readouterr()
    rc = _train(run_dir, "sft.steps=0", "faults.max_failed_fraction=0.1", "eval.episodes=0")
    assert rc == EXIT_FAULTS
    assert "faults.max_failed_fraction=0.1" in capsys.readouterr().err


def test_verify_resume_cli_validates_first(capsys):
    assert main(["verify-resume", "train.stepz=3"]) == 2
    assert "unknown config key 'train.stepz'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["verify-resume", "--help"])
    assert "--kills" in capsys.readouterr().out


def test_run_dir_urls(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert _train(f"file://{run_dir}", "sft.steps=0", "train.steps=1", "eval.episodes=0") == 0
    assert (run_dir / "checkpoints" / "step_000001" / "manifest.json").is_file()
    capsys.readouterr()
    assert _train("memory://somewhere", "sft.steps=0", "train.steps=1") == 1
    assert "checkpoint.dir=<fsspec URL>" in capsys.readouterr().err
