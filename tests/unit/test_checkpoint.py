"""Checkpoints: ordering, manifest verification, fallback to the previous one, retention, atomic
writes under a full disk, fsspec stores, state restore, config/model mismatch errors."""

from __future__ import annotations

import errno
import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import gyre
from gyre.checkpoint.files import MANIFEST_FILE, verify_dir, write_manifest
from gyre.checkpoint.identity import (
    CheckpointMismatchError,
    check_config,
    check_model,
    config_hash,
)
from gyre.checkpoint.snapshot import (
    STATE_FILE,
    Snapshot,
    load_checkpoint_state,
    load_into,
    save,
    save_checkpoint,
)
from gyre.checkpoint.store import (
    CheckpointError,
    CheckpointStore,
    checkpoint_dir,
    find_resume,
    list_checkpoints,
    newest_valid,
    set_fault_hook,
)
from gyre.config import load_config


def _fake(run_dir, name, manifest=True):
    d = checkpoint_dir(run_dir) / name
    d.mkdir(parents=True)
    (d / STATE_FILE).write_text(json.dumps({"step": 0}))
    if manifest:
        write_manifest(d, {"step": 0})
    return d


def test_list_orders_by_step_number(tmp_path):
    for name in ["step_000010", "step_000009", "step_100", "step_2", "step_000011"]:
        _fake(tmp_path, name)
    names = [p.name for p in list_checkpoints(tmp_path)]
    assert names == ["step_2", "step_000009", "step_000010", "step_000011", "step_100"]


def test_list_ignores_incomplete_and_temp(tmp_path):
    _fake(tmp_path, "step_000003")
    _fake(tmp_path, "step_000004", manifest=False)  # no manifest: incomplete
    _fake(tmp_path, ".tmp_step_000005")  # half-written
    _fake(tmp_path, "step_abc")
    _fake(tmp_path, "other")
    _fake(tmp_path, "sft_000007")  # SFT checkpoints are listed apart
    (checkpoint_dir(tmp_path) / "step_000006").write_text("a file, not a dir")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003"]


def test_list_without_checkpoint_dir(tmp_path):
    assert list_checkpoints(tmp_path) == []
    assert find_resume(tmp_path, "auto") is None


def test_find_resume_newest_broken_falls_back_with_warning(tmp_path, caplog):
    """prime-rl #1083: 'latest' must be the newest checkpoint that is complete and intact."""
    for name in ["step_000009", "step_000010", "step_000002"]:
        _fake(tmp_path, name)
    _fake(tmp_path, "step_000011", manifest=False)  # killed before its manifest
    broken = _fake(tmp_path, "step_000012")
    (broken / STATE_FILE).write_text(json.dumps({"step": 7}))  # same size, other bytes
    with caplog.at_level(logging.WARNING, logger="gyre.checkpoint.store"):
        assert find_resume(tmp_path, "auto").name == "step_000010"
    text = caplog.text
    assert "step_000012" in text and "sha256 mismatch" in text
    assert "step_000011" in text and "no manifest.json" in text
    assert find_resume(tmp_path, "never") is None
    explicit = checkpoint_dir(tmp_path) / "step_000002"
    assert find_resume(tmp_path, str(explicit)) == explicit
    with pytest.raises(FileNotFoundError, match=r"step_000012.*sha256"):
        find_resume(tmp_path, str(broken))


@pytest.fixture
def tiny(make_tiny_model):
    model = make_tiny_model(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # give the optimizer some state to save
    model(input_ids=torch.tensor([[1, 5, 6]])).logits.sum().backward()
    opt.step()
    return model, opt


def test_save_retention_contents_and_manifest(tmp_path, tiny, tokenizer):
    model, opt = tiny
    for step in (1, 2, 3, 4):
        path = save_checkpoint(
            tmp_path, model, tokenizer, Snapshot(step, {"cursor": 10 * step}, opt), keep=2
        )
        assert path.name == f"step_{step:06d}"
    kept = list_checkpoints(tmp_path)
    assert [p.name for p in kept] == ["step_000003", "step_000004"]
    leftovers = sorted(p.name for p in checkpoint_dir(tmp_path).iterdir())
    assert leftovers == ["step_000003", "step_000004"]  # no temp dirs, old ones deleted
    state = json.loads((kept[-1] / STATE_FILE).read_text())
    assert state == {"step": 4, "cursor": 40, "phase": "grpo"}
    assert (kept[-1] / "model" / "config.json").is_file()
    assert (kept[-1] / "optimizer.pt").is_file() and (kept[-1] / "rng.pt").is_file()
    manifest = json.loads((kept[-1] / MANIFEST_FILE).read_text())
    assert manifest["step"] == 4 and manifest["gyre_version"] == gyre.__version__
    assert "config_hash" in manifest
    on_disk = {str(p.relative_to(kept[-1])) for p in kept[-1].rglob("*") if p.is_file()} - {
        MANIFEST_FILE
    }
    assert set(manifest["files"]) == on_disk
    assert all(len(m["sha256"]) == 64 for m in manifest["files"].values())
    assert verify_dir(kept[-1]) == []


def test_retention_keeps_last_n_plus_every_mth(tmp_path, tiny, tokenizer):
    model, opt = tiny
    for step in range(1, 11):
        save_checkpoint(tmp_path, model, tokenizer, Snapshot(step, {}, opt), keep=2, keep_every=4)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step_000004",
        "step_000008",
        "step_000009",
        "step_000010",
    ]


def test_resave_same_step_replaces(tmp_path, tiny, tokenizer):
    model, opt = tiny
    save_checkpoint(tmp_path, model, tokenizer, Snapshot(5, {"cursor": 1}, opt), keep=3)
    save_checkpoint(tmp_path, model, tokenizer, Snapshot(5, {"cursor": 2}, opt), keep=3)
    [only] = list_checkpoints(tmp_path)
    assert json.loads((only / STATE_FILE).read_text())["cursor"] == 2
    assert verify_dir(only) == []


def test_corrupt_weights_detected(tmp_path, tiny, tokenizer, caplog):
    model, opt = tiny
    good = save_checkpoint(tmp_path, model, tokenizer, Snapshot(1, {}, opt), keep=5)
    bad = save_checkpoint(tmp_path, model, tokenizer, Snapshot(2, {}, opt), keep=5)
    weights = bad / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit
    weights.write_bytes(bytes(data))
    assert any("model/model.safetensors sha256 mismatch" in p for p in verify_dir(bad))
    with caplog.at_level(logging.WARNING):
        assert find_resume(tmp_path, "auto") == good
    assert "step_000002" in caplog.text
    # a truncated file (partial copy) is caught by its size
    weights.write_bytes(bytes(data[:100]))
    assert any("bytes, manifest says" in p for p in verify_dir(bad))


def test_disk_full_during_write_keeps_previous(tmp_path, tiny, tokenizer):
    """ENOSPC mid-write: a clear error, the previous checkpoint intact, no staging left over."""
    model, opt = tiny
    first = save_checkpoint(tmp_path, model, tokenizer, Snapshot(1, {"cursor": 1}, opt), keep=1)

    def full() -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    set_fault_hook("checkpoint.write", full)
    try:
        full_disk = r"No space left on device writing checkpoint .*step_000002"
        with pytest.raises(CheckpointError, match=full_disk):
            save_checkpoint(tmp_path, model, tokenizer, Snapshot(2, {"cursor": 2}, opt), keep=1)
    finally:
        set_fault_hook("checkpoint.write", None)
    assert [p.name for p in checkpoint_dir(tmp_path).iterdir()] == ["step_000001"]
    assert verify_dir(first) == [] and find_resume(tmp_path, "auto") == first


def test_load_restores_optimizer_rng_scheduler_and_generators(
    tmp_path, tiny, tokenizer, make_tiny_model
):
    model, opt = tiny
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    for _ in range(3):
        opt.step()
        sched.step()
    g_torch = torch.Generator().manual_seed(5)
    g_np = np.random.default_rng(6)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    snap = Snapshot(7, {"cursor": 3}, opt, sched, {"a": g_torch, "b": g_np})
    path = save_checkpoint(tmp_path, model, tokenizer, snap, keep=1)
    expected = (
        random.random(),
        float(np.random.rand()),
        torch.rand(2),
        torch.rand(2, generator=g_torch),
        g_np.random(),
    )
    fresh_model = make_tiny_model(seed=0)
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    fresh_sched = torch.optim.lr_scheduler.LambdaLR(fresh_opt, lambda s: 1.0 / (s + 1))
    g2_torch, g2_np = torch.Generator(), np.random.default_rng(0)
    state = load_checkpoint_state(path, fresh_opt, fresh_sched, {"a": g2_torch, "b": g2_np})
    assert state == {"step": 7, "cursor": 3, "phase": "grpo"}
    got = (
        random.random(),
        float(np.random.rand()),
        torch.rand(2),
        torch.rand(2, generator=g2_torch),
        g2_np.random(),
    )
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
    assert torch.equal(got[3], expected[3]) and got[4] == expected[4]
    # the scheduler resumes where it was: not re-stepped, not restarted
    assert fresh_sched.last_epoch == sched.last_epoch == 3
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    for k, v in saved["state"].items():
        assert torch.equal(loaded["state"][k]["exp_avg"], v["exp_avg"])
        assert torch.equal(loaded["state"][k]["exp_avg_sq"], v["exp_avg_sq"])


def test_step_argument_wins_over_loaded_state(tmp_path, tiny, tokenizer):
    model, opt = tiny
    first = save_checkpoint(tmp_path, model, tokenizer, Snapshot(3, {"cursor": 6}, opt), keep=5)
    state = load_checkpoint_state(first, opt)  # what loop.train does on resume
    nxt = save_checkpoint(
        tmp_path, model, tokenizer, Snapshot(4, {**state, "cursor": 8}, opt), keep=5
    )
    assert json.loads((nxt / STATE_FILE).read_text())["step"] == 4
    assert find_resume(tmp_path, "auto") == nxt


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_store_round_trip(scheme, tmp_path, tiny, tokenizer, caplog):
    model, opt = tiny
    url = f"memory://ckpt-test-{tmp_path.name}" if scheme == "memory" else f"file://{tmp_path}/c"
    store = CheckpointStore(url)
    assert store.local == (scheme == "file")
    for step in (1, 2, 3):
        save(
            store,
            f"step_{step:06d}",
            model,
            tokenizer,
            Snapshot(step, {"cursor": step}, opt, config={"a": 1}),
        )
    store.prune("step_", keep=2)
    assert store.names() == ["step_000002", "step_000003"]
    cache = tmp_path / "cache"
    name, local = newest_valid(store, "step_", cache)
    assert name == "step_000003" and verify_dir(local) == []
    assert json.loads((local / STATE_FILE).read_text())["cursor"] == 3
    # break the newest in the store itself: the previous one is used, with a warning
    store.fs.pipe_file(store.path("step_000003/optimizer.pt"), b"garbage")
    with caplog.at_level(logging.WARNING):
        name, local = newest_valid(store, "step_", cache)
    assert name == "step_000002" and "step_000003" in caplog.text
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert load_into(local, fresh)["step"] == 2
    if scheme == "memory":
        store.fs.rm(store.root, recursive=True)


def test_config_mismatch_lists_fields(tmp_path):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    saved = load_config(None, ["train.lr=0.001", "run.seed=1"]).model_dump(mode="json")
    (ckpt / "config.json").write_text(json.dumps(saved))
    # keys that do not change the trajectory may differ (a longer run, another dir, eval...)
    ok = load_config(
        None,
        [
            "train.lr=0.001",
            "run.seed=1",
            "train.steps=999",
            "run.dir=x",
            "eval.episodes=3",
            "checkpoint.every=7",
        ],
    ).model_dump(mode="json")
    check_config(ckpt, ok)
    assert config_hash(ok) == config_hash(saved)
    bad = load_config(None, ["train.lr=0.002", "run.seed=1", "model.hidden_size=64"])
    with pytest.raises(CheckpointMismatchError) as info:
        check_config(ckpt, bad.model_dump(mode="json"))
    msg = str(info.value)
    assert "train.lr: checkpoint=0.001, now=0.002" in msg
    assert "model.hidden_size: checkpoint=128, now=64" in msg
    assert "run.seed" not in msg and "train.steps" not in msg


def test_resume_on_another_placement_is_accepted(tmp_path):
    """Where the roles run and on how many ranks is not the run's identity (a cluster that lost
    a node resumes on the rest); what they compute is: another ray.mode is refused."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    base = ["runner=ray", "train.tasks_per_step=8"]
    saved = load_config(None, [*base, "ray.trainer_ranks=2"]).model_dump(mode="json")
    (ckpt / "config.json").write_text(json.dumps(saved))
    moved = [
        "ray.trainer_ranks=1",
        "ray.strategy=fsdp2",
        "ray.placement=colocated",
        "ray.placement_strategy=SPREAD",
        "ray.num_cpus=5",
        "ray.trainer.num_cpus=0.5",
        "ray.rollout.resources={gyre_rollout: 1}",
        "ray.handover.offload_optimizer=true",
        "ray.max_trainer_restarts=5",
        "ray.health_check_period_s=1",
        "ray.replacement_wait_s=30",
    ]
    now = load_config(None, [*base, *moved]).model_dump(mode="json")
    check_config(ckpt, now)
    assert config_hash(now) == config_hash(saved)
    other = load_config(None, [*base, "ray.trainer_ranks=2", "ray.mode=one-step-off"])
    with pytest.raises(CheckpointMismatchError, match=r"ray\.mode: checkpoint='sync'"):
        check_config(ckpt, other.model_dump(mode="json"))


@pytest.mark.parametrize(
    ("schedule", "warns"), [("linear", True), ("cosine", True), ("constant", False)]
)
def test_extending_train_steps_under_a_decaying_schedule_warns(tmp_path, caplog, schedule, warns):
    """train.steps may grow on resume, but a decaying LR spans it: the decay is re-timed, and
    the user is told the run no longer equals one run of the new length."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    base = [f"train.lr_schedule={schedule}"]
    saved = load_config(None, [*base, "train.steps=2"]).model_dump(mode="json")
    (ckpt / "config.json").write_text(json.dumps(saved))
    with caplog.at_level(logging.WARNING, logger="gyre.checkpoint.identity"):
        check_config(ckpt, load_config(None, [*base, "train.steps=2"]).model_dump(mode="json"))
        assert not caplog.records
        check_config(ckpt, load_config(None, [*base, "train.steps=4"]).model_dump(mode="json"))
    msgs = [r.getMessage() for r in caplog.records]
    assert bool(msgs) == warns, msgs
    if warns:
        assert "train.steps: checkpoint=2, now=4" in msgs[0] and schedule in msgs[0]


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("perf.pack=false", "perf.pack: checkpoint=True, now=False"),
        ("perf.logprob_chunk=256", "perf.logprob_chunk: checkpoint=1024, now=256"),
        ("perf.continuous=false", "perf.continuous: checkpoint=True, now=False"),
    ],
)
def test_resume_with_other_perf_values_is_refused(tmp_path, override, line):
    """perf.* can change float order, so like any identity key it is in the config hash and a
    resume with another value is refused, naming the key (as for train.lr above)."""
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    saved = load_config(None, ["run.seed=1"]).model_dump(mode="json")
    (ckpt / "config.json").write_text(json.dumps(saved))
    assert saved["perf"]["pack"] is True  # the section is part of the saved run config
    now = load_config(None, ["run.seed=1", override]).model_dump(mode="json")
    assert config_hash(now) != config_hash(saved)
    with pytest.raises(CheckpointMismatchError) as info:
        check_config(ckpt, now)
    assert line in str(info.value)
    same = load_config(None, ["run.seed=1"]).model_dump(mode="json")
    check_config(ckpt, same)
    assert config_hash(same) == config_hash(saved)


def test_model_mismatch_lists_fields(tmp_path, tiny_cfg):
    from gyre.models.build import create_tiny_checkpoint

    a = create_tiny_checkpoint(tiny_cfg, tmp_path / "a", seed=0)
    b = create_tiny_checkpoint(tiny_cfg.model_copy(update={"num_layers": 3}), tmp_path / "b", 0)
    check_model(a, a)
    with pytest.raises(CheckpointMismatchError, match="num_hidden_layers: checkpoint=2, now=3"):
        check_model(a, b)


def test_kill_during_same_step_resave_keeps_the_old_copy(tmp_path, tiny, tokenizer):
    """Killed between moving step_N aside and renaming its replacement in: step_N comes back."""
    model, opt = tiny
    path = save_checkpoint(tmp_path, model, tokenizer, Snapshot(4, {"cursor": 1}, opt), keep=1)
    root = checkpoint_dir(tmp_path)
    path.rename(root / ".old_step_000004")  # the state right after the first rename
    (root / ".tmp_step_000004").mkdir()  # the replacement, never renamed in
    store = CheckpointStore(root)
    store.clean_staging()
    assert sorted(p.name for p in root.iterdir()) == ["step_000004"]
    assert verify_dir(root / "step_000004") == []
    assert find_resume(tmp_path, "auto") == root / "step_000004"


def test_the_package_version_is_pyprojects_and_the_changelogs():
    import tomllib

    root = Path(__file__).resolve().parents[2]
    declared = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    assert gyre.__version__ == declared
    assert f"## [{declared}]" in (root / "CHANGELOG.md").read_text()
